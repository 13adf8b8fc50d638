"""Loss-spike rollback (`--config.train.spike=F`; PaLM, Chowdhery et al. 2022, §5.1: about 20
spikes in training, each handled by restarting from a checkpoint about 100 steps before it and
skipping 200-500 batches).

A spike is a training loss above F times the mean of the last `spike_window` steps' losses, for
`spike_steps` steps in a row. `SpikeWatch` sees it after each step (the logged loss: the same on
every process) and stops `fit`. Under the parameter server it sees each report (every 10 steps:
each of its steps with their mean loss); its loop then stops, waits for the steps in flight, and
`fit` returns. `tfdist.train` then goes back to the newest backup taken before
the spike's first step (`BackupAndRestore.rollback`: every later backup is removed), moves the
data order on by `spike_skip` batches from there (`tfdist.data.Windows` `skips`), and trains
on. The rollbacks are recorded in `<backup>/rollbacks.json`, read at every start: a run resumed
from any backup reads the data order the run did.

Example (window 3, F = 2, 2 steps in a row):

    >>> from tfdist.callbacks.spike import SpikeWatch
    >>> w = SpikeWatch(factor=2.0, steps=2, window=3, initial_step=0)
    >>> [w.see(loss) for loss in [3.0, 2.9, 2.8, 2.7, 9.0, 9.5]]
    [False, False, False, False, False, True]
    >>> w.spike
    (5, 6)
"""
import collections
import os

from tfdist.callbacks.log import read_json, steps_in, write_json_atomic
from tfdist.runtime.lazy import keras, tf


class SpikeWatch(keras.callbacks.Callback):
    """Watches the per-step training loss from step `initial_step` on; `spike`: (its first step,
    the step it was seen at), once seen (and `fit` is stopped)."""

    def __init__(self, factor, steps, window, initial_step):
        super().__init__()
        self.factor, self.steps, self.window = factor, steps, window
        self.step = initial_step
        self.recent = collections.deque(maxlen=window)  # the last losses before any high one
        self.high = []  # (step, loss) of the high steps in a row
        self.spike = None
        self.mean = None  # the running mean the spike was measured against

    def restart(self, step):
        """Watches again from `step` (after a rollback), with the losses before the spike."""
        self.step, self.high, self.spike = step, [], None

    def see(self, loss):
        """One step's loss. Returns whether a spike is now seen."""
        self.step += 1
        full = len(self.recent) == self.window
        mean = sum(self.recent) / len(self.recent) if self.recent else None
        if full and not loss <= self.factor * mean:  # (NaN counts as high)
            self.high.append((self.step, loss))
            if len(self.high) >= self.steps:
                self.spike, self.mean = (self.high[0][0], self.step), mean
                return True
            return False
        self.high = []
        self.recent.append(loss)
        return False

    def on_train_batch_end(self, batch, logs=None):
        # Steps reported together (the parameter server's 10, steps_per_execution's) are each
        # seen with the loss reported (their mean, or the last one's).
        loss = float((logs or {}).get("loss", float("nan")))
        if any([self.see(loss) for _ in range(steps_in(logs))]):
            self.model.stop_training = True

    def describe(self):
        first, last = self.spike
        losses = ", ".join(f"{loss:.3f}" for i, (_, loss) in enumerate(self.high)
                           if i == 0 or loss != self.high[i - 1][1])  # (a report's steps: once)
        return (f"loss spike at steps {first}-{last} ({losses} > {self.factor:g} x the mean "
                f"{self.mean:.3f} of the {self.window} steps before)")


def rollbacks_path(backup_dir):
    return os.path.join(backup_dir, "rollbacks.json")


def read_rollbacks(backup_dir):
    """The rollbacks so far: [{"step": the backup's, "skip": batches, "spike": [first, last]}]."""
    path = rollbacks_path(backup_dir)
    return read_json(path) if tf.io.gfile.exists(path) else []


def record_rollback(backup_dir, rollbacks):
    write_json_atomic(rollbacks_path(backup_dir), rollbacks)


def skips(rollbacks):
    """`tfdist.data.Windows` skips of `rollbacks`."""
    return [(r["step"], r["skip"]) for r in rollbacks]
