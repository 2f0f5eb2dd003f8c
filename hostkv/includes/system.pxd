# The C library declarations hostkv needs beyond Cython's bundled libc/posix ones:
# process-shared robust mutexes, the memory map, and hostkv's own inline C (compat.h:
# ordering, CPU pause, the mutex's deadline lock and kind word, madvise values).

from libc.stdint cimport int64_t, uint32_t, uint64_t
from posix.types cimport off_t, pid_t


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_mutexattr_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    ctypedef unsigned long pthread_t

    enum:
        PTHREAD_PROCESS_SHARED
        PTHREAD_MUTEX_ROBUST
        PTHREAD_MUTEX_NORMAL
        PTHREAD_PRIO_NONE

    int pthread_mutexattr_init(pthread_mutexattr_t*)
    int pthread_mutexattr_destroy(pthread_mutexattr_t*)
    int pthread_mutexattr_setpshared(pthread_mutexattr_t*, int)
    int pthread_mutexattr_setrobust(pthread_mutexattr_t*, int)
    int pthread_mutexattr_settype(pthread_mutexattr_t*, int)
    int pthread_mutexattr_setprotocol(pthread_mutexattr_t*, int)
    int pthread_mutex_init(pthread_mutex_t*, const pthread_mutexattr_t*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_trylock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)
    int pthread_mutex_consistent(pthread_mutex_t*)

    int pthread_cond_init(pthread_cond_t*, const pthread_condattr_t*)
    int pthread_cond_destroy(pthread_cond_t*)
    int pthread_cond_wait(pthread_cond_t*, pthread_mutex_t*)
    int pthread_cond_broadcast(pthread_cond_t*)

    int pthread_create(pthread_t*, const void*, void* (*)(void*) noexcept nogil, void*)
    int pthread_join(pthread_t, void**)
    int pthread_detach(pthread_t)
    pthread_t pthread_self()
    int pthread_equal(pthread_t, pthread_t)


cdef extern from "<time.h>" nogil:
    cdef struct timespec:
        long tv_sec
        long tv_nsec
    enum:
        CLOCK_REALTIME
        CLOCK_MONOTONIC
    int clock_gettime(int, timespec*)
    int pthread_mutex_timedlock(pthread_mutex_t*, const timespec*)


cdef extern from "<sys/mman.h>" nogil:
    enum:
        PROT_READ
        PROT_WRITE
        MAP_SHARED
    void* MAP_FAILED
    void* mmap(void*, size_t, int, int, int, off_t)
    int munmap(void*, size_t)
    int madvise(void*, size_t, int)


cdef extern from "<sys/stat.h>" nogil:
    cdef struct stat:
        off_t st_size
        unsigned int st_uid
        unsigned int st_mode
    int fstat(int, stat*)


cdef extern from "<fcntl.h>" nogil:
    int posix_fallocate(int, off_t, off_t)


cdef extern from "<unistd.h>" nogil:
    enum:
        _SC_PAGESIZE
    long sysconf(int)
    void _exit(int)
    pid_t getpid()
    unsigned int getuid()


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef extern from "<errno.h>" nogil:
    enum:
        EOWNERDEAD
        ENOTRECOVERABLE
        ETIMEDOUT
        EBUSY
        EINTR
        EINVAL
        ENOSPC


cdef extern from "includes/compat.h" nogil:
    # hostkv's own inline C (the path is relative to the .c file Cython writes in hostkv/).
    int MADV_WILLNEED
    int MADV_HUGEPAGE
    int MADV_POPULATE_READ
    int MADV_POPULATE_WRITE
    int HKV_MUTEX_KIND_OFFSET

    void hkv_compiler_barrier() noexcept
    void __atomic_store_release_u32(uint32_t* p, uint32_t v) noexcept
    uint32_t __atomic_load_acquire_u32(uint32_t* p) noexcept
    void hkv_store_release_i64(int64_t* p, int64_t v) noexcept
    int hkv_creator_mark(int fd) noexcept
    int hkv_creator_unmark(int fd) noexcept
    int hkv_creator_marked(int fd) noexcept
    int64_t now_ns "hkv_now_ns"(int clock) noexcept
    int count_leading_zeros(uint64_t x) noexcept
    void cpu_relax() noexcept
    int hkv_mutex_lock_until(pthread_mutex_t* m, const timespec* deadline) noexcept
    int hkv_mutex_kind(pthread_mutex_t* m) noexcept
    int hkv_mutex_has_sleepers(pthread_mutex_t* m) noexcept
    int hkv_mutex_is_held(pthread_mutex_t* m) noexcept
