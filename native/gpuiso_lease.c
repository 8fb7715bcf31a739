/*
 * pytest_gpuiso._lease: GPU leases shared by every pytest process of a user.
 *
 * One memory-mapped region per user (a 0600 file in /dev/shm) holds a table of
 * devices x slots. Each taken slot records its owner as (pid, start time read
 * from /proc), so a reused pid never passes for a live owner. Everything in the
 * table is guarded by one robust, process-shared mutex: if a process dies
 * inside the (short) critical section, the next locker gets EOWNERDEAD, marks
 * the mutex consistent and carries on, because every entry is validated by its
 * owner's liveness anyway.
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
 * The region is created in a private temporary file and published with link(),
 * which fails if another process published first: a region is either absent or
 * complete, and a process killed while initialising leaves only its temp file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
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
#define GPUISO_ABI 1
#define MAX_DEVICES 64
#define MAX_SLOTS 16
#define MAX_WAITERS 256
#define LABEL_LEN 192
#define NAME_LEN 64

typedef struct {
    int32_t pid; /* 0: free */
    uint32_t pad;
    uint64_t start; /* /proc/<pid>/stat field 22: clock ticks since boot */
} owner_t;

typedef struct {
    owner_t owner;
    uint64_t lease;
    int64_t since_ns; /* CLOCK_REALTIME, for display only */
    char label[LABEL_LEN];
} slot_t;

typedef struct {
    char name[NAME_LEN]; /* "" : unused row */
    uint32_t slots;
    uint32_t pad;
    slot_t slot[MAX_SLOTS];
} device_t;

typedef struct {
    owner_t owner;
    uint64_t ticket;
    uint64_t mask; /* rows it wants */
    uint32_t n;
    uint32_t pad;
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
    uint32_t generation; /* bumped by clear(): waiters re-resolve their rows */
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

static int owner_alive(const owner_t *o)
{
    uint64_t start;
    char state;
    if (o->pid <= 0)
        return 0;
    if (proc_start(o->pid, &start, &state) != 0) {
        /* Only "no such process" proves death. When /proc cannot be read (out of file
         * descriptors, say), the pid's existence decides, so a live holder is never robbed. */
        if (errno == ENOENT || errno == ESRCH)
            return 0;
        return kill(o->pid, 0) == 0 || errno == EPERM;
    }
    return start == o->start && state != 'Z' && state != 'X';
}

static owner_t self_owner(void)
{
    static pid_t cached_pid;
    static uint64_t cached_start;
    pid_t pid = getpid();
    if (pid != cached_pid) { /* recomputed after fork */
        uint64_t start = 0;
        proc_start(pid, &start, NULL);
        cached_pid = pid;
        cached_start = start;
    }
    owner_t me = {.pid = pid, .start = cached_start};
    return me;
}

static int same_owner(const owner_t *a, const owner_t *b)
{
    return a->pid == b->pid && a->start == b->start;
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

/* ------------------------------------------------------------------ the region */

typedef struct {
    PyObject_HEAD
    region_t *r;
    int fd;
    int inotify;
    char *path;
} RegionObject;

static void ring(RegionObject *self)
{
    /* Must go through write(2), not the mapping: only a write makes inotify report. */
    uint64_t bell = self->r->bell + 1;
    if (pwrite(self->fd, &bell, sizeof bell, offsetof(region_t, bell)) != sizeof bell)
        self->r->bell = bell;
}

static int lock_region(region_t *r)
{
    int rc = pthread_mutex_lock(&r->lock);
    if (rc == EOWNERDEAD) {
        /* Died inside the critical section: entries are validated by liveness. */
        pthread_mutex_consistent(&r->lock);
        rc = 0;
    }
    return rc;
}

static void unlock_region(region_t *r) { pthread_mutex_unlock(&r->lock); }

/* Clear entries whose owner is gone. Returns how many. Called under the lock. */
static int reap_dead(region_t *r)
{
    int freed = 0;
    for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++) {
        device_t *dev = &r->dev[d];
        for (uint32_t s = 0; s < dev->slots && s < MAX_SLOTS; s++) {
            slot_t *slot = &dev->slot[s];
            if (slot->owner.pid != 0 && !owner_alive(&slot->owner)) {
                memset(slot, 0, sizeof *slot);
                freed++;
            }
        }
    }
    for (int w = 0; w < MAX_WAITERS; w++) {
        waiter_t *wt = &r->waiter[w];
        if (wt->owner.pid != 0 && !owner_alive(&wt->owner)) {
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

/* Create the region in a temp file and publish it with link(); 0, or -1 with errno. */
static int publish_region(const char *path)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.%d.init", path, (int)getpid());
    unlink(tmp);
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    int ok = ftruncate(fd, sizeof(region_t)) == 0;
    region_t *r = ok ? mmap(NULL, sizeof(region_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                     : MAP_FAILED;
    ok = r != MAP_FAILED && init_region(r) == 0;
    if (r != MAP_FAILED)
        munmap(r, sizeof(region_t));
    close(fd);
    int saved = errno;
    if (ok && link(tmp, path) != 0 && errno != EEXIST)
        ok = 0, saved = errno; /* EEXIST: another process published first; use theirs */
    unlink(tmp);
    errno = saved;
    return ok ? 0 : -1;
}

static int Region_init(RegionObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", NULL};
    const char *path;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s", kwlist, &path))
        return -1;
    self->fd = -1;
    self->inotify = -1;
    self->path = strdup(path);
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 && errno == ENOENT) {
        if (publish_region(path) != 0) {
            PyErr_Format(RegionError, "cannot create the lease region %s: %s", path, strerror(errno));
            return -1;
        }
        fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    }
    if (fd < 0) {
        PyErr_Format(RegionError, "cannot open the lease region %s: %s", path, strerror(errno));
        return -1;
    }
    self->fd = fd;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        (st.st_mode & 077) != 0) {
        PyErr_Format(RegionError,
                     "lease region %s is not a private file of uid %d (mode 0600); "
                     "remove it",
                     path, (int)geteuid());
        return -1;
    }
    if ((size_t)st.st_size != sizeof(region_t)) {
        PyErr_Format(RegionError,
                     "lease region %s has %lld bytes, this pytest-gpuiso expects %zu "
                     "(another version?); reset it with `python -m pytest_gpuiso reset --force`",
                     path, (long long)st.st_size, sizeof(region_t));
        return -1;
    }
    region_t *r = mmap(NULL, sizeof(region_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        PyErr_Format(RegionError, "cannot map the lease region %s: %s", path, strerror(errno));
        return -1;
    }
    self->r = r;
    if (__atomic_load_n(&r->magic, __ATOMIC_ACQUIRE) != GPUISO_MAGIC ||
        r->size != sizeof(region_t)) {
        PyErr_Format(RegionError,
                     "lease region %s is corrupted (bad header); reset it with "
                     "`python -m pytest_gpuiso reset --force`",
                     path);
        return -1;
    }
    if (r->abi != GPUISO_ABI) {
        PyErr_Format(RegionError,
                     "lease region %s has ABI version %u, this pytest-gpuiso expects %d; "
                     "reset it with `python -m pytest_gpuiso reset --force`",
                     path, r->abi, GPUISO_ABI);
        return -1;
    }
    self->inotify = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (self->inotify < 0 || inotify_add_watch(self->inotify, path, IN_MODIFY) < 0) {
        PyErr_Format(RegionError, "cannot watch the lease region %s: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

static void Region_dealloc(RegionObject *self)
{
    if (self->r != NULL)
        munmap(self->r, sizeof(region_t));
    if (self->fd >= 0)
        close(self->fd);
    if (self->inotify >= 0)
        close(self->inotify);
    free(self->path);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ------------------------------------------------------------------ acquire */

static uint32_t nslots(const device_t *dev)
{
    return dev->slots < MAX_SLOTS ? dev->slots : MAX_SLOTS; /* never trust the file past it */
}

/* Find or add the rows of `names`; -1 and a message on a slot-count conflict. */
static int resolve_rows(region_t *r, char **names, int count, uint32_t slots, int *rows, char *err,
                        size_t errlen)
{
    for (int i = 0; i < count; i++) {
        int row = -1;
        for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++)
            if (strncmp(r->dev[d].name, names[i], NAME_LEN) == 0)
                row = (int)d;
        if (row < 0) {
            if (r->ndevices >= MAX_DEVICES) {
                snprintf(err, errlen, "the lease region has no room for device %s", names[i]);
                return -1;
            }
            row = (int)r->ndevices;
            memset(&r->dev[row], 0, sizeof r->dev[row]);
            snprintf(r->dev[row].name, NAME_LEN, "%s", names[i]);
            r->dev[row].slots = slots;
            r->ndevices++; /* counted only once complete: a kill before leaves no trace */
        }
        device_t *dev = &r->dev[row];
        if (dev->slots != slots) {
            for (uint32_t s = 0; s < nslots(dev); s++)
                if (dev->slot[s].owner.pid != 0 && owner_alive(&dev->slot[s].owner)) {
                    snprintf(err, errlen,
                             "device %s is shared with %u slots by pid %d (%.80s); "
                             "this session asks for %u",
                             names[i], dev->slots, dev->slot[s].owner.pid, dev->slot[s].label, slots);
                    return -1;
                }
            memset(dev->slot, 0, sizeof dev->slot);
            dev->slots = slots;
        }
        rows[i] = row;
    }
    return 0;
}

static int free_slots(const device_t *dev)
{
    int n = 0;
    for (uint32_t s = 0; s < nslots(dev); s++)
        n += dev->slot[s].owner.pid == 0;
    return n;
}

/* Take n rows among `allowed` (least loaded first), all or nothing. */
static int try_take(region_t *r, const int *rows, int count, uint64_t allowed, uint32_t n,
                    const char *label, owner_t me, uint64_t *lease, int *taken)
{
    int order[MAX_DEVICES], nfree[MAX_DEVICES], k = 0;
    for (int i = 0; i < count; i++)
        if ((allowed >> rows[i]) & 1) {
            int f = free_slots(&r->dev[rows[i]]);
            if (f > 0) {
                int j = k++;
                while (j > 0 && nfree[j - 1] < f) { /* stable sort: most free first */
                    order[j] = order[j - 1];
                    nfree[j] = nfree[j - 1];
                    j--;
                }
                order[j] = rows[i];
                nfree[j] = f;
            }
        }
    if ((uint32_t)k < n)
        return 0;
    *lease = r->next_lease++;
    int64_t now = realtime_ns();
    for (uint32_t i = 0; i < n; i++) {
        device_t *dev = &r->dev[order[i]];
        for (uint32_t s = 0; s < nslots(dev); s++)
            if (dev->slot[s].owner.pid == 0) {
                slot_t *slot = &dev->slot[s];
                slot->lease = *lease;
                slot->since_ns = now;
                snprintf(slot->label, LABEL_LEN, "%s", label);
                slot->owner = me; /* last: a half-written entry never looks taken */
                break;
            }
        taken[i] = order[i];
    }
    return 1;
}

enum { GOT, WAIT, TIMED_OUT, INTERRUPTED, FAILED };

typedef struct {
    char names[MAX_DEVICES][NAME_LEN];
    uint32_t slots;
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
    char err[256];
} request_t;

static void leave_queue(RegionObject *self, request_t *q)
{
    if (q->waiter >= 0) {
        waiter_t *w = &self->r->waiter[q->waiter];
        owner_t me = self_owner();
        if (w->ticket == q->ticket && same_owner(&w->owner, &me))
            memset(w, 0, sizeof *w);
        q->waiter = -1;
    }
}

/* One attempt, GIL released: take the lease, or block until something changes. */
static int attempt(RegionObject *self, request_t *q, const char *label, double deadline)
{
    region_t *r = self->r;
    owner_t me = self_owner();
    int pidfds[MAX_DEVICES * MAX_SLOTS + MAX_WAITERS + 1];
    owner_t watched[MAX_DEVICES * MAX_SLOTS + MAX_WAITERS + 1];
    int npid = 0, changed = 0, blind = 0; /* blind: a process we cannot watch */

    if (lock_region(r) != 0) {
        snprintf(q->err, sizeof q->err, "the lease region lock is unrecoverable; reset it");
        return FAILED;
    }
    if (q->generation != r->generation) { /* the table was cleared: rows and queue are gone */
        char *names[MAX_DEVICES];
        for (int i = 0; i < q->count; i++)
            names[i] = q->names[i];
        if (resolve_rows(r, names, q->count, q->slots, q->rows, q->err, sizeof q->err) != 0) {
            unlock_region(r);
            return FAILED;
        }
        q->mask = 0;
        for (int i = 0; i < q->count; i++)
            q->mask |= 1ULL << q->rows[i];
        q->waiter = -1;
        q->generation = r->generation;
    }
    if (q->suspect) { /* a full liveness scan reads /proc for every owner: only when needed */
        if (reap_dead(r) > 0)
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
            return FAILED;
        }
        waiter_t *w = &r->waiter[q->waiter];
        q->ticket = r->next_ticket++;
        w->ticket = q->ticket;
        w->mask = q->mask;
        w->n = q->n;
        w->since_ns = realtime_ns();
        snprintf(w->label, LABEL_LEN, "%s", label);
        w->owner = me;
    }
    /* Devices wanted by earlier waiters are theirs first. */
    uint64_t blocked = 0;
    for (int w = 0; w < MAX_WAITERS; w++) {
        waiter_t *wt = &r->waiter[w];
        if (wt->owner.pid != 0 && wt->ticket < q->ticket && (wt->mask & q->mask)) {
            blocked |= wt->mask;
            int fd = (int)syscall(SYS_pidfd_open, wt->owner.pid, 0);
            if (fd >= 0)
                watched[npid] = wt->owner, pidfds[npid++] = fd;
            else if (errno == ESRCH)
                changed = 1; /* gone already */
            else
                blind = 1;
        }
    }
    if (try_take(r, q->rows, q->count, q->mask & ~blocked, q->n, label, me, &q->lease, q->taken)) {
        leave_queue(self, q);
        ring(self); /* the next waiter is now first in line */
        unlock_region(r);
        for (int i = 0; i < npid; i++)
            close(pidfds[i]);
        return GOT;
    }
    for (int i = 0; i < q->count; i++) {
        device_t *dev = &r->dev[q->rows[i]];
        for (uint32_t s = 0; s < nslots(dev); s++)
            if (dev->slot[s].owner.pid != 0) {
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
        if (!owner_alive(&watched[i]))
            changed = 1;
    if (changed)
        q->suspect = 1;
    unlock_region(r);

    int rc = WAIT;
    if (changed && deadline >= 0 && monotonic_s() >= deadline)
        rc = TIMED_OUT;
    else if (!changed) {
        struct pollfd fds[MAX_DEVICES * MAX_SLOTS + MAX_WAITERS + 1];
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
    return rc;
}

static PyObject *Region_acquire(RegionObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"devices", "slots", "n", "label", "timeout", NULL};
    PyObject *devices;
    unsigned int slots, n;
    const char *label;
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OIIs|O", kwlist, &devices, &slots, &n, &label,
                                     &timeout_obj))
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
    q.slots = slots;
    for (int i = 0; i < q.count; i++)
        snprintf(q.names[i], NAME_LEN, "%s", names[i]);
    q.n = n;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = lock_region(self->r);
    if (rc == 0) {
        rc = resolve_rows(self->r, names, q.count, slots, q.rows, q.err, sizeof q.err);
        q.generation = self->r->generation;
        unlock_region(self->r);
    } else {
        snprintf(q.err, sizeof q.err, "the lease region lock is unrecoverable; reset it");
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(seq);
    if (rc != 0)
        return PyErr_Format(RegionError, "%s", q.err);
    for (int i = 0; i < q.count; i++)
        q.mask |= 1ULL << q.rows[i];

    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        rc = attempt(self, &q, label, deadline);
        Py_END_ALLOW_THREADS
        if (rc == GOT)
            break;
        if (PyErr_CheckSignals() < 0)
            rc = FAILED; /* the exception (KeyboardInterrupt) is already set */
        if (rc == TIMED_OUT || rc == FAILED) {
            Py_BEGIN_ALLOW_THREADS
            if (lock_region(self->r) == 0) {
                leave_queue(self, &q);
                ring(self);
                unlock_region(self->r);
            }
            Py_END_ALLOW_THREADS
            if (rc == TIMED_OUT)
                Py_RETURN_NONE;
            if (!PyErr_Occurred())
                PyErr_Format(RegionError, "%s", q.err);
            return NULL;
        }
    }
    PyObject *names_out = PyList_New(n);
    if (names_out == NULL)
        return NULL;
    for (unsigned int i = 0; i < n; i++)
        PyList_SET_ITEM(names_out, i, PyUnicode_FromString(self->r->dev[q.taken[i]].name));
    return Py_BuildValue("(KN)", (unsigned long long)q.lease, names_out);
}

static PyObject *Region_release(RegionObject *self, PyObject *args)
{
    unsigned long long lease;
    if (!PyArg_ParseTuple(args, "K", &lease))
        return NULL;
    int freed = 0, rc;
    owner_t me = self_owner();
    Py_BEGIN_ALLOW_THREADS
    rc = lock_region(self->r);
    if (rc == 0) {
        region_t *r = self->r;
        for (uint32_t d = 0; d < r->ndevices && d < MAX_DEVICES; d++)
            for (uint32_t s = 0; s < r->dev[d].slots && s < MAX_SLOTS; s++) {
                slot_t *slot = &r->dev[d].slot[s];
                if (slot->lease == lease && same_owner(&slot->owner, &me)) {
                    memset(slot, 0, sizeof *slot);
                    freed++;
                }
            }
        ring(self);
        unlock_region(r);
    }
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_Format(RegionError, "the lease region lock is unrecoverable; reset it");
    return PyLong_FromLong(freed);
}

/* ------------------------------------------------------------------ inspection */

static PyObject *Region_snapshot(RegionObject *self, PyObject *Py_UNUSED(ignored))
{
    region_t *copy = malloc(sizeof(region_t));
    if (copy == NULL)
        return PyErr_NoMemory();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = lock_region(self->r);
    if (rc == 0) {
        memcpy(copy, self->r, sizeof(region_t));
        unlock_region(self->r);
    }
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        free(copy);
        return PyErr_Format(RegionError, "the lease region lock is unrecoverable; reset it");
    }
    PyObject *devices = PyList_New(0), *holders = PyList_New(0), *waiters = PyList_New(0);
    for (uint32_t d = 0; devices && holders && d < copy->ndevices && d < MAX_DEVICES; d++) {
        device_t *dev = &copy->dev[d];
        PyObject *item = Py_BuildValue("(sI)", dev->name, dev->slots);
        if (item == NULL || PyList_Append(devices, item) < 0)
            goto fail_item;
        Py_DECREF(item);
        for (uint32_t s = 0; s < dev->slots && s < MAX_SLOTS; s++) {
            slot_t *slot = &dev->slot[s];
            if (slot->owner.pid == 0)
                continue;
            item = Py_BuildValue("{s:s,s:I,s:i,s:K,s:K,s:L,s:s,s:O}", "device", dev->name, "slot", s,
                                 "pid", slot->owner.pid, "start", slot->owner.start, "lease",
                                 slot->lease, "since_ns", slot->since_ns, "label", slot->label,
                                 "alive", owner_alive(&slot->owner) ? Py_True : Py_False);
            if (item == NULL || PyList_Append(holders, item) < 0)
                goto fail_item;
            Py_DECREF(item);
        }
        continue;
    fail_item:
        Py_XDECREF(item);
        Py_CLEAR(devices);
    }
    for (int w = 0; devices && w < MAX_WAITERS; w++) {
        waiter_t *wt = &copy->waiter[w];
        if (wt->owner.pid == 0)
            continue;
        PyObject *item = Py_BuildValue(
            "{s:i,s:K,s:I,s:K,s:L,s:s,s:O}", "pid", wt->owner.pid, "ticket", wt->ticket, "n", wt->n,
            "mask", wt->mask, "since_ns", wt->since_ns, "label", wt->label, "alive",
            owner_alive(&wt->owner) ? Py_True : Py_False);
        if (item == NULL || PyList_Append(waiters, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(devices);
            break;
        }
        Py_DECREF(item);
    }
    free(copy);
    if (devices == NULL || holders == NULL || waiters == NULL) {
        Py_XDECREF(devices);
        Py_XDECREF(holders);
        Py_XDECREF(waiters);
        return NULL;
    }
    return Py_BuildValue("{s:N,s:N,s:N}", "devices", devices, "holders", holders, "waiters",
                         waiters);
}

static PyObject *Region_clear(RegionObject *self, PyObject *Py_UNUSED(ignored))
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = lock_region(self->r);
    if (rc == 0) {
        region_t *r = self->r;
        memset(r->dev, 0, sizeof r->dev);
        memset(r->waiter, 0, sizeof r->waiter);
        r->ndevices = 0;
        r->generation++;
        ring(self);
        unlock_region(r);
    }
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_Format(RegionError, "the lease region lock is unrecoverable; reset it");
    Py_RETURN_NONE;
}

static PyObject *Region_get_path(RegionObject *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->path ? self->path : "");
}

static PyMethodDef Region_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))Region_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(devices, slots, n, label, timeout=None) -> (lease_id, [device names]) or None "
     "on timeout. Blocks (GIL released) until n of the devices have a free slot."},
    {"release", (PyCFunction)Region_release, METH_VARARGS,
     "release(lease_id) -> number of slots freed"},
    {"snapshot", (PyCFunction)Region_snapshot, METH_NOARGS,
     "snapshot() -> {'devices': [(name, slots)], 'holders': [...], 'waiters': [...]}"},
    {"clear", (PyCFunction)Region_clear, METH_NOARGS, "clear() -> forget every holder and waiter"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Region_getset[] = {
    {"path", (getter)Region_get_path, NULL, "the region file", NULL},
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
    Py_INCREF(&RegionType);
    if (PyModule_AddObject(m, "Region", (PyObject *)&RegionType) < 0 ||
        PyModule_AddObject(m, "RegionError", RegionError) < 0 ||
        PyModule_AddIntConstant(m, "ABI_VERSION", GPUISO_ABI) < 0 ||
        PyModule_AddIntConstant(m, "REGION_SIZE", (long)sizeof(region_t)) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DEVICES", MAX_DEVICES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
