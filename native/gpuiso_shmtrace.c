/*
 * gpuiso_shmtrace.c — who created which /dev/shm entry (LD_PRELOAD shim).
 *
 * Under pytest-xdist several isolated tests run at once, and a /dev/shm entry
 * that appears while one test runs may have been made by another worker's test.
 * /dev/shm does not record who created an entry, and the creator is usually dead
 * by the time anyone looks. So each isolated test's process is started with this
 * library preloaded (LD_PRELOAD, inherited by its descendants) and the path of a
 * log file in PYTEST_GPUISO_SHM_LOG. Every call below that CREATED an entry
 * appends one line "<pid> <inode> <name>" to that file with O_APPEND (one
 * write(2) per line, so lines of concurrent processes never interleave). The
 * parent then attributes a leaked entry to the test whose log names it, and
 * deletes it (with --gpu-isolate-cleanup) only while the name still holds the
 * logged inode.
 *
 * Created means: the entry did not exist before the call. An open with O_CREAT
 * and without O_EXCL also opens an existing entry (the open-or-create idiom of
 * shm_open, sem_open and open), so it is first tried with O_EXCL added (fopen's
 * "w" and "a" with glibc's "x"): success is a creation, logged. On EEXIST the
 * caller's own call follows, unchanged and unlogged: an open of what is there,
 * with every check the kernel makes of an O_CREAT open (fs.protected_regular
 * refuses to open another user's file in sticky /dev/shm with O_CREAT; opening it
 * without O_CREAT instead would not be refused). Should the entry vanish between
 * the two calls, that call creates it, unlogged. An unlogged entry is never the
 * test's to delete.
 *
 * <name> is relative to /dev/shm, subdirectories included ("dir/name"; a
 * semaphore is "sem.<name>"), with bytes <= 0x20, '%' and 0x7f written as %XX, so
 * that no name can make a line of its own. Relative paths are resolved against
 * the current directory or openat's directory descriptor (readlinkat of
 * /proc/self/cwd or /proc/self/fd/N); a path with a ".." component is not logged.
 *
 * Interposed: shm_open, sem_open, open/open64/openat/openat64/creat/creat64,
 * fopen/fopen64 and mkdir/mkdirat of paths under /dev/shm. What does not go through
 * the dynamic linker's symbol lookup is not seen: static binaries, raw syscalls,
 * and calls bound to libc's own handle (ctypes.CDLL("libc.so.6").open, dlsym on a
 * handle of libc); ctypes.CDLL(None).open does come here. Tracing happens only
 * while PYTEST_GPUISO_SHM_LOG is set; without it every call goes straight through.
 *
 * Nothing here allocates, errno is what the caller's own call would leave, and a
 * successful call leaves errno as it found it: the shim must be invisible.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
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
#define SHM_DIR "/dev/shm"
#define SHM_PREFIX SHM_DIR "/"
#define NAME_CAP 1024 /* longer paths under /dev/shm are not logged (the stack stays small) */

static const char *log_path(void)
{
    const char *log = getenv(LOG_ENV);
    return (log != NULL && *log != '\0') ? log : NULL;
}

/* Append "<pid> <inode> <escaped rel>\n" to the log; errno is kept. */
static void note(const char *rel, ino_t ino)
{
    const char *log = log_path();
    if (log == NULL || rel == NULL || *rel == '\0')
        return;
    int saved = errno;
    char line[2 * NAME_CAP];
    int n = snprintf(line, sizeof line, "%ld %llu ", (long)getpid(), (unsigned long long)ino);
    size_t len = n > 0 ? (size_t)n : sizeof line;
    static const char hex[] = "0123456789ABCDEF";
    for (const unsigned char *p = (const unsigned char *)rel; *p && len + 4 < sizeof line; p++) {
        if (*p <= 0x20 || *p == '%' || *p == 0x7f) {
            line[len++] = '%';
            line[len++] = hex[*p >> 4];
            line[len++] = hex[*p & 15];
        } else {
            line[len++] = (char)*p;
        }
    }
    if (len + 4 < sizeof line) { /* else too long to log: left unlogged */
        line[len++] = '\n';
        /* Raw syscalls: our own open() would recurse into the interposer. */
        int fd = (int)syscall(SYS_openat, AT_FDCWD, log, O_WRONLY | O_APPEND | O_CLOEXEC);
        if (fd >= 0) {
            (void)!syscall(SYS_write, fd, line, len);
            syscall(SYS_close, fd);
        }
    }
    errno = saved;
}

/* Log the entry behind a new descriptor. */
static void note_fd(const char *rel, int fd)
{
    int saved = errno;
    struct stat st;
    if (fstat(fd, &st) == 0)
        note(rel, st.st_ino);
    errno = saved;
}

/* Log the entry at /dev/shm/<rel> (not following a final symlink). */
static void note_path(const char *rel)
{
    int saved = errno;
    char path[sizeof SHM_PREFIX + NAME_CAP];
    struct stat st;
    int n = snprintf(path, sizeof path, "%s%s", SHM_PREFIX, rel);
    if (n > 0 && (size_t)n < sizeof path && fstatat(AT_FDCWD, path, &st, AT_SYMLINK_NOFOLLOW) == 0)
        note(rel, st.st_ino);
    errno = saved;
}

/* Append the components of ``path`` to ``out`` (``len`` bytes so far), joined by '/',
 * skipping empty and "." ones. -1 for a ".." component or no room. */
static long join(char *out, size_t cap, size_t len, const char *path)
{
    while (*path) {
        const char *end = strchr(path, '/');
        size_t n = end ? (size_t)(end - path) : strlen(path);
        if (n == 2 && path[0] == '.' && path[1] == '.')
            return -1;
        if (n > 0 && !(n == 1 && path[0] == '.')) {
            if (len + (len > 0) + n + 1 > cap)
                return -1;
            if (len > 0)
                out[len++] = '/';
            memcpy(out + len, path, n);
            len += n;
            out[len] = '\0';
        }
        path += n;
        while (*path == '/')
            path++;
    }
    return (long)len;
}

/* The name under /dev/shm that ``path`` (relative to ``dirfd``) stands for, written to
 * ``out`` (NAME_CAP bytes); NULL if it is not under /dev/shm or cannot be told. */
static const char *shm_rel(int dirfd, const char *path, char *out)
{
    if (path == NULL || *path == '\0')
        return NULL;
    out[0] = '\0';
    long len = 0;
    if (path[0] == '/') {
        if (strncmp(path, SHM_PREFIX, sizeof SHM_PREFIX - 1) != 0)
            return NULL;
        len = join(out, NAME_CAP, 0, path + sizeof SHM_PREFIX - 1);
    } else {
        char link[32];
        char base[NAME_CAP];
        if (dirfd == AT_FDCWD)
            snprintf(link, sizeof link, "/proc/self/cwd");
        else if (dirfd >= 0)
            snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        else
            return NULL;
        /* A raw syscall: no interposer of anyone's in between, errno kept below. */
        int saved = errno;
        long n = syscall(SYS_readlinkat, AT_FDCWD, link, base, sizeof base - 1);
        errno = saved;
        if (n <= 0 || n >= (long)sizeof base - 1)
            return NULL; /* not a path, or maybe cut short */
        base[n] = '\0';
        if (strcmp(base, SHM_DIR) == 0)
            len = 0;
        else if (strncmp(base, SHM_PREFIX, sizeof SHM_PREFIX - 1) == 0)
            len = join(out, NAME_CAP, 0, base + sizeof SHM_PREFIX - 1);
        else
            return NULL;
        if (len >= 0)
            len = join(out, NAME_CAP, (size_t)len, path);
    }
    return len > 0 ? out : NULL;
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

/* One way of opening: the next open-like function with its first arguments bound. */
struct opener {
    int (*at)(int, const char *, int, ...); /* openat-like, or NULL */
    int (*plain)(const char *, int, ...);   /* open-like (open, shm_open) */
    int dirfd;
    const char *path;
    mode_t mode;
};

static int call(const struct opener *o, int flags)
{
    if (o->at != NULL)
        return o->at(o->dirfd, o->path, flags, o->mode);
    return o->plain(o->path, flags, o->mode);
}

/* Open as the caller asked; log the entry if this call created it (see the top). */
static int traced_open(const struct opener *o, int flags, const char *rel)
{
    if (!(flags & O_CREAT) || (flags & __O_TMPFILE) == __O_TMPFILE || rel == NULL ||
        log_path() == NULL)
        return call(o, flags);
    int saved = errno;
    int fd = call(o, flags | O_EXCL);
    if (fd >= 0) {
        note_fd(rel, fd);
        errno = saved;
        return fd;
    }
    if ((flags & O_EXCL) || errno != EEXIST)
        return -1; /* what the caller's call fails with too: no entry was there */
    errno = saved;
    return call(o, flags); /* it is there: the caller's own open, unlogged */
}

int shm_open(const char *name, int oflag, mode_t mode)
{
    static int (*next)(const char *, int, ...);
    if (!resolve((void **)&next, "shm_open"))
        return -1;
    const char *rel = name;
    while (rel != NULL && *rel == '/')
        rel++;
    struct opener o = {NULL, next, AT_FDCWD, name, mode};
    return traced_open(&o, oflag, rel != NULL && *rel ? rel : NULL);
}

sem_t *sem_open(const char *name, int oflag, ...)
{
    static sem_t *(*next)(const char *, int, ...);
    if (!resolve((void **)&next, "sem_open"))
        return SEM_FAILED;
    if (!(oflag & O_CREAT))
        return next(name, oflag);
    va_list ap;
    va_start(ap, oflag);
    mode_t mode = (mode_t)va_arg(ap, unsigned int);
    unsigned int value = va_arg(ap, unsigned int);
    va_end(ap);
    char rel[NAME_CAP];
    const char *base = name;
    while (base != NULL && *base == '/')
        base++;
    int n = base != NULL ? snprintf(rel, sizeof rel, "sem.%s", base) : -1;
    if (n <= 4 || (size_t)n >= sizeof rel || log_path() == NULL)
        return next(name, oflag, mode, value);
    int saved = errno;
    sem_t *sem = next(name, oflag | O_EXCL, mode, value);
    if (sem != SEM_FAILED) {
        note_path(rel);
        errno = saved;
        return sem;
    }
    if ((oflag & O_EXCL) || errno != EEXIST)
        return SEM_FAILED;
    errno = saved;
    return next(name, oflag, mode, value);
}

/* The optional mode argument exists only with O_CREAT / O_TMPFILE. */
#define MODE_ARG(flags, mode)                                                      \
    do {                                                                           \
        (mode) = 0;                                                                \
        if ((flags) & (O_CREAT | __O_TMPFILE)) {                                   \
            va_list ap;                                                            \
            va_start(ap, flags);                                                   \
            (mode) = (mode_t)va_arg(ap, unsigned int);                             \
            va_end(ap);                                                            \
        }                                                                          \
    } while (0)

/* The name under /dev/shm of a path opened with these flags, when it is traced. */
static const char *traced_rel(int dirfd, const char *path, int flags, char *buf)
{
    if (!(flags & O_CREAT) || log_path() == NULL)
        return NULL;
    return shm_rel(dirfd, path, buf);
}

#define OPEN_LIKE(fn)                                                              \
    int fn(const char *path, int flags, ...)                                       \
    {                                                                              \
        static int (*next)(const char *, int, ...);                                \
        mode_t mode;                                                               \
        MODE_ARG(flags, mode);                                                     \
        if (!resolve((void **)&next, #fn))                                         \
            return -1;                                                             \
        char buf[NAME_CAP];                                                        \
        struct opener o = {NULL, next, AT_FDCWD, path, mode};                      \
        return traced_open(&o, flags, traced_rel(AT_FDCWD, path, flags, buf));     \
    }

#define OPENAT_LIKE(fn)                                                            \
    int fn(int dirfd, const char *path, int flags, ...)                            \
    {                                                                              \
        static int (*next)(int, const char *, int, ...);                           \
        mode_t mode;                                                               \
        MODE_ARG(flags, mode);                                                     \
        if (!resolve((void **)&next, #fn))                                         \
            return -1;                                                             \
        char buf[NAME_CAP];                                                        \
        struct opener o = {next, NULL, dirfd, path, mode};                         \
        return traced_open(&o, flags, traced_rel(dirfd, path, flags, buf));        \
    }

/* creat(path, mode) is open(path, O_CREAT | O_WRONLY | O_TRUNC, mode). */
#define CREAT_LIKE(fn, open_fn)                                                    \
    int fn(const char *path, mode_t mode)                                          \
    {                                                                              \
        static int (*next)(const char *, int, ...);                                \
        if (!resolve((void **)&next, open_fn))                                     \
            return -1;                                                             \
        char buf[NAME_CAP];                                                        \
        int flags = O_CREAT | O_WRONLY | O_TRUNC;                                  \
        struct opener o = {NULL, next, AT_FDCWD, path, mode};                      \
        return traced_open(&o, flags, traced_rel(AT_FDCWD, path, flags, buf));     \
    }

OPEN_LIKE(open)
OPEN_LIKE(open64)
OPENAT_LIKE(openat)
OPENAT_LIKE(openat64)
CREAT_LIKE(creat, "open")
CREAT_LIKE(creat64, "open64")

static FILE *fopen_common(FILE *(*next)(const char *, const char *), const char *path,
                          const char *how)
{
    char buf[NAME_CAP];
    const char *rel = NULL;
    if (how != NULL && (how[0] == 'w' || how[0] == 'a') && log_path() != NULL)
        rel = shm_rel(AT_FDCWD, path, buf);
    size_t n = rel != NULL ? strlen(how) : 0;
    char excl[64];
    if (rel == NULL || n + 2 > sizeof excl)
        return next(path, how);
    /* glibc reads the mode's flags from its first 7 characters: "x" goes second. */
    excl[0] = how[0];
    excl[1] = 'x';
    memcpy(excl + 2, how + 1, n); /* with the NUL */
    int saved = errno;
    FILE *f = next(path, excl);
    if (f != NULL) {
        note_fd(rel, fileno(f));
        errno = saved;
        return f;
    }
    if (errno != EEXIST)
        return NULL;
    errno = saved;
    return next(path, how); /* there already (or re-made since): an open, unlogged */
}

FILE *fopen(const char *path, const char *how)
{
    static FILE *(*next)(const char *, const char *);
    if (!resolve((void **)&next, "fopen"))
        return NULL;
    return fopen_common(next, path, how);
}

FILE *fopen64(const char *path, const char *how)
{
    static FILE *(*next)(const char *, const char *);
    if (!resolve((void **)&next, "fopen64"))
        return NULL;
    return fopen_common(next, path, how);
}

/* mkdir never opens an existing directory: success is a creation. */
int mkdirat(int dirfd, const char *path, mode_t mode)
{
    static int (*next)(int, const char *, mode_t);
    if (!resolve((void **)&next, "mkdirat"))
        return -1;
    int rc = next(dirfd, path, mode);
    if (rc == 0 && log_path() != NULL) {
        char buf[NAME_CAP];
        const char *rel = shm_rel(dirfd, path, buf);
        if (rel != NULL)
            note_path(rel);
    }
    return rc;
}

int mkdir(const char *path, mode_t mode)
{
    static int (*next)(const char *, mode_t);
    if (!resolve((void **)&next, "mkdir"))
        return -1;
    int rc = next(path, mode);
    if (rc == 0 && log_path() != NULL) {
        char buf[NAME_CAP];
        const char *rel = shm_rel(AT_FDCWD, path, buf);
        if (rel != NULL)
            note_path(rel);
    }
    return rc;
}
