"""Preemption: on SIGTERM (or the signal a scheduler sends ahead of its time limit), finish the
step in progress, write a backup, and exit with status 75, which `tfdist launch` and
`launchers/slurm/tfdist.sbatch` take as "run again to resume", not as a failure.

    tfdist train --config=configs/gpt_nano.py --workdir=runs/nano &
    kill -TERM $!        # -> "preempted at step N: backup written", exit status 75
    tfdist train --config=configs/gpt_nano.py --workdir=runs/nano   # resumes at step N

Slurm, Kubernetes and preemptible VMs send SIGTERM and kill after a grace period (Kubernetes's
`terminationGracePeriodSeconds`, 30 s by default; with Slurm, `sbatch --signal=USR1@120` sends
USR1 two minutes ahead of the time limit). The signals are `backup.preemption_signals`; the
backup must be written within `backup.grace_secs` of the signal, after which the process exits
75 anyway, and the run resumes from the backup before.

Under a synchronous multi-process strategy every process must save the same step, whichever of
them got the signal (as TF's `PreemptionCheckpointHandler` does). After each step the processes
agree on whether any was signalled: one summing all-reduce of a scalar
(`strategy.any_process`), so all of them stop after the same step.

Example (a signal to this process during step 2 of 4):

    >>> import os, signal, keras, numpy as np
    >>> from tfdist.runtime.preemption import Preemption, Preempted
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> saved = []
    >>> class Signal(keras.callbacks.Callback):
    ...     def on_train_batch_begin(self, batch, logs=None):
    ...         if batch == 1:
    ...             os.kill(os.getpid(), signal.SIGUSR1)
    >>> stop = Preemption(["USR1"], save=lambda: saved.append("backup") or 2, say=lambda m: None)
    >>> with stop:
    ...     try:
    ...         model.fit(np.ones((4, 2)), np.ones((4, 1)), batch_size=1, verbose=0,
    ...                   callbacks=[Signal(), stop])
    ...     except Preempted as e:
    ...         print(e.code, e.step, saved)
    75 2 ['backup']
"""
import os
import signal
import sys
import threading

import keras

from tfdist.errors import EXIT_PREEMPTED
from tfdist.runtime import early

_ACTIVE = []  # the Preemption of each run in progress in this process

# Set by the command line (`tfdist.cli.run`, `exit_at_once`): there a stopped process ends as soon
# as its backup is written, not after Keras and TF unwind and Python finalises. A thread still in
# TensorFlow when Python finalises is ended there by pthread_exit (cpython#87135), which aborts
# the process (SIGABRT, "terminate called after throwing an instance of '' / FATAL: exception
# not rethrown"; seen in the suite with a memory snapshot in flight, which `MemorySnapshots.close`
# now waits for), and the launcher takes that for a failure. A library caller gets `Preempted`.
_EXIT_AT_ONCE = [False]


def exit_at_once(on=True):
    """A stop ends this process with status 75 right after its backup (the command line's)."""
    _EXIT_AT_ONCE[0] = on


def request_stop(why, then):
    """Asks each run in this process that is still training (from any thread) to stop as a
    preemption signal would: after the step in progress, with a backup, raising `Preempted`.
    `why` is said for the signal's name (a launcher's reason: "Ray's resize"), `then` for what
    comes next. Returns whether a run was training (a run past its last step, saving its model,
    is left alone)."""
    training = [stop for stop in list(_ACTIVE) if stop.training]
    for stop in training:
        stop.request(why, then)
    return bool(training)


def stopping():
    """Whether a run of this process is stopping for a preemption, every process of its job
    agreed (so each skips, alike, what it would do at this epoch's end before its stop)."""
    return any(stop.agreed for stop in list(_ACTIVE))


class Preempted(SystemExit):
    """Raised (exit status 75) once the backup of the interrupted step is written."""

    def __init__(self, step):
        super().__init__(EXIT_PREEMPTED)
        self.step = step


class Preemption(keras.callbacks.Callback):
    """Catches `signals` (names such as "TERM", "USR1") while active (`with`), and after the step
    in progress calls `save()` (which returns the step saved) and raises `Preempted`.

    `agree(flag) -> bool`: whether any process of the job was signalled (every process calls it
    after every step, until one was: `strategy.any_process`). On an epoch's last step the stop
    waits for the epoch's end, so its validation is logged as in an uninterrupted run. `every`:
    the steps of an update (gradient accumulation); the stop waits for the update's last, since
    backups fall on update boundaries. `grace_secs`: the bound on the time from the signal to
    the exit. `say`: where the one-line reports go (stderr)."""

    def __init__(self, signals=("TERM",), *, save, agree=None, grace_secs=30.0, say=None,
                 every=1):
        super().__init__()
        self.signals = [s.strip().upper() for s in signals if s.strip()]
        self.save = save
        self.agree = agree or (lambda flag: flag)
        self.grace_secs = grace_secs
        self.every = every
        self._agreed = False  # every process knows of a signal: the stop comes at a boundary
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.received = None  # the signal's name, once one came
        self._at_epoch_end = False
        self._previous = {}  # signal number -> the handler before ours
        self._timer = None  # bounds the time from the signal to the exit
        self._then = None  # what comes after the stop, when a launcher asked for it
        self._lock = threading.RLock()  # a signal and a launcher's request at once: one stop
        self.training = False  # between on_train_begin and on_train_end

    def __enter__(self):
        _ACTIVE.append(self)
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only (`request_stop` works)
        for name in self.signals:
            number = getattr(signal, "SIG" + name)
            self._previous[number] = signal.signal(number, self._on_signal)
        for number in early.take():  # came while the process started (tfdist.runtime.early)
            if signal.Signals(number).name[3:] in self.signals:
                self._on_signal(number, None)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if isinstance(exc, Preempted) and self._previous:
            # The backup is written and the process is on its way out (TF's teardown can take
            # seconds). A TERM now, as srun's --kill-on-bad-exit sends to the tasks still exiting
            # once one has exited 75, must not turn this task's 75 into 143 (a failure to the
            # job script): these signals end it at once with 75.
            def exit_preempted(number, frame):
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(EXIT_PREEMPTED)
            for number in {*self._previous, signal.SIGTERM}:
                signal.signal(number, exit_preempted)
        else:
            for number, handler in self._previous.items():
                signal.signal(number, handler)
        self._previous = {}
        if self._timer is not None:
            self._timer.cancel()

    def _on_signal(self, number, frame):
        self.request(signal.Signals(number).name)

    def request(self, why, then=None):
        """As a signal `why` would: the stop after the step in progress (any thread); `then`:
        what comes next, said at the stop."""
        with self._lock:
            if self.received is not None:
                return  # already stopping
            self._then = then
            self.received = why
        self.say(f"tfdist: {self.received}: finishing the step in progress and writing a backup "
                 f"(within {self.grace_secs:g} s)")
        self._timer = threading.Timer(self.grace_secs, self._out_of_time)
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self):
        self.say(f"tfdist: error: no backup written within backup.grace_secs={self.grace_secs:g} "
                 f"s of {self.received}; exiting with status {EXIT_PREEMPTED}: the run resumes "
                 f"from the backup before")
        os._exit(EXIT_PREEMPTED)

    @property
    def agreed(self):
        """Every process of the job knows of a stop: it comes at the next boundary."""
        return self._agreed

    def on_train_begin(self, logs=None):
        self.training = True

    def on_train_end(self, logs=None):
        self.training = False

    def on_train_batch_end(self, batch, logs=None):
        if self._at_epoch_end:
            return
        if not self._agreed:
            self._agreed = self.agree(self.received is not None)
        # (an epoch holds whole updates, and a resume starts at an update's first step, so the
        # batch's index in the epoch says where the update is)
        if not self._agreed or (batch + 1) % self.every:
            return
        if batch + 1 >= ((self.params or {}).get("steps") or float("inf")):
            self._at_epoch_end = True  # the epoch's last step: its validation and backup first
            return
        self._stop()

    def on_epoch_end(self, epoch, logs=None):
        if self._at_epoch_end:
            self._stop()

    def _stop(self):
        step = self.save()  # (the timer still bounds the rest: a hung teardown ends at it)
        why = self.received or "another process's signal"
        then = self._then or (f"exiting with status {EXIT_PREEMPTED} (run the same command to "
                              f"resume)")
        self.say(f"tfdist: preempted ({why}) at step {step}: backup written; {then}")
        if _EXIT_AT_ONCE[0]:
            from tfdist.runtime import cluster
            cluster.report_exit(EXIT_PREEMPTED)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PREEMPTED)
        raise Preempted(step)

    def get_config(self):
        return {"signals": self.signals, "grace_secs": self.grace_secs}
