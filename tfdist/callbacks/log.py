"""What a run reports: the per-step training log (progress, TensorBoard, metrics.json, loss
curve), the step count of a call that ran several steps, and a profiled step.

Example (a log of 3 steps of a tiny model, written to a temporary workdir):

    >>> import tempfile, keras, tensorflow as tf, tfdist.strategies
    >>> from tfdist.callbacks import TrainingLog
    >>> run = tempfile.mkdtemp()
    >>> strategy = tfdist.strategies.get("single")
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    >>> data = tf.data.Dataset.from_tensors((tf.ones((8, 4)), tf.ones((8, 1)))).repeat()
    >>> log = TrainingLog(run, tokens_per_step=8, plot=False)
    >>> history = strategy.fit(model, data, epochs=1, steps_per_epoch=3, callbacks=[log], verbose=0)
    >>> [r["step"] for r in log.history["steps"]]
    [1, 2, 3]
"""
import json
import math
import os
import time

import keras
import numpy as np
import tensorflow as tf

from tfdist.data.store import write_atomic
from tfdist.errors import UsageError
from tfdist.runtime import progress


def write_json_atomic(path, obj):
    """Writes JSON through a temporary file and a rename, so a kill never leaves half a file."""
    write_atomic(path, json.dumps(obj, indent=1))


def read_json(path):
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


STEPS_KEY = "tfdist/steps"
#: Other per-step logs named `tfdist/<key>` (e.g. a strategy's `tfdist/worker_steps`) are
#: recorded in metrics.json's step records as `<key>`, and not averaged or shown.
EXTRA_LOG_PREFIX = "tfdist/"


def steps_in(logs):
    """Optimizer steps that one `on_train_batch_end` stands for: 1 under Keras `fit`; more under
    the parameter-server loop, which reports once per group of asynchronously run steps."""
    return int((logs or {}).get(STEPS_KEY, 1))


class StepsPerCall(keras.callbacks.Callback):
    """With `steps_per_execution` N, Keras calls `on_train_batch_end` once per N steps, with the
    last step's index: this tells tfdist's callbacks (`steps_in`) how many."""

    def on_epoch_begin(self, epoch, logs=None):
        self.last = -1

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None:
            logs[STEPS_KEY] = batch - self.last
        self.last = batch


class Progress(keras.callbacks.Callback):
    """Training's progress on the console (`tfdist.runtime.progress`): Keras's progress bar on a
    terminal, else one line per `every` steps, with readable numbers. It stands in for Keras's
    own `ProgbarLogger` (`fit(verbose=0)` with this callback last, after those that add to the
    logs)."""

    def __init__(self, every=1):
        super().__init__()
        self.every = every
        self.bar = None
        self.seen = 0  # steps of this epoch shown

    def on_epoch_begin(self, epoch, logs=None):
        print(f"Epoch {epoch + 1}/{self.params.get('epochs')}", flush=True)
        self.bar = progress.Progress(self.params.get("steps") or 0, every=self.every)
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen = batch + 1
        if self.seen < (self.params.get("steps") or float("inf")):  # the last: at the epoch end
            self.bar.update(self.seen, _shown_logs(logs), finalize=False)

    def on_epoch_end(self, epoch, logs=None):
        if self.bar is not None:
            self.bar.update(self.seen, _shown_logs(logs), finalize=True)


def _shown_logs(logs):
    return {k: v for k, v in (logs or {}).items() if not k.startswith(EXTRA_LOG_PREFIX)
            and np.ndim(v) == 0}


class TrainingLog(keras.callbacks.Callback):
    """Per-step loss, learning rate and tokens/s: on the progress bar, in TensorBoard and in
    `metrics.json`; a loss-curve PNG at the end. Files are written by the chief only.

    The validation loss is also reported in bits per byte (`val_bits_per_byte`), which compares
    across tokenizers: nats/token / ln 2 / (UTF-8 bytes per token of the validation split), given
    `val_bytes_per_token`.

    Keras reports a running mean of the loss over the epoch; this callback resets the metrics
    before each step so that every logged value (and the progress bar) is that step's own loss.
    Keras's TensorBoard callback numbers its steps from 0 at every `fit` call, which is wrong after
    a resume, so summaries are written here against the global step.
    """

    def __init__(self, workdir, *, tokens_per_step, initial_step=0, total_steps=None,
                 is_chief=True, log_every_steps=1, tensorboard=True, plot=True,
                 val_bytes_per_token=None, flush_every_steps=0, batch=None):
        super().__init__()
        self.batch = batch  # {"global_batch": rows, "replicas": n}: logged with every step
        self.workdir = workdir
        self.tokens_per_step = tokens_per_step
        self.step = initial_step
        self._skipped = 0  # updates skipped as not finite, so far
        self.total_steps = total_steps
        self.is_chief = is_chief
        self.log_every_steps = log_every_steps
        self.plot = plot
        self.flush_every_steps = flush_every_steps  # metrics.json as of each backup, and epoch end
        self.val_bytes_per_token = val_bytes_per_token
        self.metrics_path = os.path.join(workdir, "metrics.json")
        self.history = {"steps": [], "evals": []}
        if is_chief and initial_step and tf.io.gfile.exists(self.metrics_path):
            old = read_json(self.metrics_path)  # keep what was logged up to the restored step
            self.history["steps"] = [r for r in old.get("steps", []) if r["step"] <= initial_step]
            self.history["evals"] = [r for r in old.get("evals", []) if r["step"] <= initial_step]
            if old.get("rollbacks"):
                self.history["rollbacks"] = old["rollbacks"]
        self._writer = (tf.summary.create_file_writer(os.path.join(workdir, "tensorboard"))
                        if is_chief and tensorboard else None)
        self._t0 = None
        self.flushed_step = initial_step  # the newest step metrics.json holds

    def unflushed(self):
        """The step records metrics.json does not hold yet (an in-memory snapshot carries
        them: `tfdist.callbacks.memory`)."""
        return [r for r in self.history["steps"] if r["step"] > self.flushed_step]

    def carry(self, records):
        """Takes the step records a snapshot carried (`unflushed`) up to this log's step: the
        run resumed from memory at a step that metrics.json did not reach."""
        last = self.history["steps"][-1]["step"] if self.history["steps"] else 0
        self.history["steps"] += [r for r in records if last < r["step"] <= self.step]

    @property
    def losses(self):
        return [r["loss"] for r in self.history["steps"]]

    def on_train_batch_begin(self, batch, logs=None):
        self.model.reset_metrics()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        dt = time.perf_counter() - self._t0
        n = steps_in(logs)
        self.step += n
        logs = logs if logs is not None else {}
        lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        record = {"step": self.step, "loss": float(logs.get("loss", np.nan)), "lr": lr,
                  "step_time": dt / n, "tokens_per_sec": n * self.tokens_per_step / dt,
                  "time": round(time.time(), 3), **(self.batch or {})}
        if "skipped" in logs:  # updates skipped as not finite (tfdist.runtime.nonfinite)
            record["skipped"] = int(logs["skipped"])
            if record["skipped"] > self._skipped:  # this one: its loss is not in the tracker
                record["loss"] = float("nan")
            self._skipped = record["skipped"]
        for key, value in logs.items():  # a strategy's own per-step facts
            if key.startswith(EXTRA_LOG_PREFIX) and key != STEPS_KEY:
                record[key[len(EXTRA_LOG_PREFIX):]] = np.asarray(value).tolist()
        logs["tok/s"] = round(record["tokens_per_sec"])  # shown by Keras's progress bar
        self.history["steps"].append(record)
        every = self.flush_every_steps
        if every and self.step // every > (self.step - n) // every:
            self.flush()
        if self._writer and self.step % self.log_every_steps == 0:
            with self._writer.as_default(step=self.step):
                for k in ("loss", "lr", "tokens_per_sec"):
                    tf.summary.scalar("train/" + k, record[k])

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and "val_loss" in logs and self.val_bytes_per_token:
            logs["val_bits_per_byte"] = (float(logs["val_loss"]) / math.log(2)
                                         / self.val_bytes_per_token)
        evals = {k[4:]: float(v) for k, v in (logs or {}).items() if k.startswith("val_")}
        if evals:
            self.history["evals"].append({"step": self.step, "epoch": epoch + 1, **evals})
            if self._writer:
                with self._writer.as_default(step=self.step):
                    for k, v in evals.items():
                        tf.summary.scalar("val/" + k, v)
        self.flush()

    def on_train_end(self, logs=None):
        self.flush()
        if self.plot and self.is_chief and (self.total_steps is None
                                            or self.step >= self.total_steps):
            plot_losses(self.history, os.path.join(self.workdir, "loss.png"))

    def steady_tokens_per_sec(self, warmup=3):
        """Median tokens/s over the steps after the first `warmup` ones."""
        rates = [r["tokens_per_sec"] for r in self.history["steps"][warmup:]]
        return float(np.median(rates)) if rates else float("nan")

    def rewind(self, step, rollback):
        """Back to `step` (a loss spike's rollback, `rollback` its record): what was logged
        after it is dropped, the rollback kept."""
        self.step = step
        self.history["steps"] = [r for r in self.history["steps"] if r["step"] <= step]
        self.history["evals"] = [r for r in self.history["evals"] if r["step"] <= step]
        self.history.setdefault("rollbacks", []).append(rollback)
        self.flush()

    def flush(self):
        self.flushed_step = self.step
        if self.is_chief:
            try:
                tf.io.gfile.makedirs(self.workdir)
                write_json_atomic(self.metrics_path, self.history)
            except (OSError, tf.errors.OpError) as e:  # a full disk: one line, the run stops
                why = getattr(e, "strerror", None) or str(getattr(e, "message", e)).split(
                    "; ")[-1].splitlines()[0]
                raise UsageError(f"could not write {self.metrics_path} ({why}); free space "
                                 f"there, then run the same command to resume from the newest "
                                 f"backup") from None
        if self._writer:
            self._writer.flush()


def plot_losses(history, path):
    """Train loss per step and validation loss per evaluation, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = history["steps"]
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, label="train loss")
    evals = [e for e in history["evals"] if "loss" in e]
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-",
                label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with tf.io.gfile.GFile(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


class ProfileStep(keras.callbacks.Callback):
    """Captures a TensorBoard profile (TF's profiler: every op of every thread, with its start and
    end) of global step `step` into `logdir` (`<logdir>/plugins/profile/<time>/<host>.xplane.pb`,
    what TensorBoard's Profile tab reads). `log` is the run's `TrainingLog`, which counts the
    global steps. `tfdist.runtime.profiling` reads it back.

    Example:

        cb = ProfileStep(5, "runs/x/profile/worker-0", log)   # then pass it to fit
    """

    def __init__(self, step, logdir, log):
        super().__init__()
        self.target = step
        self.logdir = logdir
        self.log = log
        self._on = False  # profiling now

    def on_train_batch_begin(self, batch, logs=None):
        if self.log.step + 1 == self.target:
            tf.profiler.experimental.start(self.logdir)
            self._on = True

    def on_train_batch_end(self, batch, logs=None):
        if self._on:
            self._on = False
            tf.profiler.experimental.stop()

