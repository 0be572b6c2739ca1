/*
 * fakenvml.c -- a TEST STAND-IN for NVIDIA's libnvidia-ml.so.1 (NVML), built as
 * libnvidia-ml.so.1 by tests/fakegpu/__init__.py and loaded by pynvml (CDLL("libnvidia-ml.so.1")
 * through LD_LIBRARY_PATH).  No GPU is involved.
 *
 * What it mirrors from nvml.h: the return codes (SUCCESS 0, UNINITIALIZED 1, INVALID_ARGUMENT 2,
 * NOT_SUPPORTED 3, NOT_FOUND 6, INSUFFICIENT_SIZE 7, DRIVER_NOT_LOADED 9, TIMEOUT 10,
 * GPU_IS_LOST 15), opaque device and event-set handles, nvmlMemory_t {total, free, used},
 * nvmlMemory_v2_t {version, total, reserved, free, used}, nvmlProcessInfo_t (v2 = v3)
 * {pid, usedGpuMemory, gpuInstanceId, computeInstanceId}, nvmlUtilization_t {gpu, memory},
 * nvmlTemperature_v1_t {version, sensorType, temperature}, nvmlEventData_t {device, eventType,
 * eventData, gpuInstanceId, computeInstanceId}, and the versioned entry points pynvml calls
 * (nvmlInit_v2, nvmlDeviceGetCount_v2, nvmlDeviceGetHandleByIndex_v2,
 * nvmlDeviceGetComputeRunningProcesses_v3, nvmlEventSetWait_v2, ...).  Functions it lacks
 * simply do not exist, as in an older driver (pynvml raises FunctionNotFound).
 *
 * What it reports comes from $REVENANT_FAKEGPU_DIR (see fakecuda.c and tests/fakegpu):
 * config lines "driver V", "cuda N", "gpu <uuid> <bytes> <name>", "mig <index> <cur> <pending>",
 * "mps <index> <pid>...", "lost <index>", "temp <index> <celsius>"; device memory in use is the
 * files gpu-<uuid>/<ctx>.mem whose owner (REVENANT_FAKEGPU_CTX=<ctx> in /proc/<pid>/environ)
 * is alive; pending XID events are lines "<index> <xid>" in the file xids.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NOT_FOUND = 6, NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9, NVML_ERROR_TIMEOUT = 10, NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};
#define MAX_GPUS 32
#define MAX_PROCS 256

typedef struct nvmlDevice_st {
    unsigned index;
    char uuid[96], name[96];
    unsigned long long memory;
    unsigned mig_current, mig_pending, lost, temperature;
} *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned pid; unsigned long long usedGpuMemory; unsigned gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned version; int sensorType; int temperature; } nvmlTemperature_v1_t;
typedef struct { nvmlDevice_t device; unsigned long long eventType, eventData; unsigned gpuInstanceId, computeInstanceId; } nvmlEventData_t;
typedef struct nvmlEventSet_st { unsigned long long mask[MAX_GPUS]; } *nvmlEventSet_t;

static struct nvmlDevice_st devs[MAX_GPUS];
static unsigned ndevs;
static int initialised;
static char driver[64] = "570.86.10";
static int cuda_version = 12080;

static const char *state_dir(void) {
    const char *d = getenv("REVENANT_FAKEGPU_DIR");
    return (d && *d) ? d : NULL;
}

static void load_config(void) {
    char path[4096], line[512];
    ndevs = 0;
    snprintf(path, sizeof path, "%s/config", state_dir());
    FILE *f = fopen(path, "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        unsigned i, a, b;
        int off = 0;
        if (!strncmp(line, "driver ", 7)) snprintf(driver, sizeof driver, "%.63s", line + 7);
        else if (!strncmp(line, "cuda ", 5)) cuda_version = atoi(line + 5);
        else if (!strncmp(line, "gpu ", 4) && ndevs < MAX_GPUS) {
            struct nvmlDevice_st *d = &devs[ndevs];
            memset(d, 0, sizeof *d);
            if (sscanf(line, "gpu %95s %llu %n", d->uuid, &d->memory, &off) >= 2 && off) {
                snprintf(d->name, sizeof d->name, "%s", line + off);
                d->index = ndevs++;
                d->temperature = 40;
            }
        } else if (sscanf(line, "mig %u %u %u", &i, &a, &b) == 3 && i < MAX_GPUS) {
            devs[i].mig_current = a;
            devs[i].mig_pending = b;
        } else if (sscanf(line, "lost %u", &i) == 1 && i < MAX_GPUS) devs[i].lost = 1;
        else if (sscanf(line, "temp %u %u", &i, &a) == 2 && i < MAX_GPUS) devs[i].temperature = a;
    }
    fclose(f);
}

static const char *ERRORS[] = {
    [0] = "Success", [1] = "Uninitialized", [2] = "Invalid Argument", [3] = "Not Supported",
    [6] = "Not Found", [7] = "Insufficient Size", [9] = "Driver Not Loaded", [10] = "Timeout",
    [15] = "GPU is lost",
};

const char *nvmlErrorString(nvmlReturn_t r) {
    if (r >= 0 && r < (int)(sizeof ERRORS / sizeof ERRORS[0]) && ERRORS[r]) return ERRORS[r];
    return "Unknown Error";
}

nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    if (!state_dir()) return NVML_ERROR_DRIVER_NOT_LOADED;
    load_config();
    initialised++;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!version || length <= strlen(driver)) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(version, length, "%s", driver);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) {
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    *v = cuda_version;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = ndevs;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (index >= ndevs || !device) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devs[index];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned index, nvmlDevice_t *d) { return nvmlDeviceGetHandleByIndex_v2(index, d); }

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < ndevs; i++)
        if (!strcmp(devs[i].uuid, uuid)) { *device = &devs[i]; return NVML_SUCCESS; }
    return NVML_ERROR_NOT_FOUND;
}

/* Every device query starts here: a valid handle, of a GPU that is not "lost". */
static nvmlReturn_t check(nvmlDevice_t d) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || d < devs || d >= devs + ndevs) return NVML_ERROR_INVALID_ARGUMENT;
    return d->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

static nvmlReturn_t copy_text(nvmlDevice_t d, const char *text, char *out, unsigned length) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!out || length <= strlen(text)) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(out, length, "%s", text);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned length) { return copy_text(d, d ? d->name : "", name, length); }
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned length) { return copy_text(d, d ? d->uuid : "", uuid, length); }
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *index) {
    nvmlReturn_t r = check(d);
    if (!r) *index = d->index;
    return r;
}

/* The pid (in this process's /proc) whose environment holds REVENANT_FAKEGPU_CTX=<ctx>; 0: none. */
static unsigned owner_of(const char *ctx) {
    static char buf[1 << 17];
    char key[300], path[64];
    snprintf(key, sizeof key, "REVENANT_FAKEGPU_CTX=%s", ctx);
    size_t klen = strlen(key);
    DIR *proc = opendir("/proc");
    if (!proc) return 0;
    struct dirent *e;
    unsigned found = 0;
    while (!found && (e = readdir(proc))) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/%.32s/environ", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = 0, r;
        while (n < (ssize_t)sizeof buf - 1 && (r = read(fd, buf + n, sizeof buf - 1 - n)) > 0) n += r;
        close(fd);
        for (ssize_t i = 0; i < n; i += strlen(buf + i) + 1) {
            buf[n] = 0;
            if (!strncmp(buf + i, key, klen) && buf[i + klen] == 0) { found = (unsigned)atoi(e->d_name); break; }
        }
    }
    closedir(proc);
    return found;
}

/* The live processes holding device memory on d: their pids and bytes. */
static unsigned processes(nvmlDevice_t d, nvmlProcessInfo_t *out, unsigned max) {
    char path[4096];
    unsigned n = 0;
    snprintf(path, sizeof path, "%s/gpu-%s", state_dir(), d->uuid);
    DIR *dir = opendir(path);
    if (!dir) return 0;
    struct dirent *e;
    while ((e = readdir(dir)) && n < max) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".mem") || e->d_name[0] == '.') continue;
        char ctx[256], file[4400];
        snprintf(ctx, sizeof ctx, "%.*s", (int)(len - 4), e->d_name);
        unsigned pid = owner_of(ctx);
        struct stat st;
        snprintf(file, sizeof file, "%s/%s", path, e->d_name);
        if (!pid || stat(file, &st) != 0) continue; /* a dead process's memory is freed */
        out[n].pid = pid;
        out[n].usedGpuMemory = (unsigned long long)st.st_size;
        out[n].gpuInstanceId = out[n].computeInstanceId = 0xFFFFFFFFu;
        n++;
    }
    closedir(dir);
    return n;
}

static unsigned long long used_bytes(nvmlDevice_t d) {
    static nvmlProcessInfo_t procs[MAX_PROCS];
    unsigned long long used = 0;
    unsigned n = processes(d, procs, MAX_PROCS);
    for (unsigned i = 0; i < n; i++) used += procs[i].usedGpuMemory;
    return used > d->memory ? d->memory : used;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    m->total = d->memory;
    m->used = used_bytes(d);
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    nvmlMemory_t v1;
    nvmlReturn_t r = m ? nvmlDeviceGetMemoryInfo(d, &v1) : NVML_ERROR_INVALID_ARGUMENT;
    if (r) return r;
    m->total = v1.total, m->reserved = 0, m->free = v1.free, m->used = v1.used;
    return NVML_SUCCESS;
}

static nvmlReturn_t fill(const nvmlProcessInfo_t *procs, unsigned n, unsigned *count, nvmlProcessInfo_t *infos) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (n == 0) { *count = 0; return NVML_SUCCESS; }
    if (!infos || *count < n) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    memcpy(infos, procs, n * sizeof *procs);
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *count, nvmlProcessInfo_t *infos) {
    static nvmlProcessInfo_t procs[MAX_PROCS];
    nvmlReturn_t r = check(d);
    if (r) return r;
    return fill(procs, processes(d, procs, MAX_PROCS), count, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *count, nvmlProcessInfo_t *infos) {
    static nvmlProcessInfo_t procs[MAX_PROCS];
    char path[4096], line[2048], prefix[32];
    unsigned n = 0;
    nvmlReturn_t r = check(d);
    if (r) return r;
    snprintf(path, sizeof path, "%s/config", state_dir());
    snprintf(prefix, sizeof prefix, "mps %u ", d->index);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f)) {
        if (strncmp(line, prefix, strlen(prefix))) continue;
        char *save = NULL;
        for (char *t = strtok_r(line + strlen(prefix), " \n", &save); t && n < MAX_PROCS; t = strtok_r(NULL, " \n", &save)) {
            procs[n].pid = (unsigned)atoi(t);
            procs[n].usedGpuMemory = 0;
            procs[n].gpuInstanceId = procs[n].computeInstanceId = 0xFFFFFFFFu;
            n++;
        }
    }
    if (f) fclose(f);
    return fill(procs, n, count, infos);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned *current, unsigned *pending) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = d->mig_current, *pending = d->mig_pending;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *temp) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (sensor != 0 || !temp) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = d->temperature;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t d, nvmlTemperature_v1_t *t) {
    unsigned v = 0;
    nvmlReturn_t r = t ? nvmlDeviceGetTemperature(d, t->sensorType, &v) : NVML_ERROR_INVALID_ARGUMENT;
    if (!r) t->temperature = (int)v;
    return r;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!u) return NVML_ERROR_INVALID_ARGUMENT;
    u->gpu = used_bytes(d) ? 50 : 0;
    u->memory = u->gpu / 2;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *mw) {
    nvmlReturn_t r = check(d);
    if (!r) *mw = 100000;
    return r;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int type, int counter, unsigned long long *count) {
    nvmlReturn_t r = check(d);
    (void)type, (void)counter;
    if (!r) *count = 0;
    return r;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned *corr, unsigned *unc, unsigned *pending, unsigned *failed) {
    nvmlReturn_t r = check(d);
    if (!r) *corr = *unc = *pending = *failed = 0;
    return r;
}

/* ------------------------------------------------------------------ events (XIDs) */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    return *set ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    set->mask[d->index] |= types;
    return NVML_SUCCESS;
}

/* Takes the first pending "<index> <xid>" line of <dir>/xids for a GPU this set watches. */
static int take_xid(nvmlEventSet_t set, unsigned *index, unsigned long long *xid) {
    char path[4096], lockp[4096], line[128];
    char *rest = NULL;
    size_t rest_len = 0;
    int got = 0;
    snprintf(path, sizeof path, "%s/xids", state_dir());
    if (access(path, F_OK) != 0) return 0;
    snprintf(lockp, sizeof lockp, "%s/xids.lock", state_dir());
    int lk = open(lockp, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lk >= 0) flock(lk, LOCK_EX);
    FILE *f = fopen(path, "r"), *keep = open_memstream(&rest, &rest_len);
    while (f && keep && fgets(line, sizeof line, f)) {
        unsigned i;
        unsigned long long x;
        if (!got && sscanf(line, "%u %llu", &i, &x) == 2 && i < ndevs && (set->mask[i] & 0x8ULL)) {
            *index = i, *xid = x, got = 1;
        } else {
            fputs(line, keep);
        }
    }
    if (f) fclose(f);
    if (keep) fclose(keep);
    if (got && (f = fopen(path, "w"))) {
        fwrite(rest, 1, rest_len, f);
        fclose(f);
    }
    free(rest);
    if (lk >= 0) close(lk);
    return got;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeoutms) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned waited = 0;; waited += 10) {
        unsigned index;
        unsigned long long xid;
        if (take_xid(set, &index, &xid)) {
            memset(data, 0, sizeof *data);
            data->device = &devs[index];
            data->eventType = 0x8ULL; /* nvmlEventTypeXidCriticalError */
            data->eventData = xid;
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
            return NVML_SUCCESS;
        }
        if (waited >= timeoutms) return NVML_ERROR_TIMEOUT;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    free(set);
    return NVML_SUCCESS;
}
