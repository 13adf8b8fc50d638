"""The one exception type for bad input. The CLI prints it as one line and exits with status 2.

A user's own program (`python my_training.py`) gets the same contract: once tfdist's strategies
are imported, an uncaught `UsageError` prints `tfdist: error: <message>` and ends the process
with status 2, without a traceback (`install_excepthook`). Other exceptions are untouched.
"""
import os
import sys

#: The exit status of a preempted run (`tfdist.runtime.preemption`): sysexits.h's EX_TEMPFAIL,
#: "try again later". `tfdist launch` and launchers/slurm/tfdist.sbatch resume on it instead of
#: giving up.
EXIT_PREEMPTED = 75


#: The exit status of a process that lost its cluster (`PeerLost`): sysexits.h's EX_UNAVAILABLE.
#: A fault of the cluster, not of the input, so `tfdist launch` and launchers/slurm/tfdist.sbatch
#: restart the group from its backup (counted as a restart).
EXIT_PEER_LOST = 69


class PeerLost(Exception):
    """A synchronous run lost a peer (a partitioned host, a dead process) and aborted its
    collectives: `tfdist train` prints one line and exits EXIT_PEER_LOST, and the supervisor
    restarts the group from its last backup."""


class UsageError(Exception):
    """Bad input from the user: a config value, a path, a strategy name, a mismatched backup.

    The message names what is wrong and what to do. Nothing on disk has been changed when it is
    raised.
    """


class Moved(UsageError, ModuleNotFoundError):
    """An import of a module that moved: one line naming where it is now (`tfdist.MOVED`)."""

    def __init__(self, old, new):
        # (no `name`: Python's `from package import x` would take the error for a missing
        # submodule and say less)
        super().__init__(f"{old} moved to {new} in tfdist 0.2; import that instead")


#: Functions (exception, traceback) -> a one-line message, or None: an upstream library's own
#: error about bad input that tfdist reports as a UsageError (`translate_usage_errors`).
_TRANSLATIONS = []


def translate_usage_errors(translate):
    """Also reports as a UsageError an uncaught exception for which `translate(value, traceback)`
    gives a message (Keras's own check of a DeviceMesh under `tfdist.parallel.mesh`)."""
    if translate not in _TRANSLATIONS:
        _TRANSLATIONS.append(translate)


def install_excepthook(report=lambda code: None):
    """An uncaught UsageError in any program that imported tfdist: one line, exit status 2
    (`report(2)` first: a launched process records it, `tfdist.runtime.cluster.report_exit`)."""
    if getattr(sys.excepthook, "tfdist", False):
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if not isinstance(value, UsageError):
            message = next(filter(None, (t(value, traceback) for t in _TRANSLATIONS)), None)
            if message is None:
                return previous(kind, value, traceback)
            value = UsageError(message)
        sys.stdout.flush()
        print(f"tfdist: error: {value}", file=sys.stderr, flush=True)
        report(2)
        os._exit(2)  # an excepthook cannot choose the exit status otherwise (it would be 1)

    hook.tfdist = True
    sys.excepthook = hook
