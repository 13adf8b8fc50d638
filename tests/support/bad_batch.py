"""A user's Keras program with bad batches: one row of NaN inputs in `--bad` batches from global
step `--bad_at` on (1-based), trained under `tfdist.strategies.get(--strategy,
skip_nonfinite=--k)` (tests/test_nonfinite.py).

Each process prints `RESULT {json}`: the skipped count, whether the weights and the optimizer's
variables after the first bad step are bitwise those before it, whether the final weights are
finite, and (the chief) writes the final weights to `<out>/weights.npz`. The bad row is row 5 of
the 8 of a global batch: under 2 processes only the second one's half holds it. `--kill_at=S`
ends worker `--kill_worker` after global step S (once: `--marker`), and Keras's
`BackupAndRestore` (`--backup`) resumes the restarted run.
"""
import json
import os
import sys

from absl import app, flags, logging

_STRATEGY = flags.DEFINE_string("strategy", "single", "A tfdist strategy name.")
_K = flags.DEFINE_integer("k", 3, "skip_nonfinite: skipped updates in a row that stop fit.")
_BAD_AT = flags.DEFINE_integer("bad_at", 9, "The global step of the first bad batch.")
_BAD = flags.DEFINE_integer("bad", 1, "Bad batches in a row.")
_EPOCHS = flags.DEFINE_integer("epochs", 4, "Epochs of 6 steps.")
_OUT = flags.DEFINE_string("out", "bad_batch_out", "Where the chief writes.")
_BACKUP = flags.DEFINE_string("backup", "", "BackupAndRestore's directory (none: no backup).")
_KILL_AT = flags.DEFINE_integer("kill_at", 0, "Global step after which to end a worker (0: never).")
_KILL_WORKER = flags.DEFINE_integer("kill_worker", 1, "The worker --kill_at ends.")
_MARKER = flags.DEFINE_string("marker", "", "A file written at the kill: a restart runs on.")

BATCH, STEPS = 8, 6


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist.strategies

    strategy = tfdist.strategies.get(_STRATEGY.value, skip_nonfinite=_K.value)
    os.makedirs(_OUT.value, exist_ok=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 4)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
    rows = np.arange(BATCH * STEPS * _EPOCHS.value) % (BATCH * STEPS)  # the epochs, in order
    xs, ys = x[rows].copy(), y[rows]
    for step in range(_BAD_AT.value, _BAD_AT.value + _BAD.value):
        xs[(step - 1) * BATCH + 5, 1] = np.nan  # row 5 of that global batch
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")

    def state():
        return [keras.ops.convert_to_numpy(w) for w in model.weights] + [
            keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]

    class Watch(keras.callbacks.Callback):
        step, before, same = 0, None, None

        def on_epoch_begin(self, epoch, logs=None):
            self.step = epoch * STEPS

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.step == _BAD_AT.value - 1:
                self.before = state()
            if self.step == _BAD_AT.value and self.before is not None:
                self.same = all(np.array_equal(a, b, equal_nan=True)
                                for a, b in zip(self.before, state()))
            if (self.step == _KILL_AT.value and strategy.worker_index == _KILL_WORKER.value
                    and not os.path.exists(_MARKER.value)):
                open(_MARKER.value, "w").close()
                print(f"killing worker {strategy.worker_index} after step {self.step}",
                      flush=True)
                os._exit(3)

    watch = Watch()
    callbacks = [watch]
    if _BACKUP.value:
        callbacks.append(keras.callbacks.BackupAndRestore(_BACKUP.value))
    # The epochs in order (Keras reads on across epochs), from the epoch a backup resumes at:
    # Keras's BackupAndRestore restores the epoch, not the data position.
    start = 0
    metadata = os.path.join(_BACKUP.value, "training_metadata.json")
    if _BACKUP.value and os.path.exists(metadata):
        with open(metadata) as f:
            start = json.load(f)["epoch"] * BATCH * STEPS
    train = tf.data.Dataset.from_tensor_slices((xs[start:], ys[start:])).batch(
        BATCH, drop_remainder=True)
    history = model.fit(train.repeat(), epochs=_EPOCHS.value, steps_per_epoch=STEPS,
                        callbacks=callbacks, verbose=2, shuffle=False)
    weights = [keras.ops.convert_to_numpy(w) for w in model.weights]
    result = {"worker": strategy.worker_index, "chief": strategy.is_chief,
              "epochs": history.epoch, "skipped": history.history.get("skipped", [0])[-1],
              "same_after_the_bad_step": watch.same,
              "finite": all(np.isfinite(w).all() for w in weights),
              "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations))}
    if strategy.is_chief:
        np.savez(os.path.join(_OUT.value, "weights.npz"), *weights)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main, sys.argv)
