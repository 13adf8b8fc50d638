"""Callbacks: step-exact BackupAndRestore, and the per-step training log (progress, TensorBoard,
metrics.json, loss curve).

Example (the first 6 of 10 steps, backed up every 2 steps; a restarted run resumes at step 6):

    >>> import tempfile, keras, tensorflow as tf, tfdist.strategies
    >>> import tfdist.callbacks as cb
    >>> run = tempfile.mkdtemp()
    >>> strategy = tfdist.strategies.get("single")
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    ...     model.optimizer.build(model.trainable_variables)
    >>> data = tf.data.Dataset.from_tensors((tf.ones((8, 4)), tf.ones((8, 1)))).repeat()
    >>> backup = cb.BackupAndRestore(run + "/backup", every_steps=2, total_steps=10)
    >>> start = backup.restore(model)      # model and optimizer built; 0 if there is no backup
    >>> history = strategy.fit(model, data, epochs=3, steps_per_epoch=2, initial_step=start,
    ...                        callbacks=[backup, cb.TrainingLog(run, tokens_per_step=8,
    ...                                                          initial_step=start)], verbose=0)
    >>> start, cb.BackupAndRestore(run + "/backup", total_steps=10).restore(model)
    (0, 6)
"""
import json
import math
import os
import sys
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat, zero
from tfdist.data.store import write_atomic
from tfdist.errors import UsageError
from tfdist.models import state


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


def model_signature(model):
    """{name: shape} of the model's unsplit weights: what a checkpoint must match to be restored,
    whatever the layout (tfdist.models.state)."""
    return state.shapes(model)


class BackupAndRestore(keras.callbacks.Callback):
    """Step-exact backup of a training run, built on `tf.train.CheckpointManager`.

    Keras 3's own `keras.callbacks.BackupAndRestore` restores only the epoch (the steps of the
    interrupted epoch run again), not the data position, and lets workers race on a shared
    directory. This one saves the model (including dropout RNG state), the optimizer, the global
    step and the epoch every `every_steps` steps and at each epoch end. The data position is the
    global step: tfdist's pipeline (`tfdist.data.Windows`) makes batch contents a function of the
    step, so a resumed run reads exactly the batches that were not yet trained on.

    * `restore(model)` (call before `fit`, once model and optimizer are built) returns the step to
      resume at and refuses, with a `UsageError`, a backup written for a different model or data.
      A damaged newest backup is reported in one line and the one before it is used.
    * A kill during a save leaves the previous checkpoint usable: TF writes the new files first and
      then atomically replaces the `checkpoint` index that names the latest one. A save that fails
      (a full disk) removes its own partial files and raises a one-line `UsageError`.
    * The last step's backup is written at the end of the last epoch, after its validation, so a
      run killed after it has nothing left but to save the model.
    * After the run reaches `total_steps` the backup is removed (unless `delete_on_success=False`;
      `tfdist train` keeps it until `model.keras` is written, then calls `remove()`).
    * Multi-worker: every worker calls `save` (synchronous strategies need all of them to take
      part); only the chief writes into `backup_dir`, the others write into a private temporary
      directory that is removed right after. With `collective=False` (Horovod: each rank holds
      its own copy of the variables) the others write nothing.
    """

    def __init__(self, backup_dir, *, every_steps=0, total_steps=None, keep=2,
                 delete_on_success=True, signature=None, is_chief=True, worker_index=0,
                 collective=True, save_checkpoint=None, barrier=None):
        super().__init__()
        # (manager, step) -> writes the checkpoint; a test driver's hook may fail inside it
        self.save_checkpoint = save_checkpoint or (lambda m, step: m.save(checkpoint_number=step))
        self.backup_dir, self.every_steps, self.total_steps = backup_dir, every_steps, total_steps
        self.keep, self.delete_on_success = keep, delete_on_success
        self.signature = signature or {}  # extra facts that must match (model config, data ...)
        self.is_chief, self.worker_index, self.collective = is_chief, worker_index, collective
        self.barrier = barrier or (lambda: None)  # every process meets (ZeRO: shards written)
        self.step = None  # tf.Variable, created with the checkpoint
        self._ckpt = self._manager = None
        self._last_saved = -1

    @property
    def _write_dir(self):
        if self.is_chief:
            return self.backup_dir
        return os.path.join(self.backup_dir, f".tmp-worker-{self.worker_index}")

    @property
    def _meta_path(self):
        return os.path.join(self.backup_dir, "backup.json")

    def _metadata(self, model):
        return {"format": 2, "weights": model_signature(model), **self.signature}

    def _make_checkpoint(self, model):
        with tf.init_scope():
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_step")
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_epoch")
        # The weights and the optimizer's state under the unsplit model's names, whatever the
        # layout (pipeline stages, tensor-parallel shards: tfdist.models.state). Dropout's RNG
        # state lives in Keras SeedGenerators, listed here so they are saved too.
        # Under ZeRO each process's slots go to its own shard (tfdist.zero), not the checkpoint.
        self._parts = dict(weights=state.weights(model), step=self.step, epoch=self.epoch,
                           rng=[v.value for v in model.variables if "seed_generator" in v.path])
        self._opt = state.optimizer_state(model.optimizer, model)
        self._zero = getattr(model.optimizer, "tfdist_zero", None)
        self._slots, rest = zero.split_slots(model.optimizer, self._opt)
        self._ckpt = tf.train.Checkpoint(optimizer=rest, **self._parts)

    def backups(self):
        """The backups on disk, newest first: those the checkpoint index names (a save killed
        before it updated the index is not one), or, when that index itself cannot be read,
        every `ckpt-N` whose own index file exists."""
        try:
            st = tf.train.get_checkpoint_state(self.backup_dir)
            paths = list(st.all_model_checkpoint_paths) if st else []
        except Exception:  # noqa: BLE001 (a damaged text proto: the parser's own error types)
            paths = [p[:-len(".index")] for p in
                     tf.io.gfile.glob(os.path.join(self.backup_dir, "ckpt-*.index"))]
        paths = [p if os.path.isabs(p) or "://" in p else os.path.join(self.backup_dir, p)
                 for p in paths]
        return sorted(set(paths), key=_step_of, reverse=True)

    def restore(self, model):
        """Restores the newest intact backup into `model` (built, compiled). Returns the step to
        resume at (0 without a backup).

        A backup that cannot be read (a truncated or overwritten file, a missing ZeRO shard) is
        reported in one line on stderr and the one before it is tried; with none readable it is
        a `UsageError` naming each, and nothing is deleted. A backup written for another model
        or data is a `UsageError` too."""
        if self._ckpt is None:
            self._make_checkpoint(model)
        candidates = self.backups()
        if not candidates:
            return 0
        if tf.io.gfile.exists(self._meta_path):
            saved, now = read_json(self._meta_path), self._metadata(model)
            for key in sorted(set(saved) | set(now)):
                if saved.get(key) != now.get(key):
                    raise UsageError(
                        f"backup in {self.backup_dir} was written for a different {key} "
                        f"({_diff(saved.get(key), now.get(key))}); use another --workdir or "
                        f"backup dir, or remove that backup to start over")
        damaged = []
        for path in candidates:
            try:
                self._restore_from(path)
            except (tf.errors.OpError, zero.DamagedShards) as e:
                if isinstance(e, tf.errors.InvalidArgumentError):  # a shape or dtype: the model
                    raise UsageError(f"backup {path} does not match this model "
                                     f"({_first_line(e)}); use another backup dir") from None
                damaged.append((path, _first_line(e)))
                continue
            except (AssertionError, ValueError) as e:
                raise UsageError(f"backup {path} does not match this model "
                                 f"({_first_line(e)}); use another backup dir") from None
            self._last_saved = int(self.step.numpy())
            for bad, why in damaged if self.is_chief else ():
                print(f"tfdist: warning: backup {bad} cannot be read ({why}); using "
                      f"{os.path.basename(path)}, the newest intact one", file=sys.stderr,
                      flush=True)
            return self._last_saved
        found = "; ".join(f"{os.path.basename(p)} ({why})" for p, why in damaged)
        raise UsageError(f"no backup in {self.backup_dir} can be read: {found}; restore it from a "
                         f"copy, or move it aside to start over (nothing was deleted)")

    def _restore_from(self, path):
        step = _step_of(path)
        sharded = tf.io.gfile.isdir(zero.shard_dir(self.backup_dir, step))  # a ZeRO run's backup
        slots = self._slots
        if sharded:  # the slots this process holds, in the shards (whatever it holds now)
            names = {n for m in zero.manifests(self.backup_dir, step) for n in m["names"]}
            slots = {k: v for k, v in self._opt.items() if k in names}
        rest = {k: v for k, v in self._opt.items() if k not in slots}
        tf.train.Checkpoint(optimizer=rest, **self._parts).restore(
            path).assert_existing_objects_matched()
        if sharded:
            zero.restore_slots(self.backup_dir, step, slots)
        elif slots:  # a backup without ZeRO holds every slot
            tf.train.Checkpoint(optimizer=slots).read(path).assert_existing_objects_matched()

    def save(self):
        """Saves now (every worker must call this under a synchronous multi-worker strategy).

        A save that fails (a full disk, a lost mount) is a `UsageError` in one line: this step's
        partial files are removed and the previous backup stays as it was."""
        step = int(self.step.numpy())
        if step == self._last_saved:
            return
        try:
            self._save(step)
        except (tf.errors.OpError, OSError) as e:
            self._discard(step)
            before = (f"the backup of step {self._last_saved} is intact" if self._last_saved > 0
                      else "there is no earlier backup")
            raise UsageError(f"could not write the backup of step {step} into {self.backup_dir} "
                             f"({_first_line(e)}); {before}: free space or fix the directory, "
                             f"then run the same command to resume") from None
        self._last_saved = step

    def _save(self, step):
        if self._zero is not None:  # every shard on disk before the index can name this step
            c = self._zero.collectives
            zero.save_shard(self.backup_dir, step, self._slots, c.rank, c.size)
            self.barrier()
        if not (self.is_chief or self.collective):
            return
        if self._manager is None:
            self._manager = tf.train.CheckpointManager(self._ckpt, self._write_dir,
                                                       max_to_keep=self.keep)
        if self.is_chief and not tf.io.gfile.exists(self._meta_path):
            tf.io.gfile.makedirs(self.backup_dir)
            write_json_atomic(self._meta_path, self._metadata(self.model))
        self.save_checkpoint(self._manager, step)
        if self._zero is not None and self.is_chief:
            zero.prune(self.backup_dir, min(_step_of(p) for p in self._manager.checkpoints))
        if not self.is_chief:
            tf.io.gfile.rmtree(self._write_dir)
            self._manager = None

    def _discard(self, step):
        """Removes what a failed save of `step` left, unless the index already names it."""
        if not self.is_chief or any(_step_of(p) == step for p in self.backups()):
            return
        for path in tf.io.gfile.glob(os.path.join(self.backup_dir, f"ckpt-{step}[._]*")):
            (tf.io.gfile.rmtree if tf.io.gfile.isdir(path) else tf.io.gfile.remove)(path)
        _remove(zero.shard_dir(self.backup_dir, step))

    def remove(self):
        """Deletes the backup (the chief; `tfdist train` calls it once the model is saved)."""
        if self.is_chief:
            _remove(self.backup_dir)

    def set_model(self, model):
        super().set_model(model)
        if self._ckpt is None:
            self._make_checkpoint(model)

    def on_train_batch_end(self, batch, logs=None):
        n = steps_in(logs)
        before = int(self.step.numpy())
        self.step.assign_add(n)
        if self.total_steps is not None and before + n >= self.total_steps:
            return  # the last step's backup comes at the epoch end, after its validation
        if self.every_steps and (before + n) // self.every_steps > before // self.every_steps:
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.assign(epoch + 1)
        self.save()

    def on_train_end(self, logs=None):
        done = self.total_steps is not None and int(self.step.numpy()) >= self.total_steps
        if done and self.delete_on_success:
            self.remove()


def _step_of(path):
    return int(path.rsplit("-", 1)[1])


def _first_line(error):
    text = getattr(error, "short", None) or getattr(error, "message", None) or str(error)
    return (text.strip().splitlines() or [""])[0][:200]


def _diff(saved, now):
    if isinstance(saved, dict) and isinstance(now, dict):
        keys = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        return "; ".join(f"{k}: backup {saved.get(k)!r}, now {now.get(k)!r}" for k in keys[:3])
    if isinstance(saved, list) and isinstance(now, list):
        return f"{len(saved)} weights in the backup, {len(now)} now, or other shapes"
    return f"backup {saved!r}, now {now!r}"


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
                 val_bytes_per_token=None, flush_every_steps=0):
        super().__init__()
        self.workdir, self.tokens_per_step = workdir, tokens_per_step
        self.step, self.total_steps, self.is_chief = initial_step, total_steps, is_chief
        self.log_every_steps, self.plot = log_every_steps, plot
        self.flush_every_steps = flush_every_steps  # metrics.json as of each backup, and epoch end
        self.val_bytes_per_token = val_bytes_per_token
        self.metrics_path = os.path.join(workdir, "metrics.json")
        self.history = {"steps": [], "evals": []}
        if is_chief and initial_step and tf.io.gfile.exists(self.metrics_path):
            old = read_json(self.metrics_path)  # keep what was logged up to the restored step
            self.history["steps"] = [r for r in old.get("steps", []) if r["step"] <= initial_step]
            self.history["evals"] = [r for r in old.get("evals", []) if r["step"] <= initial_step]
        self._writer = (tf.summary.create_file_writer(os.path.join(workdir, "tensorboard"))
                        if is_chief and tensorboard else None)
        self._t0 = None

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
                  "time": round(time.time(), 3)}
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
            logs["val_bits_per_byte"] = float(logs["val_loss"]) / math.log(2) / self.val_bytes_per_token
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
        if self.plot and self.is_chief and (self.total_steps is None or self.step >= self.total_steps):
            plot_losses(self.history, os.path.join(self.workdir, "loss.png"))

    def steady_tokens_per_sec(self, warmup=3):
        """Median tokens/s over the steps after the first `warmup` ones."""
        rates = [r["tokens_per_sec"] for r in self.history["steps"][warmup:]]
        return float(np.median(rates)) if rates else float("nan")

    def flush(self):
        if self.is_chief:
            tf.io.gfile.makedirs(self.workdir)
            write_json_atomic(self.metrics_path, self.history)
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
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with tf.io.gfile.GFile(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


# -- Keras's file-writing callbacks on a process that is not the chief (Strategy.for_this_process)

def _remove(directory):
    if tf.io.gfile.exists(directory):  # local, but through gfile as every path here
        tf.io.gfile.rmtree(directory)


_HOOKS = [name for name in dir(keras.callbacks.Callback) if name.startswith("on_")]


class Scratch(keras.callbacks.Callback):
    """A file-writing callback run with its path (attribute `attr`) in a temporary directory,
    removed when training ends: on a worker that must take part in a collective save but whose
    file nobody reads. Every hook it does not define itself goes to the wrapped callback."""

    def __init__(self, callback, attr=None):
        super().__init__()
        self.callback = callback
        self.scratch = tempfile.mkdtemp(prefix="tfdist-scratch-")
        if attr:
            setattr(callback, attr, os.path.join(self.scratch, os.path.basename(
                str(getattr(callback, attr)))))
        for name in _HOOKS:
            if getattr(type(self), name) is getattr(keras.callbacks.Callback, name):
                setattr(self, name, self._hook(name))

    def _hook(self, name):
        return getattr(self.callback, name)

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def on_train_end(self, logs=None):
        self.callback.on_train_end(logs)
        _remove(self.scratch)


class ReadOnlyBackup(Scratch):
    """Keras's BackupAndRestore on a worker that is not the chief: it restores from the chief's
    backup (the directory must be shared, as Keras requires), then writes only to a temporary
    directory (`collective`: saving takes every worker) or not at all, and deletes nothing."""

    def __init__(self, callback, collective):
        self.collective = collective
        super().__init__(callback)

    def _hook(self, name):
        return getattr(self.callback, name) if self.collective else (lambda *a, **k: None)

    def on_train_begin(self, logs=None):
        self.callback.on_train_begin(logs)  # reads the chief's backup
        compat.redirect_backup(self.callback, self.scratch)

    def on_train_end(self, logs=None):
        _remove(self.scratch)  # not the chief's backup


class ProfileStep(keras.callbacks.Callback):
    """Captures a TensorBoard profile (TF's profiler: every op of every thread, with its start and
    end) of global step `step` into `logdir` (`<logdir>/plugins/profile/<time>/<host>.xplane.pb`,
    what TensorBoard's Profile tab reads). `log` is the run's `TrainingLog`, which counts the
    global steps. `tfdist.profiling` reads it back.

    Example:

        cb = ProfileStep(5, "runs/x/profile/worker-0", log)   # then pass it to fit
    """

    def __init__(self, step, logdir, log):
        super().__init__()
        self.target, self.logdir, self.log, self._on = step, logdir, log, False

    def on_train_batch_begin(self, batch, logs=None):
        if self.log.step + 1 == self.target:
            tf.profiler.experimental.start(self.logdir)
            self._on = True

    def on_train_batch_end(self, batch, logs=None):
        if self._on:
            self._on = False
            tf.profiler.experimental.stop()
