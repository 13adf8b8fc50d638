"""Step-exact backup of a training run: `BackupAndRestore`.

Used by `tfdist train`; the example is in `tfdist/callbacks/__init__.py`.
"""
import contextlib
import json
import os
import statistics
import sys
import time

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.callbacks.log import read_json, steps_in, write_json_atomic
from tfdist.callbacks.snapshot import Snapshot, Writer
from tfdist.errors import UsageError
from tfdist.models import state
from tfdist.parallel import zero
from tfdist.parallel.dp import compression, islands
from tfdist.parallel.zero import shards


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
    * `asynchronous=True` (`tfdist train`'s default): a save reads the state into host memory
      (`tfdist.callbacks.snapshot`) and returns; one background thread writes it while training
      goes on. The next save, `wait()`, the end of training and a preemption wait for it; a
      failed write raises there. The chief writes the index once every ZeRO shard is on disk.
    * The last step's backup is written at the end of the last epoch, after its validation, so a
      run killed after it has nothing left but to save the model.
    * After the run reaches `total_steps` the backup is removed (unless `delete_on_success=False`;
      `tfdist train` keeps it until `model.keras` is written, then calls `remove()`).
    * Multi-worker: every worker calls `save` (synchronous strategies need all of them to take
      part); only the chief writes into `backup_dir`, the others write into a private temporary
      directory that is removed right after. With `collective=False` (Horovod: each rank holds
      its own copy of the variables) the others write nothing.
    """

    #: Seconds a write may take (the chief, asynchronous: until every replica's shard is on
    #: disk); beyond it the save fails in one line.
    WRITE_TIMEOUT = 600.0

    def __init__(self, backup_dir, *, every_steps=0, total_steps=None, keep=2,
                 delete_on_success=True, signature=None, is_chief=True, worker_index=0,
                 collective=True, save_checkpoint=None, barrier=None, asynchronous=False):
        super().__init__()
        self.asynchronous = asynchronous
        #: Asynchronous saves write the state's values at the save (False, a companion test's:
        #: the live variables, which training changes while the write runs).
        self.freeze = True
        self._writer = Writer()
        self._snapshot = None
        self._in_flight = None  # the step being written in the background
        self.stalls = []  # seconds each save kept its caller (training) waiting
        # (manager, step) -> writes the checkpoint; a test driver's hook may fail inside it
        self.save_checkpoint = save_checkpoint or (lambda m, step: m.save(checkpoint_number=step))
        self.backup_dir = backup_dir
        self.every_steps = every_steps
        self.total_steps = total_steps
        self.keep = keep
        self.delete_on_success = delete_on_success
        self.signature = signature or {}  # extra facts that must match (model config, data ...)
        self.is_chief = is_chief
        self.worker_index = worker_index
        self.collective = collective
        self.barrier = barrier or (lambda: None)  # every process meets (ZeRO: shards written)
        self.step = None  # tf.Variable, created with the checkpoint
        self._ckpt = None
        self._manager = None
        self._last_saved = -1
        self.index_unreadable = False  # (the checkpoint index was found damaged: `backups`)

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
        # Under ZeRO each process's slots go to its own shard (tfdist.parallel.zero.shards), not
        # the checkpoint. Under ZeRO-3 each process's weights go to its shard too: it holds no
        # others. (A tensor-parallel weight is its shards, shown as one: they have one owner.)
        self._zero = sharded = zero.of(model)
        owner = getattr(sharded, "owner", {})  # (ZeRO-3: the weights' owners)

        def parts(v):
            return getattr(v, "shards", [v])
        held = {k: v for k, v in state.weights(model).items()
                if not owner or all(compat.has_storage(s) for s in parts(v))}
        # ZeRO-Offload: the stored slots (ZeRO-3: weights), shown as variables under their names
        offload = getattr(sharded, "offload", None)
        stored = offload.state() if offload is not None else {}
        held.update({k: stored[id(v)] for k, v in state.weights(model).items() if id(v) in stored})
        stored_ids = {id(x) for x in stored.values()}
        self._shard_weights = {k: v for k, v in held.items()
                               if id(v) in stored_ids or id(parts(v)[0]) in owner}
        self._parts = dict(weights={k: v for k, v in held.items() if k not in self._shard_weights},
                           step=self.step, epoch=self.epoch,
                           rng=[v.value for v in model.variables if "seed_generator" in v.path])
        self._held = held
        self._opt = state.optimizer_state(
            model.optimizer, model, sharded.trainables if sharded else model.trainable_weights)
        self._slots, rest = shards.split_slots(sharded, self._opt)
        for g in offload.groups if offload is not None else ():
            names = state.optimizer_state(g.optimizer, model, [offload.variables[i]
                                                               for i in g.indices])
            self._slots.update({k: stored[id(v)] for k, v in names.items() if id(v) in stored})
        self._opt.update(self._slots)
        # The islands' outer state (config.dp.islands): the same on each of an island's workers.
        outer = islands.of(model.optimizer)
        if outer is not None:
            self._parts["islands"] = dict(outer.build(model.trainable_weights))
        self._ckpt = tf.train.Checkpoint(optimizer=rest, **self._parts)
        # The compressed all-reduce's state (config.dp.compression): each worker's errors, in a
        # shard of its own beside the checkpoint, as a ZeRO shard is.
        self._dp = compression.of(model.optimizer)
        dp_state = dict(self._dp.build(model.trainable_weights)) if self._dp is not None else {}
        # What a save writes: the checkpoint's parts, and this replica's shards.
        self._state = dict(optimizer=rest, parts=self._parts, slots=self._slots,
                           shard_weights=self._shard_weights, dp=dp_state)

    def backups(self, directory=None):
        """The backups in `directory` (the backup dir), newest first: those the checkpoint index
        names (a save killed before it updated the index is not one), or, when that index
        itself cannot be read, every `ckpt-N` whose own index file exists (and
        `index_unreadable` is set)."""
        directory = directory or self.backup_dir
        try:
            with _index_read_quietly():
                state = tf.train.get_checkpoint_state(directory)
        except Exception:  # noqa: BLE001 (a damaged text proto: the parser's own error types)
            state = None
        if state is not None:
            paths = list(state.all_model_checkpoint_paths)
        elif tf.io.gfile.exists(os.path.join(directory, "checkpoint")):
            self.index_unreadable = True
            paths = [p[:-len(".index")] for p in
                     tf.io.gfile.glob(os.path.join(directory, "ckpt-*.index"))]
        else:
            paths = []
        paths = [p if os.path.isabs(p) or "://" in p else os.path.join(directory, p)
                 for p in paths]
        return sorted(set(paths), key=_step_of, reverse=True)

    def newest_step(self):
        """The step of the newest backup on disk (0 without one); nothing is read but the
        index."""
        paths = self.backups()
        return _step_of(paths[0]) if paths else 0

    def restore(self, model, directory=None):
        """Restores the newest intact backup into `model` (built, compiled). Returns the step to
        resume at (0 without a backup). `directory`: another place that holds a backup laid out
        as the backup dir (a snapshot from the keepers' memory: `tfdist.callbacks.memory`).

        A backup that cannot be read (a truncated or overwritten file, a missing ZeRO shard) is
        reported in one line on stderr and the one before it is tried; with none readable it is
        a `UsageError` naming each, and nothing is deleted. A backup written for another model
        or data is a `UsageError` too."""
        if self._ckpt is None:
            self._make_checkpoint(model)
        directory = directory or self.backup_dir
        candidates = self.backups(directory)
        if not candidates:
            return 0
        meta = os.path.join(directory, "backup.json")
        if tf.io.gfile.exists(meta):
            saved, now = read_json(meta), self._metadata(model)
            for key in sorted(set(saved) | set(now)):
                if saved.get(key) != now.get(key):
                    raise UsageError(
                        f"backup in {self.backup_dir} was written for a different {key} "
                        f"({_diff(saved.get(key), now.get(key))}); use another --workdir or "
                        f"backup dir, or remove that backup to start over")
        damaged = []
        for path in candidates:
            try:
                self._restore_from(path, directory)
            except (tf.errors.OpError, shards.DamagedShards) as e:
                if isinstance(e, tf.errors.InvalidArgumentError):  # a shape or dtype: the model
                    raise UsageError(f"backup {path} does not match this model "
                                     f"({_first_line(e)}); use another backup dir") from None
                damaged.append((path, _first_line(e)))
                continue
            except (AssertionError, ValueError) as e:
                raise UsageError(f"backup {path} does not match this model "
                                 f"({_first_line(e)}); use another backup dir") from None
            self._last_saved = int(self.step.numpy())
            if self.index_unreadable and self.is_chief:
                index = os.path.join(self.backup_dir, "checkpoint")
                print(f"tfdist: warning: the backup index {index} cannot be read; using "
                      f"{os.path.basename(path)}, the newest backup on disk", file=sys.stderr,
                      flush=True)
            for bad, why in damaged if self.is_chief else ():
                print(f"tfdist: warning: backup {bad} cannot be read ({why}); using "
                      f"{os.path.basename(path)}, the newest intact one", file=sys.stderr,
                      flush=True)
            return self._last_saved
        found = "; ".join(f"{os.path.basename(p)} ({why})" for p, why in damaged)
        raise UsageError(f"no backup in {self.backup_dir} can be read: {found}; restore it from a "
                         f"copy, or move it aside to start over (nothing was deleted)")

    def _restore_from(self, path, directory=None):
        directory = directory or self.backup_dir
        step = _step_of(path)
        sharded = tf.io.gfile.isdir(shards.shard_dir(directory, step))  # a ZeRO backup
        slots, weights = self._slots, {}
        if sharded:  # the slots (ZeRO-3: weights) this process holds, in the shards
            names = {n for m in shards.manifests(directory, step) for n in m["names"]}
            slots = {k: v for k, v in self._opt.items() if k in names}
            in_shards = shards.shard_weight_names(directory, step)
            weights = {k: v for k, v in self._held.items() if k in in_shards}
        rest = {k: v for k, v in self._opt.items() if k not in slots}
        parts = {**self._parts,
                 "weights": {k: v for k, v in self._held.items() if k not in weights}}
        tf.train.Checkpoint(optimizer=rest, **parts).restore(path).assert_existing_objects_matched()
        if sharded:
            shards.restore_slots(directory, step, slots, weights)
        elif slots:  # a backup without ZeRO holds every slot
            tf.train.Checkpoint(optimizer=slots).read(path).assert_existing_objects_matched()
        if self._dp is not None:
            self._restore_compression(directory, step)

    def _restore_compression(self, directory, step):
        """This worker's state of the compressed all-reduce, from its own shard of `step`."""
        c = self._dp
        if not tf.io.gfile.isdir(shards.shard_dir(directory, step, "dp")):
            why = "holds no compression state (written without dp.compression)"
            left = sorted(c.state)
        else:
            left = shards.restore_own(directory, step, dict(self._state["dp"]), c.worker,
                                      c.workers)
            why = "was written by another number of workers"
        if left and self.is_chief:
            print(f"tfdist: warning: backup step {step} {why}: each worker's error feedback "
                  f"starts at zero", file=sys.stderr, flush=True)

    def save(self, wait=False):
        """Saves the state of now (every worker must call this under a synchronous multi-worker
        strategy). Asynchronous: the state is read into host memory (`snapshot.Snapshot`) and
        a background thread writes it while training goes on; at most one write is in flight
        (this waits for the one before), and `wait=True` returns once it is on disk.

        A save that fails (a full disk, a lost mount) is a `UsageError` in one line (raised by
        the next save or `wait()` when asynchronous): this step's partial files are removed and
        the previous backup stays as it was."""
        step = int(self.step.numpy())
        start = time.perf_counter()
        if step != self._in_flight and step != self._last_saved:
            self.wait()
            if self.asynchronous:
                if self._snapshot is None:
                    self._snapshot = Snapshot(self._state, live=not self.freeze)
                frozen = self._snapshot.freeze()
                self._in_flight = step
                self._writer.start(lambda: self._write_or_fail(step, frozen, background=True),
                                   what=f"step {step}")
            else:
                self._write_or_fail(step, self._state, background=False)
            self.stalls.append(time.perf_counter() - start)
        if wait:
            self.wait()

    def frozen_state(self):
        """The state of now read into host memory (`snapshot.Snapshot`): what `snapshot_files`
        writes. Every process calls it after the same step."""
        if self._snapshot is None:
            self._snapshot = Snapshot(self._state, live=not self.freeze)
        return self._snapshot.freeze()

    @property
    def sharded(self):
        """Whether this process holds state that no other replica holds: a ZeRO shard, or the
        errors of a compressed all-reduce."""
        return bool(self.shard_kinds)

    @property
    def shard_kinds(self):
        """The kinds of this process's own shards (`tfdist.parallel.zero.shards.shard_dir`)."""
        return [k for k, held in (("zero", self._zero), ("dp", self._dp)) if held is not None]

    def _save_shards(self, directory, step, state):
        """This replica's shards of `step` (`state`'s) into `directory`."""
        if self._zero is not None:
            c = self._zero.collectives
            shards.save_shard(directory, step, state["slots"], c.rank, c.size,
                              state["shard_weights"])
        if self._dp is not None:
            c = self._dp
            shards.save_shard(directory, step, state["dp"], c.worker, c.workers, kind="dp",
                              shared=c.shared)

    def snapshot_files(self, step, state, scratch):
        """This replica's own whole backup of `step` from `state` (`frozen_state`), as the
        backup dir would hold it (its checkpoint and index, its ZeRO shard, backup.json):
        {relative path: bytes}. Written through `scratch` (an empty directory: TF's ram://
        file system keeps it in memory), which is emptied after. No collective, no barrier."""
        try:
            self._save_shards(scratch, step, state)
            tf.train.CheckpointManager(tf.train.Checkpoint(
                optimizer=state["optimizer"], **state["parts"]), scratch, max_to_keep=1).save(
                checkpoint_number=step)
            with tf.io.gfile.GFile(os.path.join(scratch, "backup.json"), "w") as f:
                f.write(json.dumps(self._metadata(self.model)))
            files = {}
            for root, _, names in tf.io.gfile.walk(scratch):
                for name in names:
                    path = os.path.join(root, name)
                    with tf.io.gfile.GFile(path, "rb") as f:
                        files[path[len(scratch):].lstrip("/")] = f.read()
            return files
        finally:
            remove(scratch)

    def wait(self):
        """Returns once no write is in flight; raises the failed write's `UsageError`."""
        try:
            self._writer.wait(self.WRITE_TIMEOUT)
        except TimeoutError as e:
            raise UsageError(f"{e} into {self.backup_dir}; check the disk") from None
        finally:
            if not self._writer.busy:
                self._in_flight = None

    def describe(self):
        """One line: the saves, how long each blocked training, the host memory they held."""
        if not self.stalls:
            return "backups: none written"
        how = "in the background" if self.asynchronous else "synchronously"
        text = (f"backups: {len(self.stalls)} written {how}; training blocked "
                f"{statistics.median(self.stalls):.3f} s per save (median; longest "
                f"{max(self.stalls):.3f} s)")
        if self.asynchronous:
            text += f"; host copy {self.host_bytes / 2**20:,.1f} MiB"
        return text

    @property
    def host_bytes(self):
        """Host memory of one frozen copy of the state (asynchronous saves; 0 before the first)."""
        return self._snapshot.nbytes if self._snapshot is not None else 0

    def _write_or_fail(self, step, state, background):
        try:
            self._write(step, state, background)
        except (tf.errors.OpError, OSError, TimeoutError) as e:
            self._discard(step)
            before = (f"the backup of step {self._last_saved} is intact" if self._last_saved > 0
                      else "there is no earlier backup")
            raise UsageError(f"could not write the backup of step {step} into {self.backup_dir} "
                             f"({_first_line(e)}); {before}: free space or fix the directory, "
                             f"then run the same command to resume") from None
        self._last_saved = step

    def _write(self, step, state, background):
        """Writes `state` (the live variables, or their frozen values in the background) as
        backup `step`: this replica's ZeRO shard, then (the chief, once every shard is on disk)
        the checkpoint and the index that names it, the commit."""
        if self.sharded:
            self._save_shards(self.backup_dir, step, state)
            if not background:
                self.barrier()
            elif self.is_chief:  # (the others' writers are not in step with this thread)
                for kind in self.shard_kinds:
                    shards.wait_for_shards(self.backup_dir, step, self.WRITE_TIMEOUT, kind)
        if not (self.is_chief or (self.collective and not background)):
            return  # (frozen values need no collective: the chief alone writes them)
        # (a damaged index, said once by `restore`: the manager reads it again, and its first
        # save replaces it)
        quiet = _index_read_quietly() if self.index_unreadable else contextlib.nullcontext()
        with quiet:
            if background:  # a checkpoint of the frozen values has the live one's keys
                manager = tf.train.CheckpointManager(tf.train.Checkpoint(
                    optimizer=state["optimizer"], **state["parts"]), self._write_dir,
                    max_to_keep=self.keep)
            elif self._manager is None:
                self._manager = tf.train.CheckpointManager(self._ckpt, self._write_dir,
                                                           max_to_keep=self.keep)
        manager = manager if background else self._manager
        if self.is_chief and not tf.io.gfile.exists(self._meta_path):
            tf.io.gfile.makedirs(self.backup_dir)
            write_json_atomic(self._meta_path, self._metadata(self.model))
        self.save_checkpoint(manager, step)
        if self.sharded and self.is_chief:
            shards.prune(self.backup_dir, min(_step_of(p) for p in manager.checkpoints))
        if not self.is_chief:
            tf.io.gfile.rmtree(self._write_dir)
            self._manager = None

    def _discard(self, step):
        """Removes what a failed save of `step` left, unless the index already names it."""
        if not self.is_chief or any(_step_of(p) == step for p in self.backups()):
            return
        self._remove_step(step)

    def _remove_step(self, step):
        """Removes backup `step`'s files: its checkpoint's and its ZeRO shards."""
        for path in tf.io.gfile.glob(os.path.join(self.backup_dir, f"ckpt-{step}[._]*")):
            (tf.io.gfile.rmtree if tf.io.gfile.isdir(path) else tf.io.gfile.remove)(path)
        for kind in shards.KINDS:
            remove(shards.shard_dir(self.backup_dir, step, kind))

    def rollback(self, model, before):
        """Restores the newest backup of a step before `before` into `model` and removes every
        later one (a loss spike's rollback: `tfdist.callbacks.spike`); every process calls it.
        Returns that backup's step. A `UsageError` when there is none."""
        self.wait()
        kept = [p for p in self.backups() if _step_of(p) < before]
        if not kept:
            raise UsageError(f"a loss spike began at step {before} and no backup is older: set "
                             f"backup.every_steps below it, or train.spike=0")
        step = _step_of(kept[0])
        if self.is_chief:  # the later checkpoints, their ZeRO shards, and the index without them
            for later in {_step_of(p) for p in self.backups()} - {_step_of(p) for p in kept}:
                self._remove_step(later)
            tf.compat.v1.train.update_checkpoint_state(
                self.backup_dir, kept[0], all_model_checkpoint_paths=list(reversed(kept)))
        self.barrier()  # (the others read it once the chief has removed the later ones)
        self._manager = None  # (read again from the index at the next save)
        self._restore_from(kept[0])
        self._last_saved = step
        return step

    def remove(self):
        """Deletes the backup (the chief; `tfdist train` calls it once the model is saved)."""
        self.wait()
        if self.is_chief:
            remove(self.backup_dir)

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
        self.wait()  # the last backup on disk before the run ends
        done = self.total_steps is not None and int(self.step.numpy()) >= self.total_steps
        if done and self.delete_on_success:
            self.remove()


@contextlib.contextmanager
def _index_read_quietly():
    """TF reads a checkpoint index (`get_checkpoint_state`, a `CheckpointManager` made) and logs
    an unreadable one in two lines before it ignores it; `BackupAndRestore.restore` says so in
    one line instead."""
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


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


def remove(directory):
    if tf.io.gfile.exists(directory):  # local, but through gfile as every path here
        tf.io.gfile.rmtree(directory)
