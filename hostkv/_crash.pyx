# cython: language_level=3, embedsignature=True
"""Crash points (tests only): what an armed Segment does at its armed step, and the arming of
new handles.

The crash tests kill a process at every step of create, attach and recovery too, which run
before a caller holds the handle to arm it: _arm_new_segments arms every handle made after
it. Arming them through an environment variable, which any process would honour, would let
a stray variable make a production process _exit: only a call in the process itself arms
them, and a process that never calls this never crashes on purpose.
"""

from libc.stdint cimport int64_t

from hostkv.includes.system cimport _exit

# "exit" dies with CRASH_EXIT_STATUS; the other two raise in a live process.
_MODES = {"exit": CRASH_EXIT, "keyboard_interrupt": CRASH_RAISE_KEYBOARD_INTERRUPT,
          "memory_error": CRASH_RAISE_MEMORY_ERROR}

_arm_new_segments_at = None


cdef int crash_mode(str mode) except -1:
    """The CrashMode of a mode name, or ValueError."""
    if mode not in _MODES:
        raise ValueError(f"crash mode must be one of {sorted(_MODES)}, got {mode!r}")
    return _MODES[mode]


cdef int crash_now(int mode) except -1:
    """Dies (CRASH_EXIT) or raises the mode's exception."""
    if mode == CRASH_EXIT:
        _exit(CRASH_EXIT_STATUS)
    if mode == CRASH_RAISE_KEYBOARD_INTERRUPT:
        raise KeyboardInterrupt("injected at a crash point")
    raise MemoryError("injected at a crash point")


cdef bint armed_for_new_segments(int64_t* step, int* mode) except -1:
    """Whether _arm_new_segments armed new handles; if so, at which step and how."""
    if _arm_new_segments_at is None:
        return False
    step[0] = _arm_new_segments_at[0]
    mode[0] = _MODES[_arm_new_segments_at[1]]
    return True


def _arm_new_segments(long step, str mode="exit"):
    """Test hook: every Segment made from now on in this process is armed as by
    Segment._arm_crash_point(step, mode), counted from its first logged store. step 0
    disarms."""
    global _arm_new_segments_at
    if mode not in ("exit", "keyboard_interrupt", "memory_error"):
        raise ValueError(f"crash mode must be exit, keyboard_interrupt or memory_error, got {mode!r}")
    if step < 0:
        raise ValueError(f"crash step must be >= 0, got {step}")
    _arm_new_segments_at = (step, mode) if step else None
