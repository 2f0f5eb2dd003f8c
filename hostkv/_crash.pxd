# Crash points, the tests' kill-at-step-N (tests/lib/crashlib.py): an armed Segment counts every
# logged store and commit of a mutation as a step, and at the armed step dies or raises.
# Nothing here arms anything on its own: only a call in the process itself does.

from libc.stdint cimport int64_t

cdef enum CrashMode:
    CRASH_EXIT = 1                      # _exit(CRASH_EXIT_STATUS): the process dies
    CRASH_RAISE_KEYBOARD_INTERRUPT = 2  # an exception in a live process
    CRASH_RAISE_MEMORY_ERROR = 3

cdef enum:
    CRASH_EXIT_STATUS = 77


cdef int crash_mode(str mode) except -1
cdef int crash_now(int mode) except -1
cdef bint armed_for_new_segments(int64_t* step, int* mode) except -1
