/* LD_PRELOAD for tests only: getuid() and geteuid() answer $NOTROOT_UID (default 65534).
 *
 * PostgreSQL's server and initdb refuse to run as root, and criu cannot dump another user's job
 * on hosts whose root lacks CAP_SYS_RESOURCE (docs/security.md).  Until non-root jobs are
 * checkpointable there, tests/workloads/test_databases.py runs PostgreSQL as root through this,
 * with its data directory owned by that uid (the server compares the two). */
#include <stdlib.h>
#include <sys/types.h>

static uid_t pretend(void) {
    const char *s = getenv("NOTROOT_UID");
    return s ? (uid_t)strtoul(s, NULL, 10) : 65534;
}

uid_t getuid(void) { return pretend(); }
uid_t geteuid(void) { return pretend(); }
