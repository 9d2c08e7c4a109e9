"""What the bench harnesses that start processes share (chaos.py, ha.py):
their error type, a monotonic clock, and child processes that die with
the harness, even when it is killed by SIGKILL."""

import signal
import subprocess
import time

try:
    import ctypes
    LIBC = ctypes.CDLL(None)
except (ImportError, OSError):
    LIBC = None


class HarnessError(Exception):
    pass


class StreamEnded(Exception):
    pass


def now():
    return time.monotonic()


def die_with_parent():
    """In the child: SIGKILL when the harness dies, even by SIGKILL."""
    if LIBC is not None:
        try:
            LIBC.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except AttributeError:
            pass


# Every child started, for kill_children.
CHILDREN = []


def reap(proc):
    """Kills `proc` if it runs and waits for it (at most 5 s)."""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            proc.kill()
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def kill_children():
    while CHILDREN:
        reap(CHILDREN.pop())
