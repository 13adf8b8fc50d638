"""This process as the system sees it: its name (what `ps` and /proc/<pid>/comm show), its death
with its parent, its threads. Linux only (`prctl`); elsewhere these do nothing.

Example:

    >>> from tfdist.runtime import process
    >>> "python" in process.thread_names()[0] or True
    True
"""
import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
_libc = []


def _prctl(option, value):
    try:
        if not _libc:
            _libc.append(ctypes.CDLL(None, use_errno=True))
        return _libc[0].prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def name_self(name):
    """Names this process `name` (at most 15 bytes are kept): /proc/<pid>/comm shows it (absl's
    `app.run` renames a process after its program, though)."""
    return _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def set_title(title):
    """Makes `title` this process's command line, as `ps` and /proc/<pid>/cmdline show it:
    written over the arguments it was started with (as setproctitle does), cut to their length.
    A warm worker is a fork, whose command line would be its agent's; tfdist's launcher titles
    each `tfdist-<task> ...` (tfdist-w1, tfdist-r0: `tfdist.launch.local.task_of` reads it).
    Returns whether it could."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5))
        data = title.encode()[:end - start - 1].ljust(end - start, b"\0")
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data)
        return True
    except (OSError, IndexError, ValueError):
        return False


def title_of(pid):
    """The first word of process `pid`'s command line ("" if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0].split(b" ", 1)[0].decode(errors="replace")
    except OSError:
        return ""


def die_with_parent(parent):
    """SIGKILL to this process when its parent (pid `parent`, the process that forked it) ends.
    Returns False if the parent has already ended (this process is an orphan then)."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    return os.getppid() == parent


def thread_names():
    """The names of this process's OS threads."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return names


def why_not_fork():
    """Why this process may not fork a child that goes on without exec (TF's runtime has
    started in it), or None: a Python thread besides the main one runs, a thread of TF's runtime
    (`tf_*`) exists, or TF's eager context is initialised. (The threads that importing numpy and
    TF starts, OpenBLAS's and jemalloc's, are fork-safe by their own `pthread_atfork` handlers.)
    `tfdist.launch.agent` checks it before every fork; `tests/test_warm.py` shows it failing once
    an op has run."""
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} Python thread(s) besides the main one run"
    tf_threads = sorted(n for n in thread_names() if n.startswith("tf_"))
    if tf_threads:
        return f"TensorFlow's runtime threads run ({', '.join(tf_threads[:3])})"
    if "tensorflow" in sys.modules:
        from tfdist import compat
        if compat.tf_runtime_started():
            return "TensorFlow's runtime has started (its eager context is initialised)"
    return None
