"""Backups that do not stop training: the state read into host memory at once (`freeze`), then
written by one background thread (`Writer`) while training goes on.

`freeze(parts)` reads every variable of `parts` (a nested dict or list of what
`tf.train.Checkpoint` saves: variables, tensor-parallel shards shown as one) in one
`tf.function`, on the host, and returns the same structure holding those values. TF's variables
copy on write: an update after the read makes a new buffer, so the values stay as read, and
host memory holds at most one extra copy of the state while the write runs. A checkpoint of the
frozen structure has the very keys of the live one, so it restores into the live variables.

TF 2.21's own asynchronous checkpoint (`CheckpointOptions(enable_async=True)`) fails at its
second save on Keras 3 variables (DESIGN.md: Keras's `_copy_trackable_to_cpu` creates a
tf.Variable inside TF's copy function on every call); this module does not use it.

Example (the frozen value is the one read, whatever the variable holds later):

    >>> import tensorflow as tf
    >>> from tfdist.callbacks.snapshot import Snapshot, Writer
    >>> v = tf.Variable([1.0, 2.0])
    >>> snap = Snapshot({"w": v})
    >>> frozen = snap.freeze()
    >>> _ = v.assign([5.0, 6.0])
    >>> frozen["w"].value().numpy().tolist(), snap.nbytes
    ([1.0, 2.0], 8)
    >>> writer = Writer()
    >>> writer.start(lambda: None, what="step 1")
    >>> writer.wait(timeout=10)
"""
import threading

from tfdist.compat import Tensors
from tfdist.runtime.lazy import tf


class Frozen(Tensors):
    """A value read from a variable: saved as the variable would be; never restored into."""

    def __init__(self, tensor):
        super().__init__()
        self.tensor = tensor

    def value(self):
        return self.tensor

    def restore(self, tensor):
        raise TypeError("a frozen backup value is written, not restored into")


def _read(x):
    return x.value() if isinstance(x, Tensors) else tf.convert_to_tensor(x)


class Snapshot:
    """What `freeze` reads: the leaves of `parts` (nested dicts and lists), in one tf.function
    traced once. `nbytes`: the host bytes one frozen copy takes (after the first). `live=True`
    (a companion test's) freezes nothing: the write then reads the live variables while
    training changes them."""

    def __init__(self, parts, live=False):
        self.parts, self.live = parts, live
        self.leaves = tf.nest.flatten(parts)
        self.nbytes = 0  # (known once read)

        @tf.function(autograph=False)
        def read():
            with tf.device("CPU:0"):  # a device's values copied to the host
                return [tf.identity(_read(x)) for x in self.leaves]
        self._read = read

    def freeze(self):
        if self.live:
            return self.parts
        values = self._read() if self.leaves else []
        self.nbytes = sum(int(v.shape.num_elements()) * v.dtype.size for v in values)
        return tf.nest.pack_sequence_as(self.parts, [Frozen(v) for v in values])


class Writer:
    """One background write at a time. `start(fn)` waits for the write in flight first;
    `wait(timeout)` returns when none is in flight, and raises what the last one raised (once)."""

    def __init__(self):
        self._thread = None
        self._error = None  # what the last write raised, until `wait` raises it
        self.what = None

    @property
    def busy(self):
        return self._thread is not None and self._thread.is_alive()

    def start(self, fn, what, timeout=None):
        self.wait(timeout)
        self.what = what

        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 (raised again in the waiting thread)
                self._error = e
        self._thread = threading.Thread(target=run, name=f"tfdist-backup {what}", daemon=True)
        self._thread.start()

    def wait(self, timeout=None):
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the backup write of {self.what} did not end within "
                                   f"{timeout:.0f} s")
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
