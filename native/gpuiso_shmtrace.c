/*
 * gpuiso_shmtrace.c — who created which /dev/shm entry (LD_PRELOAD shim).
 *
 * Under pytest-xdist several isolated tests run at once, and a /dev/shm entry
 * that appears while one test runs may have been made by another worker's test.
 * /dev/shm does not record who created an entry, and the creator is usually dead
 * by the time anyone looks. So each isolated test's process is started with this
 * library preloaded (LD_PRELOAD, inherited by its descendants) and the path of a
 * log file in PYTEST_GPUISO_SHM_LOG. Every successful creating call below appends
 * one line "<pid> <name>" to that file with O_APPEND (one write(2) per line, so
 * lines of concurrent processes never interleave). The parent then attributes a
 * leaked entry to the test whose log names it.
 *
 * Interposed: shm_open, sem_open, and open/open64/openat/openat64/creat/fopen/
 * fopen64 of paths directly under /dev/shm with O_CREAT (or a writing fopen mode).
 * Calls that bypass the dynamic linker (static binaries, raw syscalls) are not
 * seen; the parent falls back to its other evidence for those.
 *
 * Nothing here allocates, and errno is preserved: the shim must be invisible.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <semaphore.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define LOG_ENV "PYTEST_GPUISO_SHM_LOG"
#define SHM_DIR "/dev/shm/"

static void note(const char *prefix, const char *name)
{
    const char *log = getenv(LOG_ENV);
    if (log == NULL || *log == '\0' || name == NULL)
        return;
    int saved = errno;
    while (*name == '/')
        name++;
    char line[512];
    int n = snprintf(line, sizeof line, "%ld %s%s\n", (long)getpid(), prefix, name);
    if (n > 0 && (size_t)n < sizeof line) {
        /* Raw syscalls: our own open() would recurse into the interposer. */
        int fd = (int)syscall(SYS_openat, AT_FDCWD, log, O_WRONLY | O_APPEND | O_CLOEXEC);
        if (fd >= 0) {
            (void)!syscall(SYS_write, fd, line, (size_t)n);
            syscall(SYS_close, fd);
        }
    }
    errno = saved;
}

/* A path under /dev/shm: the entry's name, else NULL. */
static const char *shm_name(const char *path)
{
    if (path != NULL && strncmp(path, SHM_DIR, sizeof SHM_DIR - 1) == 0) {
        const char *name = path + sizeof SHM_DIR - 1;
        if (*name != '\0' && strchr(name, '/') == NULL)
            return name;
    }
    return NULL;
}

static void *real(const char *symbol)
{
    return dlsym(RTLD_NEXT, symbol);
}

/* Look up the next definition of a symbol once; ENOSYS if there is none. */
static int resolve(void **slot, const char *symbol)
{
    if (*slot == NULL)
        *slot = real(symbol);
    if (*slot == NULL) {
        errno = ENOSYS;
        return 0;
    }
    return 1;
}

int shm_open(const char *name, int oflag, mode_t mode)
{
    static int (*next)(const char *, int, mode_t);
    if (!resolve((void **)&next, "shm_open"))
        return -1;
    int fd = next(name, oflag, mode);
    if (fd >= 0 && (oflag & O_CREAT))
        note("", name);
    return fd;
}

sem_t *sem_open(const char *name, int oflag, ...)
{
    static sem_t *(*next)(const char *, int, ...);
    if (!resolve((void **)&next, "sem_open"))
        return SEM_FAILED;
    sem_t *sem;
    if (oflag & O_CREAT) {
        va_list ap;
        va_start(ap, oflag);
        mode_t mode = (mode_t)va_arg(ap, unsigned int);
        unsigned int value = va_arg(ap, unsigned int);
        va_end(ap);
        sem = next(name, oflag, mode, value);
        if (sem != SEM_FAILED)
            note("sem.", name);
    } else {
        sem = next(name, oflag);
    }
    return sem;
}

/* Log a successful creating open of a path under /dev/shm; return fd unchanged. */
static int noted(int fd, int flags, const char *path)
{
    if (fd >= 0 && (flags & O_CREAT) && shm_name(path))
        note("", shm_name(path));
    return fd;
}

/* The optional mode argument exists only with O_CREAT / O_TMPFILE. */
#define MODE_ARG(flags, mode)                                                     \
    do {                                                                          \
        (mode) = 0;                                                               \
        if ((flags) & (O_CREAT | __O_TMPFILE)) {                                  \
            va_list ap;                                                           \
            va_start(ap, flags);                                                  \
            (mode) = (mode_t)va_arg(ap, unsigned int);                            \
            va_end(ap);                                                           \
        }                                                                         \
    } while (0)

int open(const char *path, int flags, ...)
{
    static int (*next)(const char *, int, mode_t);
    mode_t mode;
    MODE_ARG(flags, mode);
    if (!resolve((void **)&next, "open"))
        return -1;
    return noted(next(path, flags, mode), flags, path);
}

int open64(const char *path, int flags, ...)
{
    static int (*next)(const char *, int, mode_t);
    mode_t mode;
    MODE_ARG(flags, mode);
    if (!resolve((void **)&next, "open64"))
        return -1;
    return noted(next(path, flags, mode), flags, path);
}

/* openat: only absolute paths can be told to be under /dev/shm without a lookup. */
int openat(int dirfd, const char *path, int flags, ...)
{
    static int (*next)(int, const char *, int, mode_t);
    mode_t mode;
    MODE_ARG(flags, mode);
    if (!resolve((void **)&next, "openat"))
        return -1;
    return noted(next(dirfd, path, flags, mode), flags, path);
}

int openat64(int dirfd, const char *path, int flags, ...)
{
    static int (*next)(int, const char *, int, mode_t);
    mode_t mode;
    MODE_ARG(flags, mode);
    if (!resolve((void **)&next, "openat64"))
        return -1;
    return noted(next(dirfd, path, flags, mode), flags, path);
}

int creat(const char *path, mode_t mode)
{
    static int (*next)(const char *, mode_t);
    if (!resolve((void **)&next, "creat"))
        return -1;
    return noted(next(path, mode), O_CREAT, path);
}

static FILE *fopen_common(const char *symbol, const char *path, const char *how)
{
    FILE *(*next)(const char *, const char *) =
        (FILE * (*)(const char *, const char *)) real(symbol);
    if (next == NULL) {
        errno = ENOSYS;
        return NULL;
    }
    FILE *f = next(path, how);
    if (f != NULL && how != NULL && (how[0] == 'w' || how[0] == 'a') &&
        shm_name(path))
        note("", shm_name(path));
    return f;
}

FILE *fopen(const char *path, const char *how)
{
    return fopen_common("fopen", path, how);
}

FILE *fopen64(const char *path, const char *how)
{
    return fopen_common("fopen64", path, how);
}
