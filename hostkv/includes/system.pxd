# The C library declarations hostkv needs beyond Cython's bundled libc/posix ones:
# process-shared robust mutexes, the memory map, and a compiler barrier.

from libc.stdint cimport int64_t, uint64_t
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


cdef extern from *:
    """
    #include <sys/mman.h>
    /* Values from linux/mman.h, for C libraries older than the kernels that know them;
       a kernel that does not answers EINVAL. */
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
    """
    int MADV_WILLNEED
    int MADV_HUGEPAGE
    int MADV_POPULATE_READ
    int MADV_POPULATE_WRITE


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


cdef extern from "<errno.h>" nogil:
    enum:
        EOWNERDEAD
        ENOTRECOVERABLE
        ETIMEDOUT
        EBUSY
        EINTR
        EINVAL
        ENOSPC


cdef extern from *:
    """
    /* Keeps the compiler from moving stores across it. A process may be killed between any
       two instructions, so the undo record must be in memory before the store it protects. */
    static inline void hkv_compiler_barrier(void) { __asm__ __volatile__("" ::: "memory"); }
    """
    void hkv_compiler_barrier() noexcept nogil
