"""Signals that come before training has started: held, not fatal, and honoured at the first step.

`tfdist train` holds SIGUSR1 from its first line (before TensorFlow is imported and the strategy
started, which takes seconds): by default that signal would end the process. An elastic launch
sends it to stop a group at a step boundary (tfdist/launch/elastic.py); `tfdist.runtime.preemption.
Preemption` takes over when training starts and acts on a signal held before it. After training,
the signal is held again, so a process that has finished its run still exits 0.

    >>> import os, signal
    >>> from tfdist.runtime import early
    >>> early.hold(["USR1"])
    >>> os.kill(os.getpid(), signal.SIGUSR1)
    >>> early.take()
    [10]
    >>> early.take()
    []
"""
import signal

_held = []


def _record(number, frame):
    _held.append(number)


def hold(names):
    """From now on, the signals `names` ("USR1", ...) are recorded instead of handled."""
    for name in names:
        signal.signal(getattr(signal, "SIG" + name), _record)


def take():
    """The signal numbers held so far (then forgotten)."""
    taken = list(_held)
    _held.clear()
    return taken
