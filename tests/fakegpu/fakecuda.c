/*
 * fakecuda.c -- a TEST STAND-IN for NVIDIA's libcuda.so.1 checkpoint API and the
 * `cuda-checkpoint` utility.  It drives no GPU: it lets revenant's GPU checkpoint code run on
 * machines without one.  Built by tests/fakegpu/__init__.py, twice from this one file:
 *   cc -shared -fPIC            -> libcuda.so.1      (loaded with ctypes like the real one)
 *   cc -DFAKECUDA_MAIN          -> cuda-checkpoint   (a main() over the same functions)
 *   cc -shared -DFAKECUDA_NO_API -> an old libcuda without the cuCheckpoint* symbols
 *
 * What it mirrors from cuda.h (CUDA 12.8 / 13.0, driver r570 / r580):
 *   - CUresult values (CUDA_SUCCESS 0, INVALID_VALUE 1, NOT_INITIALIZED 3, NO_DEVICE 100,
 *     OPERATING_SYSTEM 304, ILLEGAL_STATE 401, NOT_FOUND 500, NOT_PERMITTED 800,
 *     NOT_SUPPORTED 801, TIMEOUT 909, UNKNOWN 999) and cuGetErrorName / cuGetErrorString;
 *   - CUprocessState {RUNNING 0, LOCKED 1, CHECKPOINTED 2, FAILED 3};
 *   - the 64-byte argument structs CUcheckpointLockArgs {timeoutMs, reserved0, reserved1[7]},
 *     CUcheckpointCheckpointArgs / CUcheckpointUnlockArgs {reserved[8]},
 *     CUcheckpointRestoreArgs {CUcheckpointGpuPair *gpuPairs; gpuPairsCount; reserved...}
 *     with CUcheckpointGpuPair {CUuuid oldUuid, newUuid} (CUuuid = 16 raw bytes);
 *   - the transitions RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED
 *     -unlock-> RUNNING; the CUDA process state itself lives in that process (not here).
 *
 * How it works: the state dir is $REVENANT_FAKEGPU_DIR.  A fake CUDA process (tests/jobs/
 * gpucounter.py) has REVENANT_FAKEGPU_CTX=<ctx> in its environment and serves requests in
 * <dir>/ctx/<ctx>/: a caller writes req-<id> ("op args\n"), the process answers resp-<id>
 * ("<CUresult> <state>\n").  A pid is resolved to its ctx through /proc/<pid>/environ, so it
 * works across PID namespaces and after a criu restore (new pid, same environment).
 * Failure injection: <dir>/fail/<call> holds "code times leave_state delay_ms".
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
enum {
    CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100, CUDA_ERROR_OPERATING_SYSTEM = 304, CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500, CUDA_ERROR_NOT_PERMITTED = 800, CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_TIMEOUT = 909, CUDA_ERROR_UNKNOWN = 999,
};
typedef enum {
    CU_PROCESS_STATE_RUNNING = 0, CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2, CU_PROCESS_STATE_FAILED = 3,
} CUprocessState;

typedef struct { unsigned char bytes[16]; } CUuuid;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct { unsigned int timeoutMs; unsigned int reserved0; uint64_t reserved1[7]; } CUcheckpointLockArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointCheckpointArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointUnlockArgs;
typedef struct {
    CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount; char reserved[52 - sizeof(void *)];
    uint64_t reserved1;
} CUcheckpointRestoreArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "lock args");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "checkpoint args");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "restore args");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "gpu pair");

static const struct { CUresult code; const char *name, *text; } ERRORS[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "the operation timed out"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
static const char *STATES[] = {"running", "locked", "checkpointed", "failed"};

CUresult cuGetErrorName(CUresult error, const char **p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(ERRORS) / sizeof(ERRORS[0]); i++)
        if (ERRORS[i].code == error) { *p = ERRORS[i].name; return CUDA_SUCCESS; }
    *p = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(ERRORS) / sizeof(ERRORS[0]); i++)
        if (ERRORS[i].code == error) { *p = ERRORS[i].text; return CUDA_SUCCESS; }
    *p = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ the state dir */

static const char *state_dir(void) {
    const char *d = getenv("REVENANT_FAKEGPU_DIR");
    return (d && *d) ? d : NULL;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* "<key> <value>" lines of <dir>/config: the value of the first line with that key. */
static int config_value(const char *key, char *out, size_t len) {
    const char *d = state_dir();
    char path[4096], line[512];
    if (!d) return -1;
    snprintf(path, sizeof path, "%s/config", d);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t klen = strlen(key);
    int found = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) == 0 && line[klen] == ' ') {
            line[strcspn(line, "\n")] = 0;
            snprintf(out, len, "%s", line + klen + 1);
            found = 0;
            break;
        }
    }
    fclose(f);
    return found;
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    return config_value("no_device", (char[8]){0}, 8) == 0 ? CUDA_ERROR_NO_DEVICE : CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    char v[64];
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = config_value("cuda", v, sizeof v) == 0 ? atoi(v) : 12080;
    return CUDA_SUCCESS;
}

/* Failure injection: <dir>/fail/<call> = "code times leave_state delay_ms" (leave_state "-":
 * unchanged).  Consumed one use at a time under a lock.  Returns 1 with *code set when this
 * call is to fail. */
static int injected(const char *call, CUresult *code, char *leave, size_t leave_len) {
    const char *d = state_dir();
    char path[4096], lockp[4096];
    int fired = 0;
    if (!d) return 0;
    snprintf(path, sizeof path, "%s/fail/%s", d, call);
    if (access(path, F_OK) != 0) return 0;
    snprintf(lockp, sizeof lockp, "%s/fail/.lock", d);
    int lk = open(lockp, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lk >= 0) flock(lk, LOCK_EX);
    FILE *f = fopen(path, "r");
    if (f) {
        int c = 0, times = 0;
        long delay = 0;
        char st[32] = "-";
        int n = fscanf(f, "%d %d %31s %ld", &c, &times, st, &delay);
        fclose(f);
        if (n >= 2 && times != 0) {
            fired = 1;
            *code = c;
            snprintf(leave, leave_len, "%s", st);
            if (times > 0) times--;
            if (times == 0) {
                unlink(path);
            } else if ((f = fopen(path, "w"))) {
                fprintf(f, "%d %d %s %ld\n", c, times, st, delay);
                fclose(f);
            }
            if (delay > 0) sleep_ms(delay);
        }
    }
    if (lk >= 0) close(lk);
    return fired;
}

/* The fake context of a pid: REVENANT_FAKEGPU_CTX in /proc/<pid>/environ.
 * Returns 0, or a CUresult: no such process / not a CUDA process. */
static CUresult context_of(int pid, char *ctx, size_t len) {
    char path[64];
    static char buf[1 << 17];
    if (pid <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(path, sizeof path, "/proc/%d/environ", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    ssize_t n = 0, r;
    while (n < (ssize_t)sizeof buf - 1 && (r = read(fd, buf + n, sizeof buf - 1 - n)) > 0) n += r;
    close(fd);
    buf[n < 0 ? 0 : n] = 0;
    const char *key = "REVENANT_FAKEGPU_CTX=";
    for (ssize_t i = 0; i < n; i += strlen(buf + i) + 1) {
        if (strncmp(buf + i, key, strlen(key)) == 0) {
            snprintf(ctx, len, "%s", buf + i + strlen(key));
            return *ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
        }
    }
    return CUDA_ERROR_INVALID_VALUE; /* like the real driver: not a CUDA process */
}

/* One request to the process's in-process driver; its answer's CUresult and state. */
static CUresult ask(int pid, const char *request, long wait_ms, CUprocessState *state) {
    const char *d = state_dir();
    char ctx[256], cdir[4096], tmp[4400], req[4400], resp[4400], id[96];
    static unsigned seq;
    CUresult rc;
    if (!d) return CUDA_ERROR_NO_DEVICE;
    if ((rc = context_of(pid, ctx, sizeof ctx)) != CUDA_SUCCESS) return rc;
    snprintf(cdir, sizeof cdir, "%s/ctx/%s", d, ctx);
    struct stat st;
    if (stat(cdir, &st) != 0) return CUDA_ERROR_NOT_INITIALIZED; /* never called cuInit */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    snprintf(id, sizeof id, "%ld-%d-%u-%ld", (long)now.tv_sec, (int)getpid(), __sync_add_and_fetch(&seq, 1),
             now.tv_nsec);
    snprintf(tmp, sizeof tmp, "%s/.req-%s", cdir, id);
    snprintf(req, sizeof req, "%s/req-%s", cdir, id);
    snprintf(resp, sizeof resp, "%s/resp-%s", cdir, id);
    FILE *f = fopen(tmp, "w");
    if (!f) return CUDA_ERROR_OPERATING_SYSTEM;
    fprintf(f, "%s\n", request);
    fclose(f);
    if (rename(tmp, req) != 0) { unlink(tmp); return CUDA_ERROR_OPERATING_SYSTEM; }
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/%d", pid);
    for (long waited = 0; wait_ms < 0 || waited <= wait_ms; waited += 2) {
        if ((f = fopen(resp, "r"))) {
            int code = CUDA_ERROR_UNKNOWN, s = 0;
            char name[32] = "";
            if (fscanf(f, "%d %31s", &code, name) == 2 && state) {
                for (s = 0; s < 4; s++) if (strcmp(name, STATES[s]) == 0) { *state = (CUprocessState)s; break; }
            }
            fclose(f);
            unlink(resp);
            return code;
        }
        if (waited % 200 == 0 && access(proc, F_OK) != 0) break; /* the process is gone */
        sleep_ms(2);
    }
    unlink(req); /* unanswered: withdraw it, so a later incarnation never acts on it */
    return access(proc, F_OK) == 0 ? CUDA_ERROR_TIMEOUT : CUDA_ERROR_INVALID_VALUE;
}

#define ANSWER_MS 30000L

/* An injected failure: optionally move the process to leave_state first. */
__attribute__((unused)) static int fail_here(const char *call, int pid, CUresult *rc) {
    char leave[32];
    if (!injected(call, rc, leave, sizeof leave)) return 0;
    if (strcmp(leave, "-") != 0) {
        char req[64];
        snprintf(req, sizeof req, "force %s", leave);
        ask(pid, req, ANSWER_MS, NULL);
    }
    return 1;
}

#ifndef FAKECUDA_NO_API
CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    CUresult rc;
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    if (fail_here("get_state", pid, &rc)) return rc;
    return ask(pid, "state", ANSWER_MS, state);
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    CUresult rc;
    char req[64];
    unsigned timeout = args ? args->timeoutMs : 0;
    if (fail_here("lock", pid, &rc)) return rc;
    snprintf(req, sizeof req, "lock %u", timeout);
    return ask(pid, req, timeout ? (long)timeout + ANSWER_MS : -1, NULL);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    CUresult rc;
    (void)args;
    if (fail_here("checkpoint", pid, &rc)) return rc;
    return ask(pid, "checkpoint", ANSWER_MS, NULL);
}

static void uuid_text(const CUuuid *u, char *out) {
    const unsigned char *b = u->bytes;
    sprintf(out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    CUresult rc;
    char req[8192] = "restore";
    if (args && args->gpuPairsCount) {
        if (!args->gpuPairs || args->gpuPairsCount > 64) return CUDA_ERROR_INVALID_VALUE;
        for (unsigned i = 0; i < args->gpuPairsCount; i++) {
            char a[48], b[48];
            uuid_text(&args->gpuPairs[i].oldUuid, a);
            uuid_text(&args->gpuPairs[i].newUuid, b);
            size_t n = strlen(req);
            snprintf(req + n, sizeof req - n, " %s=%s", a, b);
        }
    }
    if (fail_here("restore", pid, &rc)) return rc;
    return ask(pid, req, ANSWER_MS, NULL);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    CUresult rc;
    (void)args;
    if (fail_here("unlock", pid, &rc)) return rc;
    return ask(pid, "unlock", ANSWER_MS, NULL);
}

/* The process's restore thread: the one it named "cuda-restore" (its tid as the caller sees it). */
CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    CUresult rc;
    char ctx[256], path[320], comm[64];
    if (!tid) return CUDA_ERROR_INVALID_VALUE;
    if (fail_here("get_restore_tid", pid, &rc)) return rc;
    if ((rc = context_of(pid, ctx, sizeof ctx)) != CUDA_SUCCESS) return rc;
    snprintf(path, sizeof path, "/proc/%d/task", pid);
    DIR *dir = opendir(path);
    if (!dir) return CUDA_ERROR_INVALID_VALUE;
    struct dirent *e;
    rc = CUDA_ERROR_NOT_INITIALIZED;
    while ((e = readdir(dir))) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/%d/task/%.32s/comm", pid, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        if (fgets(comm, sizeof comm, f) && strncmp(comm, "cuda-restore", 12) == 0) {
            *tid = atoi(e->d_name);
            rc = CUDA_SUCCESS;
        }
        fclose(f);
        if (rc == CUDA_SUCCESS) break;
    }
    closedir(dir);
    return rc;
}
#endif

/* ------------------------------------------------------------------ cuda-checkpoint */
#ifdef FAKECUDA_MAIN

static int driver_major(char *version, size_t len) {
    if (config_value("driver", version, len) != 0) snprintf(version, len, "570.86.10");
    return atoi(version);
}

static void help(void) {
    char version[64];
    int major = driver_major(version, sizeof version);
    printf("CUDA checkpoint and restore utility.\n"
           "Version %s. Copyright (C) 2024 NVIDIA Corporation. All rights reserved.\n\n"
           "    Toggles the state of CUDA within a process between suspended and running.\n\n"
           "Options:\n", version);
    if (major >= 555) {
        printf("    --action <lock|checkpoint|restore|unlock>\n"
               "                        Perform one step of the checkpoint on the process.\n"
               "    --get-state         Print the CUDA state of the process.\n"
               "    --get-restore-tid   Print the restore thread id of the process.\n"
               "    --timeout <ms>      Timeout of the lock action in milliseconds.\n"
               "    --device-map <old=new,...>\n"
               "                        GPU UUID remapping for the restore action.\n");
    }
    printf("    --toggle            Toggle the process between running and checkpointed.\n"
           "    --pid <pid>         The process to act on.\n"
           "    --help              Print this help.\n");
}

static int parse_uuid(const char *s, CUuuid *u) {
    if (strncmp(s, "GPU-", 4) == 0) s += 4;
    int n = 0;
    for (; *s && n < 32; s++) {
        if (*s == '-') continue;
        char h[3] = {s[0], s[1], 0};
        if (!s[1]) return -1;
        char *end;
        u->bytes[n / 2] = (unsigned char)strtoul(h, &end, 16);
        if (*end) return -1;
        n += 2;
        s++;
    }
    return (n == 32 && !*s) ? 0 : -1;
}

static int report(CUresult rc, const char *what, int pid) {
    const char *name = NULL;
    if (rc == CUDA_SUCCESS) return 0;
    cuGetErrorName(rc, &name);
    fprintf(stderr, "Could not %s process %d: %s\n", what, pid, name ? name : "CUDA_ERROR_UNKNOWN");
    return 1;
}

int main(int argc, char **argv) {
    const char *action = NULL, *map = NULL;
    int pid = 0, get_state = 0, get_tid = 0, toggle = 0;
    unsigned timeout = 0;
    char version[64];
    int modern = driver_major(version, sizeof version) >= 555;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--pid") && has) pid = atoi(argv[++i]);
        else if (!strcmp(a, "--toggle")) toggle = 1;
        else if (modern && !strcmp(a, "--action") && has) action = argv[++i];
        else if (modern && !strcmp(a, "--timeout") && has) timeout = (unsigned)strtoul(argv[++i], NULL, 10);
        else if (modern && !strcmp(a, "--device-map") && has) map = argv[++i];
        else if (modern && !strcmp(a, "--get-state")) get_state = 1;
        else if (modern && !strcmp(a, "--get-restore-tid")) get_tid = 1;
        else { fprintf(stderr, "Unrecognized option: %s\n", a); return 1; }
    }
    if (pid <= 0) { fprintf(stderr, "A --pid is required\n"); return 1; }
    CUresult rc;
    if (get_state) {
        CUprocessState s;
        if ((rc = cuCheckpointProcessGetState(pid, &s)) != CUDA_SUCCESS) return report(rc, "get the state of", pid);
        printf("%s\n", STATES[s]);
        return 0;
    }
    if (get_tid) {
        int tid;
        if ((rc = cuCheckpointProcessGetRestoreThreadId(pid, &tid)) != CUDA_SUCCESS)
            return report(rc, "get the restore thread id of", pid);
        printf("%d\n", tid);
        return 0;
    }
    if (toggle) {
        CUprocessState s;
        if ((rc = cuCheckpointProcessGetState(pid, &s)) != CUDA_SUCCESS) return report(rc, "toggle", pid);
        if (s == CU_PROCESS_STATE_RUNNING) {
            CUcheckpointLockArgs la = {0};
            CUcheckpointCheckpointArgs ca = {{0}};
            if ((rc = cuCheckpointProcessLock(pid, &la)) != CUDA_SUCCESS) return report(rc, "lock", pid);
            return report(cuCheckpointProcessCheckpoint(pid, &ca), "checkpoint", pid);
        }
        if (s == CU_PROCESS_STATE_CHECKPOINTED) {
            CUcheckpointRestoreArgs ra;
            CUcheckpointUnlockArgs ua = {{0}};
            memset(&ra, 0, sizeof ra);
            if ((rc = cuCheckpointProcessRestore(pid, &ra)) != CUDA_SUCCESS) return report(rc, "restore", pid);
            return report(cuCheckpointProcessUnlock(pid, &ua), "unlock", pid);
        }
        return report(CUDA_ERROR_ILLEGAL_STATE, "toggle", pid);
    }
    if (!action) { fprintf(stderr, "Nothing to do: give --action, --get-state or --toggle\n"); return 1; }
    if (!strcmp(action, "lock")) {
        CUcheckpointLockArgs la = {0};
        la.timeoutMs = timeout;
        return report(cuCheckpointProcessLock(pid, &la), "lock", pid);
    }
    if (!strcmp(action, "checkpoint")) {
        CUcheckpointCheckpointArgs ca = {{0}};
        return report(cuCheckpointProcessCheckpoint(pid, &ca), "checkpoint", pid);
    }
    if (!strcmp(action, "unlock")) {
        CUcheckpointUnlockArgs ua = {{0}};
        return report(cuCheckpointProcessUnlock(pid, &ua), "unlock", pid);
    }
    if (!strcmp(action, "restore")) {
        CUcheckpointRestoreArgs ra;
        CUcheckpointGpuPair pairs[64];
        memset(&ra, 0, sizeof ra);
        if (map && *map) {
            char *copy = strdup(map), *save = NULL;
            unsigned n = 0;
            for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
                char *eq = strchr(item, '=');
                if (!eq || n >= 64) { fprintf(stderr, "Bad --device-map entry: %s\n", item); return 1; }
                *eq = 0;
                if (parse_uuid(item, &pairs[n].oldUuid) || parse_uuid(eq + 1, &pairs[n].newUuid)) {
                    fprintf(stderr, "Bad GPU UUID in --device-map: %s=%s\n", item, eq + 1);
                    return 1;
                }
                n++;
            }
            free(copy);
            ra.gpuPairs = pairs;
            ra.gpuPairsCount = n;
        }
        return report(cuCheckpointProcessRestore(pid, &ra), "restore", pid);
    }
    fprintf(stderr, "Unknown action: %s\n", action);
    return 1;
}
#endif
