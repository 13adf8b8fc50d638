"""Updates whose loss or gradients are not finite, skipped (`tfdist.step.TrainStep`,
`skip_nonfinite=K`): the bookkeeping on the host, and the check in the step.

A batch of NaN inputs, or an overflow in float32 or bfloat16, makes a step's gradients NaN or
Inf, and one update with them leaves every weight NaN. The step then keeps each update's
gradients (its sums, as gradient accumulation does), reports whether any replica's loss or
gradients were not finite (`flag`, summed over the replicas of the step), and the host, after
the agreement of every process (`Strategy.any_process`), runs the update or drops the sums.
A skipped update leaves the weights, the optimizer's slots and its update count as they were;
the batches are consumed (the data position moves on). K skips in a row end the run
(`NonFiniteSteps`, one line, exit 2): the data or the learning rate is wrong, and the newest
backup holds the weights before them. Under mixed_float16, Keras's loss-scale optimizer skips
such updates on its own (and lowers its scale): this is not used there.

Example (the host's count: 2 in a row with K = 2 stop the run):

    >>> from tfdist.runtime.nonfinite import NonFiniteSteps, Skipping
    >>> s = Skipping(2)
    >>> s.record(True, 7); s.record(False, 8); s.skipped
    tfdist: skipped an update whose loss or gradients are not finite (after update 7; 1 so far)
    1
    >>> s.record(True, 9)
    tfdist: skipped an update whose loss or gradients are not finite (after update 9; 2 so far)
    >>> try:
    ...     s.record(True, 9)
    ... except NonFiniteSteps as e:
    ...     print(e)  # doctest: +ELLIPSIS
    tfdist: skipped an update whose loss or gradients are not finite (after update 9; 3 so far)
    2 updates in a row had a loss or gradients that are not finite (NaN or Inf)...
"""
from tfdist.errors import UsageError

#: The step's log entry: replicas of this process whose batch was not finite (removed on the host)
FLAG = "tfdist/nonfinite"
#: The log entry of the updates skipped so far in this run (Keras's progress bar, History)
COUNT = "skipped"


class NonFiniteSteps(UsageError):
    """K updates in a row skipped: one line, exit status 2."""


class Skipping:
    """The host's count of skipped updates; `limit`: the K skips in a row that end the run."""

    def __init__(self, limit):
        self.limit = int(limit)
        self.skipped = 0  # in this run
        self.in_a_row = 0
        self.pending = False  # a batch of the current window was not finite (this process)
        self.last = []  # the update counts at which the updates in a row were skipped

    def record(self, skipped, update):
        """After an update's window: `skipped` (agreed by every process) at the optimizer's
        update count `update`."""
        self.pending = False
        if not skipped:
            self.in_a_row, self.last = 0, []
            return
        self.skipped += 1
        self.in_a_row += 1
        self.last.append(update)
        print(f"tfdist: skipped an update whose loss or gradients are not finite (after update "
              f"{update}; {self.skipped} so far)", flush=True)
        if self.in_a_row >= self.limit:
            raise NonFiniteSteps(
                f"{self.in_a_row} updates in a row had a loss or gradients that are not finite "
                f"(NaN or Inf), after update {self.last[0]}; the weights are those before them "
                f"and the newest backup is intact: check the data there, or lower the learning "
                f"rate (train.skip_nonfinite={self.limit} is the bound)")


def flag(loss, grads):
    """1.0 where `loss` or any of `grads` (None: none) holds NaN or Inf, else 0.0 (a graph
    tensor of one replica)."""
    import tensorflow as tf
    parts = [tf.reduce_all(tf.math.is_finite(tf.cast(loss, tf.float32)))]
    parts += [tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(g))) for g in grads
              if g is not None]
    return 1.0 - tf.cast(tf.reduce_all(tf.stack(parts)), tf.float32)
