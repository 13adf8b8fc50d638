"""The workdir: one run per workdir (`tfdist train` holds `<workdir>/.tfdist-lock` while it
runs), and whether it holds a finished run (`finished`, `prepare_workdir`).

    >>> import tempfile
    >>> from tfdist.runtime.lock import WorkdirLock
    >>> run = tempfile.mkdtemp()
    >>> with WorkdirLock(run):
    ...     WorkdirLock(run).acquire()       # a second run on the same workdir
    Traceback (most recent call last):
    ...
    tfdist.errors.UsageError: ... is in use by another run (pid ...); wait for it to end, ...

The lock is `fcntl.flock` on an open file. The kernel drops it when the holder dies, however it
dies (SIGKILL included), so a restart after a crash takes it over at once; the file still names
the dead holder until the new one rewrites it. A run that ends (or is refused) removes the file,
so it leaves no trace. A requeued job that starts while its old copy still runs is refused
instead of resuming from backups the other is writing.

Where it holds: local filesystems, and NFSv4 (Linux maps flock to byte-range locks there). Where
it does not: paths TensorFlow opens itself (`gs://`, `s3://`, `hdfs://`) have no locks; there
tfdist says so in one line and runs unlocked, and the scheduler must keep one job per workdir.
Under a multi-process strategy only the chief holds it: the other processes are the same run.
"""
import json
import os
import socket
import sys
import time

from tfdist.errors import UsageError

LOCK_NAME = ".tfdist-lock"


class WorkdirLock:
    """An exclusive lock on a workdir for this process (a context manager). `acquire()` raises
    `UsageError`, naming the holder's host and pid, when another run holds it."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_NAME)
        self._file = None

    @property
    def supported(self):
        return "://" not in self.workdir

    def acquire(self):
        if not self.supported:
            print(f"tfdist: {self.workdir} is not on a local filesystem: no lock is taken; keep "
                  f"one run per workdir yourself", file=sys.stderr, flush=True)
            return self
        import fcntl
        os.makedirs(self.workdir, exist_ok=True)
        while True:
            f = open(self.path, "a+")  # "a+": never truncates the holder's record
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self.holder(f)
                f.close()
                raise UsageError(f"{self.workdir} is in use by another run ({holder}); wait for "
                                 f"it to end, stop it, or choose another --workdir") from None
            if self._same_file(f):
                break
            f.close()  # its holder removed it meanwhile (release): lock the new one
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}) + "\n")
        f.flush()
        self._file = f
        return self

    def _same_file(self, f):
        try:
            a, b = os.fstat(f.fileno()), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)

    def holder(self, f=None):
        """The holder's record, as words ("pid 123 on host h since ...")."""
        try:
            if f is None:
                f = open(self.path)
            f.seek(0)
            r = json.loads(f.read() or "{}")
            return f"pid {r['pid']} on host {r['host']} since {r['since']}"
        except (OSError, ValueError, KeyError):
            return "holder unknown: its record is being written"

    def release(self):
        """Removes the lock file (a run leaves no trace), then drops the lock. A process that
        opened the file meanwhile sees it gone once it holds the lock, and starts over."""
        if self._file is not None:
            if self._same_file(self._file):
                os.unlink(self.path)
            self._file.close()
            self._file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()

    def get_config(self):
        return {"workdir": self.workdir}


_OUTPUTS = ("model.keras", "metrics.json", "loss.png", "tensorboard", "backup", "tokenizer")


def finished(workdir, backup_dir):
    """Whether `workdir` holds a finished run: its model.keras, and no backup left to resume."""
    import tensorflow as tf

    return (tf.io.gfile.exists(os.path.join(workdir, "model.keras")) and not
            (tf.io.gfile.exists(backup_dir) and tf.train.latest_checkpoint(backup_dir)))


def prepare_workdir(workdir, backup_dir, overwrite):
    """Refuses to clobber a finished run unless --overwrite; a run with a backup is resumed."""
    import tensorflow as tf

    if overwrite:
        for name in _OUTPUTS:
            p = os.path.join(workdir, name)
            if tf.io.gfile.isdir(p):
                tf.io.gfile.rmtree(p)
            elif tf.io.gfile.exists(p):
                tf.io.gfile.remove(p)
        if tf.io.gfile.exists(backup_dir):
            tf.io.gfile.rmtree(backup_dir)
    elif finished(workdir, backup_dir):
        raise UsageError(f"{workdir} already holds a finished run (model.keras); pass --overwrite "
                         f"to replace it or choose another --workdir")
