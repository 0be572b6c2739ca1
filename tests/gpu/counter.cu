// NVIDIA's cuda-checkpoint counter example, for revenant's GPU checks: every UDP packet
// that reaches 127.0.0.1:PORT runs a kernel that increments a __device__ counter (starting
// at 100); the new value goes back to the sender as "%d\n" and to stdout.
//
//   nvcc -O2 -gencode arch=compute_90,code=[sm_90,compute_90] -o counter counter.cu
//   ./counter [PORT]          (default 10000)
//   echo hi | nc -u -w1 127.0.0.1 10000     -> 101
//   ./counter --poll FILE     no socket: each byte appended to FILE is a packet, answered
//                             on stdout only (CRIU 4.1 cannot dump an INET socket on
//                             Linux >= 6.16: SO_PASSCRED is refused there)
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

__device__ int counter = 100;

__global__ void increment() { counter++; }

static void check(cudaError_t err, const char *what) {
    if (err != cudaSuccess) {
        fprintf(stderr, "counter: %s: %s (%s)\n", what, cudaGetErrorString(err), cudaGetErrorName(err));
        exit(1);
    }
}

static int next_value() {
    int value = 0;
    increment<<<1, 1>>>();
    check(cudaGetLastError(), "increment<<<1, 1>>>");
    check(cudaMemcpyFromSymbol(&value, counter, sizeof counter), "cudaMemcpyFromSymbol");
    return value;
}

static int poll_file(const char *path) {
    check(cudaFree(0), "cudaFree(0)");
    long long seen = 0;
    printf("counter: listening on %s\n", path);
    fflush(stdout);
    while (true) {
        struct stat st;
        for (; stat(path, &st) == 0 && seen < (long long)st.st_size; seen++) {
            printf("%d\n", next_value());
            fflush(stdout);
        }
        usleep(20000);
    }
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--poll") == 0) return poll_file(argv[2]);
    int port = argc > 1 ? atoi(argv[1]) : 10000;
    if (port <= 0 || port > 65535) {
        fprintf(stderr, "counter: bad port %s\n", argv[1]);
        return 2;
    }
    check(cudaFree(0), "cudaFree(0)");  // create the context before the first packet

    int sock = socket(AF_INET, SOCK_DGRAM, 0);
    if (sock < 0) {
        perror("counter: socket");
        return 1;
    }
    sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((unsigned short)port);
    addr.sin_addr.s_addr = inet_addr("127.0.0.1");
    if (bind(sock, (sockaddr *)&addr, sizeof addr) < 0) {
        perror("counter: bind");
        return 1;
    }
    printf("counter: listening on 127.0.0.1:%d\n", port);
    fflush(stdout);

    while (true) {
        char buffer[16] = {0};
        sockaddr_in peer;
        memset(&peer, 0, sizeof peer);
        socklen_t peer_size = sizeof peer;
        if (recvfrom(sock, buffer, sizeof buffer, 0, (sockaddr *)&peer, &peer_size) < 0) {
            perror("counter: recvfrom");
            continue;  // EINTR around a checkpoint, say
        }
        int value = next_value();
        int bytes = snprintf(buffer, sizeof buffer, "%d\n", value);
        sendto(sock, buffer, bytes, 0, (sockaddr *)&peer, peer_size);
        printf("%d\n", value);
        fflush(stdout);
    }
}
