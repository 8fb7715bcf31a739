/*
 * gpuiso_fork.c — fork a process that becomes its parent's sibling (CLONE_PARENT).
 *
 * The fork server forks each test's process, but the test's process must be the
 * pytest process's own child: pytest reaps it for its exit status, it dies with
 * pytest (PR_SET_PDEATHSIG), and pytest's process sweep finds what it leaves
 * behind. Without help that takes two forks: the server forks an intermediate,
 * which forks the test's process and exits, so the orphan is re-parented to
 * pytest (a child subreaper). Each fork of a process that imported torch copies
 * its page tables and each exit tears them down again: milliseconds per test.
 *
 * clone(CLONE_PARENT) makes the new process a child of the caller's parent
 * directly: one fork, no intermediate, no waiting for the re-parenting.
 *
 * Python's os.fork() is glibc's fork() between PyOS_BeforeFork() and
 * PyOS_AfterFork_*(). Here the raw clone3 system call replaces glibc's fork(), so
 * what glibc's fork does for a single-threaded process is done by hand:
 *   - the child's thread id is written where glibc keeps it (CLONE_CHILD_SETTID at
 *     the address the kernel was given by set_tid_address, read back with
 *     PR_GET_TID_ADDRESS), so raise(), pthread_kill() and mutex owners see the
 *     child's own id; CLONE_CHILD_CLEARTID as glibc asks for it;
 *   - the robust-mutex list, which the kernel does not carry into a child, is
 *     emptied and registered again.
 * pthread_atfork() handlers are not run. The caller forks only when it has a
 * single thread (checked before every fork), so no handler has a lock to release;
 * the one `import torch` registers (the autograd engine's, which asks a child to
 * rebuild the engine) has nothing to rebuild while autograd never ran, and with a
 * CUDA build running it loads libcuda, which makes the caller refuse to fork. Any
 * failure raises OSError; the caller then falls back to the two forks.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>
#include <errno.h>
#include <linux/sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef PR_GET_TID_ADDRESS
#define PR_GET_TID_ADDRESS 40
#endif

/* The kernel's struct robust_list_head (linux/futex.h), as glibc lays it out. */
struct robust_head {
    void *next;
    long futex_offset;
    void *list_op_pending;
};

static PyObject *fork_sibling(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
#if defined(SYS_clone3) && defined(CLONE_ARGS_SIZE_VER0) /* kernel headers 5.3+ */
    int *tid_address = NULL;
    if (prctl(PR_GET_TID_ADDRESS, &tid_address, 0, 0, 0) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (tid_address == NULL) {
        errno = ENOTSUP;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    struct robust_head *head = NULL;
    size_t len = 0;
    if (syscall(SYS_get_robust_list, 0, &head, &len) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (PySys_Audit("os.fork", NULL) < 0)
        return NULL;

    struct clone_args args;
    memset(&args, 0, sizeof args);
    args.flags = CLONE_PARENT | CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID;
    args.child_tid = (uint64_t)(uintptr_t)tid_address;
    args.exit_signal = 0; /* must be 0 with CLONE_PARENT: the child gets the caller's */

    PyOS_BeforeFork();
    long pid = syscall(SYS_clone3, &args, sizeof args);
    int saved = errno;
    if (pid == 0) {
        if (head != NULL) {
            head->next = head; /* empty: the parent's held robust mutexes are not ours */
            syscall(SYS_set_robust_list, head, len);
        }
        PyOS_AfterFork_Child();
        return PyLong_FromLong(0);
    }
    PyOS_AfterFork_Parent();
    if (pid < 0) {
        errno = saved;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(pid);
#else
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

static PyMethodDef methods[] = {
    {"fork_sibling", fork_sibling, METH_NOARGS,
     "fork_sibling() -> pid\n\nLike os.fork(), but the child is a child of this process's "
     "parent.\nOnly for a single-threaded caller. 0 in the child; OSError if unsupported."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pytest_gpuiso._fork",
    .m_doc = "fork_sibling(): one fork whose child is its parent's sibling (CLONE_PARENT).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fork(void)
{
    return PyModule_Create(&module);
}
