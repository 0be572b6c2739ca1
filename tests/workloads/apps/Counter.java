// A JVM job for tests/workloads: prints "line <i> <h>" for i = 1..N, every INTERVAL ms, where
// h is a running hash of everything printed before, so a line lost, repeated or out of order
// changes every line after it.  Usage: java Counter N INTERVAL_MS
public class Counter {
    public static void main(String[] args) throws Exception {
        int n = Integer.parseInt(args[0]);
        long interval = Long.parseLong(args[1]);
        long h = 17;
        for (int i = 1; i <= n; i++) {
            h = (h * 31 + i) % 1000000007L;
            System.out.println("line " + i + " " + h);
            System.out.flush();
            Thread.sleep(interval);
        }
    }
}
