/* hostkv's own inline C: what C itself does not say, and where libcs, kernels, compilers,
   CPUs and CPython versions differ. Declared for Cython in system.pxd and python.pxd; every
   function here is static inline, so a module that does not use one pays nothing for it.
   Cython includes Python.h (and with it the feature macros, _GNU_SOURCE) first. */

#ifndef HOSTKV_COMPAT_H
#define HOSTKV_COMPAT_H

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

/* -- madvise(2) advice ------------------------------------------------------------------------
   Values from linux/mman.h, for C libraries older than the kernels that know them; a kernel
   that does not answers EINVAL. */
#ifndef MADV_WILLNEED
#define MADV_WILLNEED 3
#endif
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14         /* Linux 2.6.38, with CONFIG_TRANSPARENT_HUGEPAGE */
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22    /* Linux 5.14 */
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23   /* Linux 5.14 */
#endif

/* -- ordering ---------------------------------------------------------------------------------- */

/* Keeps the compiler from moving stores across it. A process may be killed between any two
   instructions, so the undo record must be in memory before the store it protects. */
static inline void hkv_compiler_barrier(void) { __asm__ __volatile__("" ::: "memory"); }

/* The header's state word and the creator's progress are read by processes that hold no
   lock: published with release stores, read with acquire loads. */
static inline void __atomic_store_release_u32(uint32_t* p, uint32_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
static inline uint32_t __atomic_load_acquire_u32(uint32_t* p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void hkv_store_release_i64(int64_t* p, int64_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

/* -- the creator's mark ------------------------------------------------------------------------
   A creator holds a write lock on the segment file's first byte, an open-file-description
   lock (fcntl F_OFD_SETLK, Linux 3.15), from before its name appears until the segment is
   READY. The kernel drops it when the creator's file description closes, at its death
   included, in whatever PID namespace: an attacher that finds a segment INITIALISING and
   no mark on it knows its creator is gone, without trusting a pid (F_OFD_GETLK reports
   none). OFD locks are independent of flock(2), the lock attachers hold to say "in use".
   Each returns 0 or an errno. */
static inline int hkv_creator_lock(int fd, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = 0;
    fl.l_len = 1;
    return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : errno;
}
static inline int hkv_creator_mark(int fd) { return hkv_creator_lock(fd, F_WRLCK); }
static inline int hkv_creator_unmark(int fd) { return hkv_creator_lock(fd, F_UNLCK); }
/* Whether another file description holds the creator's mark: 1 or 0, or -errno. */
static inline int hkv_creator_marked(int fd) {
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = 0;
    fl.l_len = 1;
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return -errno;
    return fl.l_type != F_UNLCK;
}

/* -- time ------------------------------------------------------------------------------------- */

/* A clock's reading in ns. CLOCK_MONOTONIC readings are compared only within one process:
   they differ between time namespaces. */
static inline int64_t hkv_now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* -- the CPU ----------------------------------------------------------------------------------- */

static inline int count_leading_zeros(uint64_t x) { return __builtin_clzll(x); }

/* One spin of a busy wait: tells the core (and its hyperthread sibling) that this is one. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* -- the robust mutex -------------------------------------------------------------------------- */

/* Locks m, waiting until the CLOCK_MONOTONIC deadline at most. glibc 2.30+ has
   pthread_mutex_clocklock; before it, the remaining time is turned into a CLOCK_REALTIME
   deadline (a wall-clock jump during the wait then still moves it). */
static inline int hkv_mutex_lock_until(pthread_mutex_t* m, const struct timespec* deadline) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
    return pthread_mutex_clocklock(m, CLOCK_MONOTONIC, deadline);
#else
    struct timespec now, real;
    long long left;
    clock_gettime(CLOCK_MONOTONIC, &now);
    left = (long long)(deadline->tv_sec - now.tv_sec) * 1000000000LL
           + (deadline->tv_nsec - now.tv_nsec);
    if (left < 0) left = 0;
    clock_gettime(CLOCK_REALTIME, &real);
    left += real.tv_nsec;
    real.tv_sec += left / 1000000000LL;
    real.tv_nsec = left % 1000000000LL;
    return pthread_mutex_timedlock(m, &real);
#endif
}

/* The mutex's kind word: its type, robust, priority-protocol and process-shared bits. glibc
   keeps it in __data.__kind and believes it at every lock: another kind read from a segment
   someone else wrote (PRIO_PROTECT, 0x40, aborts glibc; 0-3 or 0x20/0x30 make a lock that is
   not robust or uses priority inheritance) is refused instead. */
#ifdef __GLIBC__
static inline int hkv_mutex_kind(pthread_mutex_t* m) {
    return __atomic_load_n(&m->__data.__kind, __ATOMIC_RELAXED);
}
#define HKV_MUTEX_KIND_OFFSET ((int)offsetof(pthread_mutex_t, __data.__kind))

/* glibc's lock word of a robust mutex is the owner's TID (FUTEX_TID_MASK), with
   FUTEX_WAITERS set once a waiter sleeps in the kernel: the futex protocol the kernel's
   robust-list handling shares with it (futex(2)), so these bits are fixed by the ABI. */
static inline int hkv_mutex_has_sleepers(pthread_mutex_t* m) {
    return (__atomic_load_n(&m->__data.__lock, __ATOMIC_RELAXED) & 0x80000000u) != 0;
}
static inline int hkv_mutex_is_held(pthread_mutex_t* m) {
    return (__atomic_load_n(&m->__data.__lock, __ATOMIC_ACQUIRE) & 0x3fffffffu) != 0;
}
#else
static inline int hkv_mutex_kind(pthread_mutex_t* m) { (void)m; return -1; }
#define HKV_MUTEX_KIND_OFFSET (-1)
/* Unknown lock word: no waiter is ever seen, so no hand-off is waited for. */
static inline int hkv_mutex_has_sleepers(pthread_mutex_t* m) { (void)m; return 0; }
static inline int hkv_mutex_is_held(pthread_mutex_t* m) { (void)m; return 1; }
#endif

/* -- CPython ---------------------------------------------------------------------------------- */

#if PY_VERSION_HEX < 0x030B0000
#include "longintrepr.h"
#endif

/* An exact int's value when it lies in [0, 2**31), else -1. Reads a small int's digits
   directly, as Cython's own conversions do: a token costs a load, not a call. */
static inline long long hkv_token_value(PyObject* obj) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject*)obj)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject*)obj);
        return (v >= 0 && v < 2147483648LL) ? (long long)v : -1;
    }
    return -1;
#else
    /* ob_size is the digit count, negative for negative ints. */
    Py_ssize_t size = Py_SIZE(obj), i;
    const digit* d = ((PyLongObject*)obj)->ob_digit;
    long long v = 0;
    if (__builtin_expect(size == 1, 1)) return (long long)d[0];      /* < 2**PyLong_SHIFT <= 2**30 */
    if (size < 0 || size > (31 + PyLong_SHIFT - 1) / PyLong_SHIFT) return -1;
    for (i = size - 1; i >= 0; i--) v = (v << PyLong_SHIFT) | (long long)d[i];
    return v < 2147483648LL ? v : -1;
#endif
}

#endif /* HOSTKV_COMPAT_H */
