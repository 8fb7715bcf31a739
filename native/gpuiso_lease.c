/*
 * pytest_gpuiso._lease: GPU leases shared by every pytest process of a user.
 *
 * One memory-mapped region per user (a 0600 file in /dev/shm) holds a table of
 * devices, each with its capacity (its memory in bytes; 0 when unknown) and up to
 * MAX_SLOTS holders, each holding an amount of it. A request asks for n of its
 * devices and, on each, either an amount in bytes or a share of the device in parts
 * per million (1/slots of it by default: one share of 10^6 is the whole device, as
 * the exclusive leases before memory were). A device of unknown capacity counts
 * 10^6 units and takes shares only. It is admitted where what is already held plus
 * its need fits the capacity. Everything in the table is guarded by one robust,
 * process-shared mutex: if a process dies inside the (short) critical section,
 * the next locker gets EOWNERDEAD, marks the mutex consistent and carries on,
 * because every entry is validated by its owner's liveness anyway.
 *
 * Liveness. A pid means nothing in another pid namespace (containers sharing
 * /dev/shm with --ipc=host), so an owner is judged by a lock the kernel drops
 * when the owner dies, in every namespace: before it records itself anywhere, a
 * process takes an OFD write lock (fcntl F_OFD_SETLK) on one byte of the region
 * file at LOCK_BASE + key, its key chosen under the mutex among the unlocked
 * bytes; the lock lives as long as the open file description. An entry is live
 * while its key's byte is locked. Entries also record (pid, start time from
 * /proc, pid namespace): in our own namespace a dead pid, or a live pid with
 * another start time, is dead even while the key is locked (an OFD lock is
 * inherited by a fork() child that keeps the descriptor -- it is O_CLOEXEC, so
 * exec drops it -- and such a child would otherwise keep its parent's entries
 * alive); pidfd wake-ups and the "stopped" state are used only for owners in
 * our namespace, owners elsewhere are re-checked every 100 ms while waited on.
 *
 * Leases themselves are held for a whole test, not under the mutex. A waiter
 * blocks in poll() on
 *   - an inotify watch of the region file: every release (and every change a
 *     waiter must look at) writes the `bell` counter through pwrite(), which
 *     the kernel reports as IN_MODIFY to every watcher;
 *   - a pidfd of each live process it waits on (holders of its devices and
 *     earlier waiters that want the same devices): the kernel makes it readable
 *     the moment that process exits, SIGKILL included.
 * So a dead holder is noticed at once, with no timeout and no blind sem_post.
 *
 * Fairness: a waiter takes a ticket; it may only take slots on devices that no
 * earlier live waiter wants. Waiters for the same devices are served in ticket
 * order, and a multi-GPU request is granted all at once or not at all, so it is
 * never starved by a stream of single-GPU requests and never holds one GPU
 * while waiting for another.
 *
 * The region is created in an unnamed file (O_TMPFILE; a named temporary file
 * where the file system lacks it), its whole size allocated first so that a full
 * /dev/shm is an error (ENOSPC), not a SIGBUS at the first store, and published
 * with link(), which fails if another process published first: a region is
 * either absent or complete.
 *
 * A process stopped (SIGSTOP, Ctrl-Z) while it holds the mutex would block every
 * other process: the mutex is taken in 100 ms slices, with Python's signals
 * checked in between (Ctrl-C works), and a locker that has waited a few seconds
 * for a stopped holder fails naming it. A stopped waiter keeps its place in the
 * queue but does not hold back the waiters behind it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 /* the same number on every architecture */
#endif

#define GPUISO_MAGIC 0x67707569736f6c31ULL /* "gpuisol1" */
#define GPUISO_ABI 5 /* 4: a device may be quarantined; 5: rows keyed by GPU UUID */
#define MAX_DEVICES 64
#define MAX_SLOTS 64 /* holders per device at once */
#define WHOLE 1000000ULL /* a share of the whole device, in parts per million */
#define MAX_WAITERS 256
#define MAX_KEYS 4096 /* processes attached as owners at once */
#define LOCK_BASE (1LL << 30) /* first key byte: past the end of the file (allowed) */
#define LABEL_LEN 192
#define NAME_LEN 64
#define LOCK_SLICE_NS 100000000L /* the mutex is waited for in slices of 100 ms */
#define STUCK_S 3.0 /* a lock held this long by a stopped process is reported */
#define LOCK_BOUND_S 10.0 /* a lock held this long by anyone is reported (no wait is longer) */

typedef struct {
    int32_t pid; /* 0: free; in the owner's pid namespace */
    uint32_t key; /* its OFD lock byte: LOCK_BASE + key */
    uint64_t start; /* /proc/<pid>/stat field 22: clock ticks since boot */
    uint64_t ns; /* inode of its /proc/self/ns/pid */
} owner_t;

typedef struct {
    owner_t owner;
    uint64_t lease;
    uint64_t amount; /* of the device's capacity (its units: bytes, or WHOLE if unknown) */
    int64_t since_ns; /* CLOCK_REALTIME, for display only */
    char label[LABEL_LEN];
} slot_t;

typedef struct {
    char name[NAME_LEN]; /* "" : unused row */
    uint64_t capacity; /* bytes; 0: unknown (then WHOLE units, shares only) */
    slot_t slot[MAX_SLOTS];
    /* Quarantined (a health probe failed on it): leased by no one until lifted. For
     * every session of the user, so it outlives its holders; never recycled. */
    int64_t quarantined_ns; /* CLOCK_REALTIME when it was quarantined; 0: healthy */
    char why[LABEL_LEN]; /* what failed, and the test that broke it */
} device_t;

typedef struct {
    owner_t owner;
    uint64_t ticket;
    uint64_t mask; /* rows it wants */
    uint64_t amount; /* bytes on each GPU, or 0 for a share */
    uint32_t n;
    uint32_t share; /* parts per million of each GPU, when amount is 0 */
    int64_t since_ns;
    char label[LABEL_LEN];
} waiter_t;

typedef struct {
    uint64_t magic;
    uint32_t abi;
    uint32_t size;
    uint64_t bell;
    pthread_mutex_t lock;
    uint64_t next_ticket;
    uint64_t next_lease;
    uint32_t ndevices;
    uint32_t generation; /* bumped by clear() and by recycling a row: requests re-resolve */
    uint32_t next_key; /* where the search for a free key starts */
    uint32_t pad;
    device_t dev[MAX_DEVICES];
    waiter_t waiter[MAX_WAITERS];
} region_t;

static PyObject *RegionError;

/* ------------------------------------------------------------------ processes */

static int proc_start(pid_t pid, uint64_t *start, char *state)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    int saved = errno;
    close(fd);
    if (n <= 0) {
        errno = n == 0 ? ESRCH : saved; /* an empty stat: the process is gone */
        return -1;
    }
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (p == NULL || p[1] == '\0')
        return -1;
    p += 2; /* field 3: state */
    if (state)
        *state = *p;
    for (int field = 3; field < 22 && *p; p++)
        if (*p == ' ')
            field++;
    *start = strtoull(p, NULL, 10);
    return 0;
}

/* The process's pid namespace, as the inode of /proc/self/ns/pid (0: unknown). */
static uint64_t pid_namespace(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* This process as an owner, its key aside; recomputed after fork. */
static owner_t self_identity(void)
{
    static pid_t cached_pid;
    static uint64_t cached_start, cached_ns;
    pid_t pid = getpid();
    if (pid != cached_pid) {
        uint64_t start = 0;
        proc_start(pid, &start, NULL);
        cached_pid = pid;
        cached_start = start;
        cached_ns = pid_namespace();
    }
    owner_t me = {.pid = pid, .start = cached_start, .ns = cached_ns};
    return me;
}

/* Whether o's pid, start time and state can be read here: only in our own namespace. */
static int in_our_namespace(const owner_t *o)
{
    return o->ns == self_identity().ns;
}

/* The same process (its key aside: a process may attach through several objects). */
static int same_owner(const owner_t *a, const owner_t *b)
{
    return a->pid == b->pid && a->start == b->start && a->ns == b->ns;
}

/* Stopped (SIGSTOP, Ctrl-Z, a debugger): it can neither take nor release anything. */
static int owner_stopped(const owner_t *o)
{
    uint64_t start;
    char state;
    if (o->pid <= 0 || !in_our_namespace(o) || proc_start(o->pid, &start, &state) != 0)
        return 0;
    return start == o->start && (state == 'T' || state == 't');
}

/* The process of thread `tid` when that thread is stopped, else 0. */
static pid_t stopped_process_of(pid_t tid)
{
    uint64_t start;
    char state, path[64], buf[2048];
    if (tid <= 0 || proc_start(tid, &start, &state) != 0 || (state != 'T' && state != 't'))
        return 0;
    snprintf(path, sizeof path, "/proc/%d/status", (int)tid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return tid;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    buf[n > 0 ? n : 0] = '\0';
    char *tgid = strstr(buf, "\nTgid:");
    return tgid ? (pid_t)strtol(tgid + 6, NULL, 10) : tid;
}

static int64_t realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Copy at most max - 1 bytes of src, cut at a UTF-8 character boundary so that the copy
 * always decodes (a test id longer than a label is common: parametrized ids). */
static void copy_text(char *dst, const char *src, size_t max)
{
    size_t n = strnlen(src, max);
    if (n >= max) {
        n = max - 1;
        while (n > 0 && ((unsigned char)src[n] & 0xC0) == 0x80) /* src[n] continues a character */
            n--;
    }
    memcpy(dst, src, n);
    dst[n] = '\0';
}

/* A text field of the table as str; whatever a writer left there never fails to decode. */
static PyObject *text_of(const char *buf, size_t size)
{
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strnlen(buf, size), "replace");
}

/* ------------------------------------------------------------------ the region */

typedef struct {
    PyObject_HEAD
    region_t *r;
    int fd; /* the region file: mapping, bell, and this object's OFD lock */
    int inotify;
    int key; /* our lock byte, -1 until we first record ourselves */
    pid_t pid; /* the process that opened fd and inotify */
    uint64_t abandoned; /* a waiter ticket we could not withdraw (lock held): withdraw later */
    char *path;
} RegionObject;

/* RegionError(message) with an `errno` attribute (0: not a system error). */
static void region_error(int err, const char *format, ...)
{
    va_list vargs;
    va_start(vargs, format);
    PyObject *msg = PyUnicode_FromFormatV(format, vargs);
    va_end(vargs);
    if (msg == NULL)
        return;
    PyObject *exc = PyObject_CallOneArg(RegionError, msg);
    Py_DECREF(msg);
    if (exc == NULL)
        return;
    PyObject *code = PyLong_FromLong(err);
    if (code == NULL || PyObject_SetAttrString(exc, "errno", code) < 0) {
        Py_XDECREF(code);
        Py_DECREF(exc);
        return;
    }
    Py_DECREF(code);
    PyErr_SetObject(RegionError, exc);
    Py_DECREF(exc);
}

static void ring(RegionObject *self)
{
    /* Must go through write(2), not the mapping: only a write makes inotify report. */
    uint64_t bell = self->r->bell + 1;
    if (pwrite(self->fd, &bell, sizeof bell, offsetof(region_t, bell)) != sizeof bell)
        self->r->bell = bell;
}

static struct flock key_byte(short type, uint32_t key)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = LOCK_BASE + key;
    fl.l_len = 1;
    return fl;
}

/* Whether someone holds `key`'s lock. F_OFD_GETLK does not report our own lock. */
static int key_held(RegionObject *self, uint32_t key)
{
    if (key >= MAX_KEYS)
        return 0;
    if (self->key >= 0 && key == (uint32_t)self->key)
        return 1;
    struct flock fl = key_byte(F_WRLCK, key);
    if (fcntl(self->fd, F_OFD_GETLK, &fl) != 0)
        return 1; /* cannot tell: a live holder is never robbed */
    return fl.l_type != F_UNLCK;
}

static int owner_alive(RegionObject *self, const owner_t *o)
{
    if (o->pid <= 0 || !key_held(self, o->key))
        return 0;
    if (!in_our_namespace(o))
        return 1; /* its pid means another process here: only the lock can tell */
    uint64_t start;
    char state;
    if (proc_start(o->pid, &start, &state) != 0) {
        /* Only "no such process" proves death. When /proc cannot be read (out of file
         * descriptors, say), the pid's existence decides, so a live holder is never robbed. */
        if (errno == ENOENT || errno == ESRCH)
            return 0;
        return kill(o->pid, 0) == 0 || errno == EPERM;
    }
    return start == o->start && state != 'Z' && state != 'X';
}

/* Forget every entry recorded under `key`: its lock was free, so its owner is dead. */
static void forget_key(region_t *r, uint32_t key)
{
    for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++)
        for (uint32_t s = 0; s < MAX_SLOTS; s++)
            if (r->dev[d].slot[s].owner.pid != 0 && r->dev[d].slot[s].owner.key == key)
                memset(&r->dev[d].slot[s], 0, sizeof r->dev[d].slot[s]);
    for (int w = 0; w < MAX_WAITERS; w++)
        if (r->waiter[w].owner.pid != 0 && r->waiter[w].owner.key == key)
            memset(&r->waiter[w], 0, sizeof r->waiter[w]);
}

/* Take a free key and lock it; under the mutex, so no two processes pick the same one.
 * 0, or -1 with a message in err. */
static int ensure_key(RegionObject *self, char *err, size_t errlen)
{
    if (self->key >= 0)
        return 0;
    region_t *r = self->r;
    for (uint32_t i = 0; i < MAX_KEYS; i++) {
        uint32_t key = (r->next_key + i) % MAX_KEYS;
        struct flock fl = key_byte(F_WRLCK, key);
        if (fcntl(self->fd, F_OFD_GETLK, &fl) != 0) {
            snprintf(err, errlen, "cannot lock the lease region %s: %s", self->path,
                     strerror(errno));
            return -1;
        }
        if (fl.l_type != F_UNLCK)
            continue;
        fl = key_byte(F_WRLCK, key);
        if (fcntl(self->fd, F_OFD_SETLK, &fl) != 0)
            continue;
        forget_key(r, key);
        r->next_key = (key + 1) % MAX_KEYS;
        self->key = (int)key;
        return 0;
    }
    snprintf(err, errlen, "more than %d processes use the lease region %s", MAX_KEYS, self->path);
    return -1;
}

/* This process, as recorded in the entries it owns (after ensure_key). */
static owner_t self_owner(RegionObject *self)
{
    owner_t me = self_identity();
    me.key = (uint32_t)self->key;
    return me;
}

/* After fork() the child shares the parent's open file description, and with it the
 * parent's key lock and inotify queue: give the child its own before it uses the table
 * (reopened through /proc/self/fd, so it is the same file even if the path changed). */
static int own_fds(RegionObject *self)
{
    if (self->pid == getpid())
        return 0;
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", self->fd);
    int fd = open(proc, O_RDWR | O_CLOEXEC);
    int in = fd >= 0 ? inotify_init1(IN_NONBLOCK | IN_CLOEXEC) : -1;
    if (fd < 0 || in < 0 || inotify_add_watch(in, proc, IN_MODIFY) < 0 ||
        dup3(fd, self->fd, O_CLOEXEC) < 0) {
        int saved = errno;
        if (fd >= 0)
            close(fd);
        if (in >= 0)
            close(in);
        region_error(saved, "cannot reopen the lease region %s after fork: %s", self->path,
                     strerror(saved));
        return -1;
    }
    close(fd);
    close(self->inotify);
    self->inotify = in;
    self->key = -1;
    self->abandoned = 0;
    self->pid = getpid();
    return 0;
}

/* Every Region of this process, for the fork handler below. */
#define MAX_LIVE 64
static RegionObject *live_regions[MAX_LIVE];

static void remember(RegionObject *self, int on)
{
    for (int i = 0; i < MAX_LIVE; i++)
        if (live_regions[i] == (on ? NULL : self)) {
            live_regions[i] = on ? self : NULL;
            return;
        }
}

/* In a child just forked (multiprocessing's fork context, a conftest's helper): let go of
 * the parent's open file description at once, and with it the parent's key lock, even if
 * the child never uses the table. Else a child that outlives a SIGKILLed pytest keeps its
 * leases alive for sessions in other pid namespaces. Only system calls here (the child of
 * a threaded parent may not take locks); own_fds() makes the rest its own on first use. */
static void fork_child(void)
{
    for (int i = 0; i < MAX_LIVE; i++) {
        RegionObject *self = live_regions[i];
        if (self == NULL || self->fd < 0)
            continue;
        char proc[32] = "/proc/self/fd/", digits[12];
        int n = 0, at = 14;
        for (unsigned v = (unsigned)self->fd; n == 0 || v > 0; v /= 10)
            digits[n++] = (char)('0' + v % 10);
        while (n > 0)
            proc[at++] = digits[--n];
        proc[at] = '\0';
        /* The same file, in a description of its own (no lock on it), and mapped through
         * it: the inherited mapping holds the parent's description too. Where that fails,
         * the table is dropped here (ready() then says it is not open). */
        int fd = open(proc, O_RDWR | O_CLOEXEC);
        void *mapped = MAP_FAILED;
        if (fd >= 0 && self->r != NULL)
            mapped = mmap(self->r, sizeof(region_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                      fd, 0);
        if (mapped == MAP_FAILED) {
            if (self->r != NULL)
                munmap(self->r, sizeof(region_t));
            self->r = NULL;
            if (fd >= 0)
                close(fd);
            fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        }
        if (fd >= 0) {
            dup3(fd, self->fd, O_CLOEXEC);
            close(fd);
        }
    }
}

static void unlock_region(region_t *r) { pthread_mutex_unlock(&r->lock); }

/* Take the mutex, GIL held on entry and return: in slices, so that Python's signal
 * handlers (Ctrl-C) run while waiting. Fails naming the holder when it has been held
 * for STUCK_S by a stopped process, or past `limit` seconds (< 0: none). */
static int lock_region(RegionObject *self, double limit)
{
    region_t *r = self->r;
    double began = monotonic_s();
    for (;;) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += LOCK_SLICE_NS;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        rc = pthread_mutex_timedlock(&r->lock, &until);
        if (rc == EOWNERDEAD) {
            /* Died inside the critical section: entries are validated by liveness. */
            pthread_mutex_consistent(&r->lock);
            rc = 0;
        }
        Py_END_ALLOW_THREADS
        if (rc == 0)
            return 0;
        if (rc != ETIMEDOUT) {
            region_error(rc, "the lease region %s has an unusable lock (%s); reset it with "
                         "`python -m pytest_gpuiso reset --force`",
                         self->path, strerror(rc));
            return -1;
        }
        if (PyErr_CheckSignals() < 0)
            return -1;
        double waited = monotonic_s() - began;
        /* glibc keeps the holder's thread id in the mutex. It names a thread of our
         * namespace only if the holder is in it: a holder in another namespace is
         * never found stopped here, and is waited for (Ctrl-C still works). */
        pid_t stopped = waited >= STUCK_S ? stopped_process_of(r->lock.__data.__owner) : 0;
        if (stopped > 0) {
            region_error(0, "the lease region %s is locked by pid %d, which is stopped: resume "
                         "it with `kill -CONT %d`, or reset the table with "
                         "`python -m pytest_gpuiso reset --force`",
                         self->path, (int)stopped, (int)stopped);
            return -1;
        }
        if (limit >= 0 && waited >= limit) {
            region_error(ETIMEDOUT, "the lease region %s has been locked for %ld s by thread %d",
                         self->path, (long)(waited + 0.5), (int)r->lock.__data.__owner);
            return -1;
        }
        if (limit < 0 && waited >= LOCK_BOUND_S) { /* held far longer than any critical section */
            region_error(ETIMEDOUT,
                         "the lease region %s has been locked for %ld s by thread %d, which "
                         "never lets go (a table scribbled over, or a process stuck inside it): "
                         "reset it with `python -m pytest_gpuiso reset --force`",
                         self->path, (long)(waited + 0.5), (int)r->lock.__data.__owner);
            return -1;
        }
    }
}

/* Clear entries whose owner is gone. Returns how many. Called under the lock. */
static int reap_dead(RegionObject *self)
{
    region_t *r = self->r;
    int freed = 0;
    for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++) {
        device_t *dev = &r->dev[d];
        for (uint32_t s = 0; s < MAX_SLOTS; s++) {
            slot_t *slot = &dev->slot[s];
            if (slot->owner.pid != 0 && !owner_alive(self, &slot->owner)) {
                memset(slot, 0, sizeof *slot);
                freed++;
            }
        }
    }
    for (int w = 0; w < MAX_WAITERS; w++) {
        waiter_t *wt = &r->waiter[w];
        if (wt->owner.pid != 0 && !owner_alive(self, &wt->owner)) {
            memset(wt, 0, sizeof *wt);
            freed++;
        }
    }
    return freed;
}

static int init_region(region_t *r)
{
    memset(r, 0, sizeof *r);
    pthread_mutexattr_t attr;
    if (pthread_mutexattr_init(&attr) != 0)
        return -1;
    int rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (rc == 0)
        rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (rc == 0)
        rc = pthread_mutex_init(&r->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    if (rc != 0)
        return -1;
    r->next_ticket = 1;
    r->next_lease = 1;
    r->abi = GPUISO_ABI;
    r->size = (uint32_t)sizeof(region_t);
    __atomic_store_n(&r->magic, GPUISO_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

/* Allocate, initialise and publish a region file at `path`; 0, or -1 with errno. The
 * file is unnamed until complete (O_TMPFILE, linked through /proc/self/fd), so a
 * failure or a kill leaves nothing behind; without O_TMPFILE a named temporary file
 * is used and removed on every path out. */
static int publish_region(const char *path)
{
    char dir[4096], tmp[4096], proc[64];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        dir[1] = '\0';
    else if (slash != NULL)
        *slash = '\0';
    else
        snprintf(dir, sizeof dir, ".");
    tmp[0] = '\0';
    int fd = open(dir, O_RDWR | O_TMPFILE | O_CLOEXEC, 0600);
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
        snprintf(tmp, sizeof tmp, "%s.%d.init", path, (int)getpid());
        unlink(tmp);
        fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    }
    if (fd < 0)
        return -1;
    /* Every page backed now: a full file system is ENOSPC here, never a SIGBUS later. */
    int err = posix_fallocate(fd, 0, sizeof(region_t));
    region_t *r = MAP_FAILED;
    if (err == 0) {
        r = mmap(NULL, sizeof(region_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (r == MAP_FAILED)
            err = errno;
        else if (init_region(r) != 0)
            err = EINVAL;
    }
    if (r != MAP_FAILED)
        munmap(r, sizeof(region_t));
    if (err == 0) {
        int rc;
        if (tmp[0]) {
            rc = link(tmp, path);
        } else {
            snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
            rc = linkat(AT_FDCWD, proc, AT_FDCWD, path, AT_SYMLINK_FOLLOW);
        }
        if (rc != 0 && errno != EEXIST) /* EEXIST: another process published first */
            err = errno;
    }
    close(fd);
    if (tmp[0])
        unlink(tmp);
    errno = err;
    return err == 0 ? 0 : -1;
}

static int Region_init(RegionObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", NULL};
    const char *path;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s", kwlist, &path))
        return -1;
    self->fd = -1;
    self->inotify = -1;
    self->key = -1;
    self->pid = getpid();
    self->path = strdup(path);
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 && errno == ENOENT) {
        if (publish_region(path) != 0) {
            region_error(errno, "cannot create the lease region %s: %s", path, strerror(errno));
            return -1;
        }
        fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    }
    if (fd < 0) {
        region_error(errno, "cannot open the lease region %s: %s", path, strerror(errno));
        return -1;
    }
    self->fd = fd;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        (st.st_mode & 077) != 0) {
        region_error(EPERM,
                     "lease region %s is not a private file of uid %d (mode 0600), so not a "
                     "lease table of this user: choose another path with "
                     "PYTEST_GPUISO_LEASE_REGION=PATH",
                     path, (int)geteuid());
        return -1;
    }
    uint64_t magic = 0; /* written last when a table is made, published whole by link() */
    if (pread(fd, &magic, sizeof magic, 0) != (ssize_t)sizeof magic || magic != GPUISO_MAGIC) {
        region_error(0,
                     "%s is not a pytest-gpuiso lease table (no lease-table header): choose "
                     "another path with PYTEST_GPUISO_LEASE_REGION=PATH (a table of yours whose "
                     "header was overwritten must be removed by hand)",
                     path);
        return -1;
    }
    if ((size_t)st.st_size != sizeof(region_t)) {
        region_error(0,
                     "lease region %s has %lld bytes, this pytest-gpuiso expects %zu "
                     "(another version?); reset it with `python -m pytest_gpuiso reset --force`",
                     path, (long long)st.st_size, sizeof(region_t));
        return -1;
    }
    region_t *r = mmap(NULL, sizeof(region_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        region_error(errno, "cannot map the lease region %s: %s", path, strerror(errno));
        return -1;
    }
    self->r = r;
    if (__atomic_load_n(&r->magic, __ATOMIC_ACQUIRE) != GPUISO_MAGIC ||
        r->size != sizeof(region_t)) {
        region_error(0,
                     "lease region %s is corrupted (bad header); reset it with "
                     "`python -m pytest_gpuiso reset --force`",
                     path);
        return -1;
    }
    if (r->abi != GPUISO_ABI) {
        region_error(0,
                     "lease region %s has ABI version %u, this pytest-gpuiso expects %d; "
                     "reset it with `python -m pytest_gpuiso reset --force`",
                     path, r->abi, GPUISO_ABI);
        return -1;
    }
    self->inotify = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (self->inotify < 0 || inotify_add_watch(self->inotify, path, IN_MODIFY) < 0) {
        region_error(errno, "cannot watch the lease region %s: %s", path, strerror(errno));
        return -1;
    }
    remember(self, 1);
    return 0;
}

static void Region_dealloc(RegionObject *self)
{
    remember(self, 0);
    if (self->r != NULL)
        munmap(self->r, sizeof(region_t));
    if (self->fd >= 0)
        close(self->fd); /* drops our key's lock: entries left behind are dead */
    if (self->inotify >= 0)
        close(self->inotify);
    free(self->path);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Attached and usable by this process: 0, or -1 with an exception set. */
static int ready(RegionObject *self)
{
    if (self->r == NULL) {
        PyErr_SetString(RegionError, "the lease region is not open");
        return -1;
    }
    return own_fds(self);
}

/* ------------------------------------------------------------------ acquire */

/* What a device holds in its units: bytes, or WHOLE when its capacity is unknown. */
static uint64_t capacity_of(const device_t *dev)
{
    return dev->capacity ? dev->capacity : WHOLE;
}

static uint64_t used_of(const device_t *dev)
{
    uint64_t used = 0;
    for (uint32_t s = 0; s < MAX_SLOTS; s++)
        if (dev->slot[s].owner.pid != 0)
            used += dev->slot[s].amount;
    return used;
}

/* What a request takes of `dev`: its amount, or its share of the capacity (rounded down,
 * so that `slots` shares of 1/slots always fit together). 0: it can never fit there. */
static uint64_t need_on(const device_t *dev, uint64_t amount, uint32_t share)
{
    uint64_t capacity = capacity_of(dev);
    if (amount == 0) {
        unsigned __int128 part = (unsigned __int128)capacity * share / WHOLE;
        amount = part > 0 ? (uint64_t)part : 1;
    } else if (dev->capacity == 0) {
        return 0; /* bytes on a device of unknown size: never */
    }
    return amount <= capacity ? amount : 0;
}

/* A device's size for messages: "80 GiB", "0.5 GiB", or "an unknown size". */
static void size_words(char *buf, size_t len, uint64_t size)
{
    if (size == 0)
        snprintf(buf, len, "an unknown size");
    else
        snprintf(buf, len, "%.4g GiB", (double)size / (1ULL << 30));
}

/* A row that no live holder and no live waiter uses, other than the first `done` of
 * `rows` (this request's own), to take for a new device name; -1 when every row is in use.
 * Without it, after 64 distinct device names (MIG instances come and go) every new one
 * would be refused until a reset. */
static int recyclable_row(RegionObject *self, const int *rows, int done)
{
    region_t *r = self->r;
    for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++) {
        int used = r->dev[d].quarantined_ns != 0; /* its quarantine outlives its holders */
        for (int i = 0; i < done && !used; i++)
            used = rows[i] == (int)d;
        for (uint32_t s = 0; s < MAX_SLOTS && !used; s++)
            used = r->dev[d].slot[s].owner.pid != 0 && owner_alive(self, &r->dev[d].slot[s].owner);
        for (int w = 0; w < MAX_WAITERS && !used; w++)
            used = r->waiter[w].owner.pid != 0 && (r->waiter[w].mask >> d & 1) &&
                   owner_alive(self, &r->waiter[w].owner);
        if (!used)
            return (int)d;
    }
    return -1;
}

/* Give row `row` to device `name`: nameless until the very end, so that a process killed
 * midway leaves a row no name matches (and that is recycled in its turn). */
static void rename_row(device_t *dev, const char *name, uint64_t capacity)
{
    dev->name[0] = '\0';
    memset(dev->slot, 0, sizeof dev->slot);
    dev->quarantined_ns = 0;
    memset(dev->why, 0, sizeof dev->why);
    dev->capacity = capacity;
    size_t len = strnlen(name, NAME_LEN - 1);
    memset(dev->name + 1, 0, NAME_LEN - 1);
    if (len > 1)
        memcpy(dev->name + 1, name + 1, len - 1);
    __atomic_store_n(&dev->name[0], name[0], __ATOMIC_RELEASE);
}

/* "device 0 is leased as 80 GiB of memory by pid 12 (label); this session says 40 GiB" */
static void size_conflict(char *err, size_t errlen, const char *name, const char *how,
                          uint64_t was, uint64_t now, pid_t pid, const char *label)
{
    char text[81], was_words[32], now_words[32];
    copy_text(text, label, sizeof text);
    size_words(was_words, sizeof was_words, was);
    size_words(now_words, sizeof now_words, now);
    snprintf(err, errlen, "device %s is %s as %s of memory by pid %d (%s); this session says %s",
             name, how, was_words, (int)pid, text, now_words);
}

/* Find or add the rows of `names`; -1 and a message when a device is leased with
 * another capacity by a live holder (two sessions disagree about its size). */
static int resolve_rows(RegionObject *self, char **names, int count, const uint64_t *capacities,
                        int *rows, char *err, size_t errlen)
{
    region_t *r = self->r;
    for (int i = 0; i < count; i++) {
        int row = -1;
        for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++)
            if (strncmp(r->dev[d].name, names[i], NAME_LEN) == 0)
                row = (int)d;
        if (row < 0 && r->ndevices >= MAX_DEVICES) {
            row = recyclable_row(self, rows, i);
            if (row < 0) {
                snprintf(err, errlen,
                         "the lease region has no room for device %s: its %d device rows are "
                         "all held or waited for",
                         names[i], MAX_DEVICES);
                return -1;
            }
            rename_row(&r->dev[row], names[i], capacities[i]);
            r->generation++; /* requests that resolved this row before find theirs again */
        }
        if (row < 0) {
            row = (int)r->ndevices;
            memset(&r->dev[row], 0, sizeof r->dev[row]);
            snprintf(r->dev[row].name, NAME_LEN, "%s", names[i]);
            r->dev[row].capacity = capacities[i];
            r->ndevices++; /* counted only once complete: a kill before leaves no trace */
        }
        device_t *dev = &r->dev[row];
        if (dev->capacity != capacities[i]) {
            /* Neither a live holder nor a live waiter sized against the old capacity may
             * have it changed under it: the waiter's request might never fit again, and
             * every later request would queue behind it. */
            for (uint32_t s = 0; s < MAX_SLOTS; s++)
                if (dev->slot[s].owner.pid != 0 && owner_alive(self, &dev->slot[s].owner)) {
                    size_conflict(err, errlen, names[i], "leased", dev->capacity, capacities[i],
                                  dev->slot[s].owner.pid, dev->slot[s].label);
                    return -1;
                }
            for (int w = 0; w < MAX_WAITERS; w++) {
                waiter_t *wt = &r->waiter[w];
                if (wt->owner.pid != 0 && (wt->mask >> row & 1) && owner_alive(self, &wt->owner)) {
                    size_conflict(err, errlen, names[i], "waited for", dev->capacity,
                                  capacities[i], wt->owner.pid, wt->label);
                    return -1;
                }
            }
            memset(dev->slot, 0, sizeof dev->slot);
            dev->capacity = capacities[i];
        }
        rows[i] = row;
    }
    return 0;
}

/* How many of the rows of `mask` are not quarantined: a request for more waits for a lift. */
static uint32_t healthy_in(const region_t *r, uint64_t mask)
{
    uint32_t n = 0;
    for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++)
        if ((mask >> d & 1) && r->dev[d].quarantined_ns == 0)
            n++;
    return n;
}

/* A free holder entry of `dev` where the request fits, or -1. */
static int room_on(const device_t *dev, uint64_t need)
{
    if (need == 0 || dev->quarantined_ns != 0 || used_of(dev) + need > capacity_of(dev))
        return -1;
    for (uint32_t s = 0; s < MAX_SLOTS; s++)
        if (dev->slot[s].owner.pid == 0)
            return (int)s;
    return -1;
}

/* Take n rows among `allowed` where the request fits (most free first), all or nothing. */
static int try_take(region_t *r, const int *rows, int count, uint64_t allowed, uint32_t n,
                    uint64_t amount, uint32_t share, const char *label, owner_t me,
                    uint64_t *lease, int *taken)
{
    int order[MAX_DEVICES], k = 0;
    uint64_t nfree[MAX_DEVICES];
    for (int i = 0; i < count; i++)
        if ((allowed >> rows[i]) & 1) {
            device_t *dev = &r->dev[rows[i]];
            if (room_on(dev, need_on(dev, amount, share)) < 0)
                continue;
            uint64_t f = capacity_of(dev) - used_of(dev);
            if (dev->capacity == 0) /* units of unknown devices rank after bytes of known */
                f = f / WHOLE;
            int j = k++;
            while (j > 0 && nfree[j - 1] < f) { /* stable sort: most free first */
                order[j] = order[j - 1];
                nfree[j] = nfree[j - 1];
                j--;
            }
            order[j] = rows[i];
            nfree[j] = f;
        }
    if ((uint32_t)k < n)
        return 0;
    *lease = r->next_lease++;
    int64_t now = realtime_ns();
    for (uint32_t i = 0; i < n; i++) {
        device_t *dev = &r->dev[order[i]];
        uint64_t need = need_on(dev, amount, share);
        slot_t *slot = &dev->slot[room_on(dev, need)];
        slot->lease = *lease;
        slot->amount = need;
        slot->since_ns = now;
        copy_text(slot->label, label, LABEL_LEN);
        slot->owner = me; /* last: a half-written entry never looks taken */
        taken[i] = order[i];
    }
    return 1;
}

enum { GOT, WAIT, TIMED_OUT, INTERRUPTED, FAILED };

typedef struct {
    char names[MAX_DEVICES][NAME_LEN];
    uint64_t capacities[MAX_DEVICES];
    uint64_t amount;
    uint32_t share;
    uint32_t generation;
    int rows[MAX_DEVICES];
    int count;
    uint64_t mask;
    uint32_t n;
    int waiter; /* index in r->waiter, -1 if none */
    int suspect; /* someone we watched may have died: re-check every owner */
    uint64_t ticket;
    uint64_t lease;
    int taken[MAX_DEVICES];
    char err[512];
} request_t;

/* Withdraw our waiter entry with `ticket`, if it is still there. Under the lock. */
static void withdraw(RegionObject *self, uint64_t ticket)
{
    owner_t me = self_owner(self);
    for (int w = 0; ticket != 0 && w < MAX_WAITERS; w++) {
        waiter_t *wt = &self->r->waiter[w];
        if (wt->ticket == ticket && same_owner(&wt->owner, &me) && wt->owner.key == me.key)
            memset(wt, 0, sizeof *wt);
    }
}

static void leave_queue(RegionObject *self, request_t *q)
{
    if (q->waiter >= 0) {
        withdraw(self, q->ticket);
        q->waiter = -1;
    }
}

/* One attempt, entered holding the lock (released here), GIL released: take the
 * lease, or block until something changes. */
static int attempt(RegionObject *self, request_t *q, const char *label, double deadline)
{
    region_t *r = self->r;
    /* Everyone it may wait on: the holders of its devices and the waiters ahead. */
    size_t most = (size_t)q->count * MAX_SLOTS + MAX_WAITERS + 1;
    int *pidfds = malloc(most * sizeof *pidfds);
    owner_t *watched = malloc(most * sizeof *watched);
    struct pollfd *fds = malloc(most * sizeof *fds);
    int npid = 0, changed = 0, blind = 0; /* blind: a process we cannot watch */
    if (pidfds == NULL || watched == NULL || fds == NULL) {
        unlock_region(r);
        free(pidfds);
        free(watched);
        free(fds);
        snprintf(q->err, sizeof q->err, "out of memory while waiting for a GPU lease");
        return FAILED;
    }

    struct stat st;
    if (fstat(self->fd, &st) == 0 && st.st_nlink == 0) {
        unlock_region(r);
        snprintf(q->err, sizeof q->err,
                 "the lease region %s was deleted (reset --force?) while this process used it",
                 self->path);
        goto out_failed;
    }
    if (ensure_key(self, q->err, sizeof q->err) != 0) {
        unlock_region(r);
        goto out_failed;
    }
    owner_t me = self_owner(self);
    if (self->abandoned != 0) { /* an interrupted wait left its entry: a stale ticket ahead */
        withdraw(self, self->abandoned);
        self->abandoned = 0;
    }
    if (q->generation != r->generation) { /* the table was cleared (rows and queue gone), or
                                             * a row was recycled: find the rows again */
        leave_queue(self, q); /* after a recycling, our entry may name another device's row */
        char *names[MAX_DEVICES];
        for (int i = 0; i < q->count; i++)
            names[i] = q->names[i];
        if (resolve_rows(self, names, q->count, q->capacities, q->rows, q->err, sizeof q->err) !=
            0) {
            unlock_region(r);
            goto out_failed;
        }
        q->mask = 0;
        for (int i = 0; i < q->count; i++)
            q->mask |= 1ULL << q->rows[i];
        q->waiter = -1;
        q->generation = r->generation;
    }
    if (q->suspect) { /* a full liveness scan reads /proc for every owner: only when needed */
        if (reap_dead(self) > 0)
            ring(self);
        q->suspect = 0;
    }
    if (q->waiter < 0) {
        for (int w = 0; w < MAX_WAITERS; w++)
            if (r->waiter[w].owner.pid == 0) {
                q->waiter = w;
                break;
            }
        if (q->waiter < 0) {
            unlock_region(r);
            snprintf(q->err, sizeof q->err, "more than %d processes are waiting for GPUs", MAX_WAITERS);
            goto out_failed;
        }
        waiter_t *w = &r->waiter[q->waiter];
        q->ticket = r->next_ticket++;
        w->ticket = q->ticket;
        w->mask = q->mask;
        w->amount = q->amount;
        w->share = q->share;
        w->n = q->n;
        w->since_ns = realtime_ns();
        copy_text(w->label, label, LABEL_LEN);
        w->owner = me;
    }
    /* Devices wanted by earlier waiters are theirs first, unless that waiter is stopped
     * (Ctrl-Z): it keeps its ticket but holds nobody back until it runs again; nor does
     * one that quarantines left without enough healthy devices (until a lift). The waits
     * below end at least once a second, so a waiter stopped meanwhile is seen then. */
    uint64_t blocked = 0;
    for (int w = 0; w < MAX_WAITERS; w++) {
        waiter_t *wt = &r->waiter[w];
        if (wt->owner.pid != 0 && wt->ticket < q->ticket && (wt->mask & q->mask) &&
            !owner_stopped(&wt->owner) && wt->n <= healthy_in(r, wt->mask)) {
            blocked |= wt->mask;
            if (!in_our_namespace(&wt->owner)) {
                blind = 1; /* its pid means nothing here: re-check every 100 ms */
                continue;
            }
            int fd = (int)syscall(SYS_pidfd_open, wt->owner.pid, 0);
            if (fd >= 0)
                watched[npid] = wt->owner, pidfds[npid++] = fd;
            else if (errno == ESRCH)
                changed = 1; /* gone already */
            else
                blind = 1;
        }
    }
    if (try_take(r, q->rows, q->count, q->mask & ~blocked, q->n, q->amount, q->share, label, me,
                 &q->lease, q->taken)) {
        leave_queue(self, q);
        ring(self); /* the next waiter is now first in line */
        unlock_region(r);
        for (int i = 0; i < npid; i++)
            close(pidfds[i]);
        free(pidfds);
        free(watched);
        free(fds);
        return GOT;
    }
    for (int i = 0; i < q->count; i++) {
        device_t *dev = &r->dev[q->rows[i]];
        for (uint32_t s = 0; s < MAX_SLOTS; s++)
            if (dev->slot[s].owner.pid != 0) {
                if (!in_our_namespace(&dev->slot[s].owner)) {
                    blind = 1;
                    continue;
                }
                int fd = (int)syscall(SYS_pidfd_open, dev->slot[s].owner.pid, 0);
                if (fd >= 0)
                    watched[npid] = dev->slot[s].owner, pidfds[npid++] = fd;
                else if (errno == ESRCH)
                    changed = 1; /* gone between the reap and now */
                else
                    blind = 1; /* out of descriptors, say: re-check every 100 ms */
            }
    }
    /* An owner that died before its pidfd was opened, its pid reused since, would be
     * watched in vain: check the watched ones now, and re-scan everything if one is gone. */
    for (int i = 0; i < npid && !changed; i++)
        if (!owner_alive(self, &watched[i]))
            changed = 1;
    if (changed)
        q->suspect = 1;
    unlock_region(r);

    int rc = WAIT;
    if (changed && deadline >= 0 && monotonic_s() >= deadline)
        rc = TIMED_OUT;
    else if (!changed) {
        fds[0].fd = self->inotify;
        fds[0].events = POLLIN;
        for (int i = 0; i < npid; i++) {
            fds[i + 1].fd = pidfds[i];
            fds[i + 1].events = POLLIN;
        }
        int timeout_ms = -1;
        if (deadline >= 0) {
            double left = deadline - monotonic_s();
            timeout_ms = left <= 0 ? 0 : left > 86400 ? 86400000 : (int)(left * 1000) + 1;
        }
        if (blind && (timeout_ms < 0 || timeout_ms > 100))
            timeout_ms = 100;
        /* A signal that lands between Python's check and poll() does not interrupt it:
         * wake once a second so Ctrl-C is acted on within that (no busy polling). */
        if (timeout_ms < 0 || timeout_ms > 1000)
            timeout_ms = 1000;
        int ready = poll(fds, (nfds_t)npid + 1, timeout_ms);
        if (ready < 0 && errno == EINTR)
            rc = INTERRUPTED;
        else if (ready == 0 && deadline >= 0 && monotonic_s() >= deadline)
            rc = TIMED_OUT;
        else if (ready == 0 && blind)
            q->suspect = 1;
        for (int i = 1; ready > 0 && i <= npid; i++)
            if (fds[i].revents)
                q->suspect = 1; /* a process we waited on has exited */
        char buf[4096];
        while (read(self->inotify, buf, sizeof buf) > 0) {
        }
    }
    for (int i = 0; i < npid; i++)
        close(pidfds[i]);
    free(pidfds);
    free(watched);
    free(fds);
    return rc;
out_failed:
    free(pidfds);
    free(watched);
    free(fds);
    return FAILED;
}

/* Leave the queue after a timeout or an error, keeping the pending exception; when the
 * lock cannot be had (it is what failed, or is stuck), our next attempt leaves it. */
static void give_up(RegionObject *self, request_t *q, int lock_failed)
{
    if (q->waiter < 0)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!lock_failed && lock_region(self, STUCK_S) == 0) {
        Py_BEGIN_ALLOW_THREADS
        leave_queue(self, q);
        ring(self);
        unlock_region(self->r);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_Clear();
        self->abandoned = q->ticket; /* withdrawn by our next attempt: never a ticket ahead */
        q->waiter = -1;
    }
    PyErr_Restore(type, value, tb);
}

static PyObject *Region_acquire(RegionObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"devices", "slots",      "n",     "label", "timeout",
                             "amount",  "capacities", "share", NULL};
    PyObject *devices;
    unsigned int slots, n;
    const char *label;
    PyObject *timeout_obj = Py_None, *capacities_obj = Py_None;
    unsigned long long amount = 0;
    unsigned int share = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OIIs|OKOI", kwlist, &devices, &slots, &n, &label,
                                     &timeout_obj, &amount, &capacities_obj, &share))
        return NULL;
    if (share > WHOLE || (share != 0 && amount != 0))
        return PyErr_Format(PyExc_ValueError,
                            "share is in parts per million (0..%llu), and excludes amount",
                            (unsigned long long)WHOLE);
    if (ready(self) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(devices, "devices must be a sequence of names");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count < 1 || count > MAX_DEVICES || slots < 1 || slots > MAX_SLOTS || n < 1 ||
        n > (unsigned int)count) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError,
                            "need 1..%d devices, 1..%d slots and 1..len(devices) GPUs", MAX_DEVICES,
                            MAX_SLOTS);
    }
    uint64_t capacities[MAX_DEVICES];
    memset(capacities, 0, sizeof capacities);
    if (capacities_obj != Py_None) {
        PyObject *caps = PySequence_Fast(capacities_obj, "capacities must be a sequence of ints");
        if (caps == NULL || PySequence_Fast_GET_SIZE(caps) != count) {
            if (caps != NULL)
                PyErr_SetString(PyExc_ValueError, "need one capacity per device");
            Py_XDECREF(caps);
            Py_DECREF(seq);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            capacities[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(caps, i));
            if (PyErr_Occurred()) {
                Py_DECREF(caps);
                Py_DECREF(seq);
                return NULL;
            }
        }
        Py_DECREF(caps);
    }
    int fits = 0; /* devices the request could ever fit on */
    for (Py_ssize_t i = 0; i < count; i++)
        fits += amount == 0 || (capacities[i] != 0 && amount <= capacities[i]);
    if ((unsigned int)fits < n) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError,
                            "%llu bytes on %u GPUs: only %d of the devices are known to be that "
                            "large",
                            amount, n, fits);
    }
    char *names[MAX_DEVICES];
    for (Py_ssize_t i = 0; i < count; i++) {
        names[i] = (char *)PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
        if (names[i] == NULL || strlen(names[i]) >= NAME_LEN) {
            Py_DECREF(seq);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "device names must be shorter than 64 bytes");
            return NULL;
        }
        for (Py_ssize_t j = 0; j < i; j++)
            if (strcmp(names[i], names[j]) == 0) {
                PyErr_Format(PyExc_ValueError, "device %s is listed twice", names[i]);
                Py_DECREF(seq);
                return NULL;
            }
    }
    double deadline = -1;
    if (timeout_obj != Py_None) {
        double t = PyFloat_AsDouble(timeout_obj);
        if (t == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        deadline = monotonic_s() + (t < 0 ? 0 : t);
    }
    request_t q;
    memset(&q, 0, sizeof q);
    q.waiter = -1;
    q.suspect = 1;
    q.count = (int)count;
    q.amount = amount;
    q.share = amount ? 0 : share ? share : (uint32_t)(WHOLE / slots);
    for (int i = 0; i < q.count; i++) {
        snprintf(q.names[i], NAME_LEN, "%s", names[i]);
        q.capacities[i] = capacities[i];
    }
    q.n = n;
    Py_DECREF(seq); /* names now live in q */
    for (int i = 0; i < q.count; i++)
        names[i] = q.names[i];
    if (lock_region(self, -1) != 0)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = resolve_rows(self, names, q.count, q.capacities, q.rows, q.err, sizeof q.err);
    q.generation = self->r->generation;
    unlock_region(self->r);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_Format(RegionError, "%s", q.err);
    for (int i = 0; i < q.count; i++)
        q.mask |= 1ULL << q.rows[i];

    for (;;) {
        int lock_failed = lock_region(self, -1) != 0;
        if (lock_failed) {
            rc = FAILED; /* the exception is set */
        } else {
            Py_BEGIN_ALLOW_THREADS
            rc = attempt(self, &q, label, deadline);
            Py_END_ALLOW_THREADS
        }
        if (rc == GOT)
            break;
        if (rc != FAILED && PyErr_CheckSignals() < 0)
            rc = FAILED; /* the exception (KeyboardInterrupt) is already set */
        if (rc == TIMED_OUT || rc == FAILED) {
            if (rc == FAILED && !PyErr_Occurred())
                PyErr_Format(RegionError, "%s", q.err);
            give_up(self, &q, lock_failed);
            if (rc == TIMED_OUT)
                Py_RETURN_NONE;
            return NULL;
        }
    }
    PyObject *names_out = PyList_New(n);
    if (names_out == NULL)
        return NULL;
    for (unsigned int i = 0; i < n; i++) {
        PyObject *name = text_of(self->r->dev[q.taken[i]].name, NAME_LEN);
        if (name == NULL) {
            Py_DECREF(names_out);
            return NULL;
        }
        PyList_SET_ITEM(names_out, i, name);
    }
    return Py_BuildValue("(KN)", (unsigned long long)q.lease, names_out);
}

static PyObject *Region_release(RegionObject *self, PyObject *args)
{
    unsigned long long lease;
    if (!PyArg_ParseTuple(args, "K", &lease))
        return NULL;
    if (ready(self) < 0 || lock_region(self, -1) != 0)
        return NULL;
    int freed = 0;
    owner_t me = self_identity();
    Py_BEGIN_ALLOW_THREADS
    region_t *r = self->r;
    for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++)
        for (uint32_t s = 0; s < MAX_SLOTS; s++) {
            slot_t *slot = &r->dev[d].slot[s];
            if (slot->lease == lease && same_owner(&slot->owner, &me)) {
                memset(slot, 0, sizeof *slot);
                freed++;
            }
        }
    ring(self);
    unlock_region(r);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(freed);
}

/* adopt(lease_id) -> number of slots now ours: the live slots of `lease_id` held by our
 * parent process (a pinned worker's lease, taken by its xdist controller) become ours, so
 * that they live as long as we do, whatever becomes of the parent. Only the parent's: a
 * process cannot take the leases of another. */
static PyObject *Region_adopt(RegionObject *self, PyObject *args)
{
    unsigned long long lease;
    char err[256] = "";
    if (!PyArg_ParseTuple(args, "K", &lease))
        return NULL;
    if (ready(self) < 0 || lock_region(self, -1) != 0)
        return NULL;
    int taken = 0;
    region_t *r = self->r;
    if (ensure_key(self, err, sizeof err) != 0) {
        unlock_region(r);
        region_error(0, "%s", err);
        return NULL;
    }
    owner_t me = self_owner(self), parent = self_identity();
    parent.pid = getppid();
    if (proc_start(parent.pid, &parent.start, NULL) != 0)
        parent.pid = 0; /* gone: nothing of it to take */
    for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++)
        for (uint32_t s = 0; s < MAX_SLOTS; s++) {
            slot_t *slot = &r->dev[d].slot[s];
            if (slot->lease == lease && same_owner(&slot->owner, &parent) &&
                owner_alive(self, &slot->owner)) {
                slot->owner = me;
                taken++;
            }
        }
    ring(self);
    unlock_region(r);
    return PyLong_FromLong(taken);
}

/* ------------------------------------------------------------------ inspection */

static PyObject *owner_dict(RegionObject *self, const owner_t *o)
{
    return Py_BuildValue("{s:i,s:K,s:O,s:O,s:O}", "pid", o->pid, "start",
                         (unsigned long long)o->start, "alive",
                         owner_alive(self, o) ? Py_True : Py_False, "stopped",
                         owner_stopped(o) ? Py_True : Py_False, "here",
                         in_our_namespace(o) ? Py_True : Py_False);
}

/* owner_dict(o) updated with the pairs of `format` (a dict format). */
static PyObject *entry(RegionObject *self, const owner_t *o, const char *format, ...)
{
    PyObject *d = owner_dict(self, o);
    va_list vargs;
    va_start(vargs, format);
    PyObject *more = d ? Py_VaBuildValue(format, vargs) : NULL;
    va_end(vargs);
    if (more == NULL || PyDict_Update(d, more) < 0) {
        Py_XDECREF(d);
        d = NULL;
    }
    Py_XDECREF(more);
    return d;
}

/* The optional `timeout` argument of snapshot() and clear(): seconds, -1 for None. */
static int lock_timeout(PyObject *args, PyObject *kwds, double *limit)
{
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &timeout_obj))
        return -1;
    *limit = -1;
    if (timeout_obj != Py_None) {
        *limit = PyFloat_AsDouble(timeout_obj);
        if (*limit == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

static PyObject *Region_snapshot(RegionObject *self, PyObject *args, PyObject *kwds)
{
    double limit;
    if (lock_timeout(args, kwds, &limit) < 0 || ready(self) < 0)
        return NULL;
    region_t *copy = malloc(sizeof(region_t));
    if (copy == NULL)
        return PyErr_NoMemory();
    if (lock_region(self, limit) != 0) {
        free(copy);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    memcpy(copy, self->r, sizeof(region_t));
    unlock_region(self->r);
    Py_END_ALLOW_THREADS
    PyObject *devices = PyList_New(0), *holders = PyList_New(0), *waiters = PyList_New(0);
    PyObject *quarantined = PyList_New(0), *item = NULL;
    if (devices == NULL || holders == NULL || waiters == NULL || quarantined == NULL)
        goto fail;
    for (uint32_t d = 0; d < copy->ndevices && d < MAX_DEVICES; d++) {
        device_t *dev = &copy->dev[d];
        item = Py_BuildValue("(NKK)", text_of(dev->name, NAME_LEN),
                             (unsigned long long)dev->capacity,
                             (unsigned long long)used_of(dev));
        if (item == NULL || PyList_Append(devices, item) < 0)
            goto fail;
        Py_CLEAR(item);
        if (dev->quarantined_ns != 0) {
            item = Py_BuildValue("{s:N,s:L,s:N}", "device", text_of(dev->name, NAME_LEN),
                                 "since_ns", (long long)dev->quarantined_ns, "why",
                                 text_of(dev->why, LABEL_LEN));
            if (item == NULL || PyList_Append(quarantined, item) < 0)
                goto fail;
            Py_CLEAR(item);
        }
        for (uint32_t s = 0; s < MAX_SLOTS; s++) {
            slot_t *slot = &dev->slot[s];
            if (slot->owner.pid == 0)
                continue;
            item = entry(self, &slot->owner, "{s:N,s:I,s:K,s:K,s:L,s:N}", "device",
                         text_of(dev->name, NAME_LEN), "slot", s, "lease",
                         (unsigned long long)slot->lease, "amount",
                         (unsigned long long)slot->amount, "since_ns", (long long)slot->since_ns,
                         "label", text_of(slot->label, LABEL_LEN));
            if (item == NULL || PyList_Append(holders, item) < 0)
                goto fail;
            Py_CLEAR(item);
        }
    }
    for (int w = 0; w < MAX_WAITERS; w++) {
        waiter_t *wt = &copy->waiter[w];
        if (wt->owner.pid == 0)
            continue;
        item = entry(self, &wt->owner, "{s:K,s:I,s:K,s:K,s:I,s:L,s:N}", "ticket",
                     (unsigned long long)wt->ticket, "n", wt->n, "mask",
                     (unsigned long long)wt->mask, "amount", (unsigned long long)wt->amount,
                     "share", wt->share, "since_ns", (long long)wt->since_ns, "label",
                     text_of(wt->label, LABEL_LEN));
        if (item == NULL || PyList_Append(waiters, item) < 0)
            goto fail;
        Py_CLEAR(item);
    }
    free(copy);
    return Py_BuildValue("{s:N,s:N,s:N,s:N}", "devices", devices, "holders", holders, "waiters",
                         waiters, "quarantined", quarantined);
fail:
    free(copy);
    Py_XDECREF(item);
    Py_XDECREF(quarantined);
    Py_XDECREF(devices);
    Py_XDECREF(holders);
    Py_XDECREF(waiters);
    return NULL;
}

static PyObject *Region_clear(RegionObject *self, PyObject *args, PyObject *kwds)
{
    double limit;
    if (lock_timeout(args, kwds, &limit) < 0 || ready(self) < 0 || lock_region(self, limit) != 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    region_t *r = self->r;
    memset(r->dev, 0, sizeof r->dev);
    memset(r->waiter, 0, sizeof r->waiter);
    r->ndevices = 0;
    r->generation++;
    ring(self);
    unlock_region(r);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The row named `name`, or -1. Under the lock. */
static int row_named(region_t *r, const char *name)
{
    for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++)
        if (strncmp(r->dev[d].name, name, NAME_LEN) == 0)
            return (int)d;
    return -1;
}

/* quarantine(device, why) / lift(device): set or clear a device's quarantine. */
static PyObject *set_quarantine(RegionObject *self, const char *name, const char *why)
{
    if (ready(self) < 0 || lock_region(self, -1) != 0)
        return NULL;
    region_t *r = self->r;
    int row = row_named(r, name), was = 0;
    if (row >= 0) {
        device_t *dev = &r->dev[row];
        was = dev->quarantined_ns != 0;
        if (why != NULL) {
            copy_text(dev->why, why, LABEL_LEN);
            __atomic_store_n(&dev->quarantined_ns, realtime_ns(), __ATOMIC_RELEASE);
        } else {
            __atomic_store_n(&dev->quarantined_ns, 0, __ATOMIC_RELEASE);
            memset(dev->why, 0, sizeof dev->why);
            ring(self); /* its waiters may take it now */
        }
    }
    unlock_region(r);
    if (row < 0)
        return PyErr_Format(PyExc_KeyError, "no device %s in the lease table", name);
    return PyBool_FromLong(was);
}

/* quarantined() -> [{device, since_ns, why}]: the quarantines alone (no copy of the table,
 * so that a lease may look at them every time). */
static PyObject *Region_quarantined(RegionObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ready(self) < 0)
        return NULL;
    char names[MAX_DEVICES][NAME_LEN], why[MAX_DEVICES][LABEL_LEN];
    int64_t since[MAX_DEVICES];
    int n = 0;
    if (lock_region(self, -1) != 0)
        return NULL;
    region_t *r = self->r;
    for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++)
        if (r->dev[d].quarantined_ns != 0) {
            memcpy(names[n], r->dev[d].name, NAME_LEN);
            memcpy(why[n], r->dev[d].why, LABEL_LEN);
            since[n++] = r->dev[d].quarantined_ns;
        }
    unlock_region(r);
    PyObject *list = PyList_New(0);
    for (int i = 0; list != NULL && i < n; i++) {
        PyObject *item = Py_BuildValue("{s:N,s:L,s:N}", "device", text_of(names[i], NAME_LEN),
                                       "since_ns", (long long)since[i], "why",
                                       text_of(why[i], LABEL_LEN));
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(item);
    }
    return list;
}

static PyObject *Region_quarantine(RegionObject *self, PyObject *args)
{
    const char *name, *why;
    if (!PyArg_ParseTuple(args, "ss", &name, &why))
        return NULL;
    return set_quarantine(self, name, why);
}

static PyObject *Region_lift(RegionObject *self, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    return set_quarantine(self, name, NULL);
}

static PyObject *Region_get_path(RegionObject *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->path ? self->path : "");
}

static PyMethodDef Region_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))Region_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(devices, slots, n, label, timeout=None, amount=0, capacities=None) -> (lease_id, "
     "[device names]) or None "
     "on timeout. Blocks (GIL released) until n of the devices have room: `amount` bytes on each "
     "(capacities: bytes per device, 0 unknown), or `share` parts per million of each, or "
     "1/slots of each."},
    {"release", (PyCFunction)Region_release, METH_VARARGS,
     "release(lease_id) -> number of slots freed"},
    {"adopt", (PyCFunction)Region_adopt, METH_VARARGS,
     "adopt(lease_id) -> number of slots taken over: the live slots of the lease that our "
     "parent process holds become ours (they live as long as we do)"},
    {"snapshot", (PyCFunction)(void (*)(void))Region_snapshot, METH_VARARGS | METH_KEYWORDS,
     "snapshot(timeout=None) -> {'devices': [(name, capacity, used)], 'holders': [...], 'waiters': [...], "
     "'quarantined': [{device, since_ns, why}]}; "
     "each "
     "holder and waiter has pid, start, alive, stopped and here (in our pid namespace)"},
    {"quarantine", (PyCFunction)Region_quarantine, METH_VARARGS,
     "quarantine(device, why) -> whether it was quarantined already: no one leases it until "
     "lift(device); KeyError for a device the table does not know"},
    {"quarantined", (PyCFunction)Region_quarantined, METH_NOARGS,
     "quarantined() -> [{device, since_ns, why}], as snapshot()['quarantined'], without the rest"},
    {"lift", (PyCFunction)Region_lift, METH_VARARGS,
     "lift(device) -> whether it was quarantined; its waiters are woken"},
    {"clear", (PyCFunction)(void (*)(void))Region_clear, METH_VARARGS | METH_KEYWORDS,
     "clear(timeout=None) -> forget every holder and waiter; RegionError if the table's lock "
     "is held longer than timeout seconds"},
    {NULL, NULL, 0, NULL},
};

/* True once the file this Region is attached to has been deleted (reset --force): a
 * session then attaches to the table that replaces it. */
static PyObject *Region_get_unlinked(RegionObject *self, void *Py_UNUSED(closure))
{
    struct stat st;
    return PyBool_FromLong(self->fd >= 0 && fstat(self->fd, &st) == 0 && st.st_nlink == 0);
}

static PyGetSetDef Region_getset[] = {
    {"path", (getter)Region_get_path, NULL, "the region file", NULL},
    {"unlinked", (getter)Region_get_unlinked, NULL, "whether the region file was deleted", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pytest_gpuiso._lease.Region",
    .tp_basicsize = sizeof(RegionObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Region(path): the per-user GPU lease table, created on first use.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Region_init,
    .tp_dealloc = (destructor)Region_dealloc,
    .tp_methods = Region_methods,
    .tp_getset = Region_getset,
};

static struct PyModuleDef lease_module = {
    PyModuleDef_HEAD_INIT, "pytest_gpuiso._lease",
    "Process-shared GPU lease table (see native/gpuiso_lease.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__lease(void)
{
    if (PyType_Ready(&RegionType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&lease_module);
    if (m == NULL)
        return NULL;
    RegionError = PyErr_NewException("pytest_gpuiso._lease.RegionError", PyExc_RuntimeError, NULL);
    pthread_atfork(NULL, NULL, fork_child);
    Py_INCREF(&RegionType);
    if (PyModule_AddObject(m, "Region", (PyObject *)&RegionType) < 0 ||
        PyModule_AddObject(m, "RegionError", RegionError) < 0 ||
        PyModule_AddIntConstant(m, "ABI_VERSION", GPUISO_ABI) < 0 ||
        PyModule_AddIntConstant(m, "REGION_SIZE", (long)sizeof(region_t)) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DEVICES", MAX_DEVICES) < 0 ||
        PyModule_AddIntConstant(m, "MAGIC", (long)GPUISO_MAGIC) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) < 0 ||
        PyModule_AddIntConstant(m, "WHOLE", (long)WHOLE) < 0 ||
        PyModule_AddIntConstant(m, "LABEL_LEN", LABEL_LEN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
