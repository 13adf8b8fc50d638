"""`tfdist train`: config -> strategy -> data -> model -> fit.

    tfdist train --config=configs/gpt_nano.py --workdir=runs/nano
    tfdist train --config=configs/gpt_mini.py --strategy=mirrored --devices=2 \\
                 --config.train.steps=400 --config.model.dropout=0.1

A run writes into --workdir: `backup/` while it trains (removed at the end), `tensorboard/`,
`metrics.json` (per-step loss, lr, tokens/s; validation loss per epoch in nats/token and bits per
byte), `loss.png`, `tokenizer/` and `model.keras`. The data comes from a token store, prepared on
first use (`tfdist prepare` does it beforehand, in parallel). Run the same command again after a
crash and it resumes at the exact step.
"""
import contextlib
import os
import sys

from absl import flags
from ml_collections import config_flags

from tfdist import cli, early, strategies  # (the registry: the plugins' options join the schema)
from tfdist.lock import WorkdirLock, finished, prepare_workdir

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = cli.define_config_flag(
    "config", os.path.join(_REPO, "configs", "gpt_nano.py"),
    "Config file (configs/*.py); override any key with --config.<section>.<key>=value.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default runs/<config name>).")
_STRATEGY = flags.DEFINE_string("strategy", None, "Strategy name; overrides config.strategy.name.")
_DEVICES = flags.DEFINE_integer("devices", None, "Mirrored on CPU: logical CPU devices "
                                "(overrides config.strategy.devices).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a finished run in --workdir.")
_PREPARE_ONLY = flags.DEFINE_bool(
    "prepare_only", False, "Check the config, prepare the dataset and the workdir (applying "
    "--overwrite), then exit without training. `tfdist launch` runs this once before it starts "
    "the workers.")



def resolve_config():
    """The config from flags, with --strategy / --devices applied, validated."""
    from tfdist import config as config_lib

    c = _CONFIG.value
    with c.unlocked():
        if _STRATEGY.value is not None:
            c.strategy.name = _STRATEGY.value
        if _DEVICES.value is not None:
            c.strategy.devices = _DEVICES.value
    return config_lib.validate(c)


def prepare(c, workdir, overwrite=False):
    """What must happen once per run, before any worker starts: the config, the strategy name and
    the layout are checked, the dataset is prepared, and `--overwrite` clears the workdir."""
    from tfdist.data import open_store
    from tfdist.layout import Layout

    plugin = strategies.get_class(c.strategy.name)
    Layout.from_config(c, plugin)
    sizes = [int(n) for n in os.environ.get("TFDIST_ELASTIC_SIZES", "").split(",") if n]
    Layout.check_sizes(c, plugin, sizes)  # an elastic launch: every size it may run at
    model_vocab(c, open_store(c.data))
    with WorkdirLock(workdir):  # a run on it now: refused here, before any worker starts
        prepare_workdir(workdir, c.backup.dir or os.path.join(workdir, "backup"), overwrite)


class Hooks:
    """The points where a test driver may change a run on purpose (`tools/faulty_train.py`
    injects faults and leaves out corrections through them). The defaults change nothing.
    Example:

        class NoBroadcast(Hooks):
            def strategy_callbacks(self, callbacks):
                return [cb for cb in callbacks if cb.name != "broadcast_from_root"]
        train(c, "runs/x", hooks=NoBroadcast())
    """

    #: names of `tfdist.compat.PATCHES` not to apply
    disable_patches = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "wrap_optimizer" in vars(cls):  # the hook before tfdist's own training step
            raise TypeError(f"{cls.__name__}.wrap_optimizer is never called: the training step "
                            f"(tfdist.step) reduces the gradients; override "
                            f"Hooks.reduction(strategy) instead")

    def model_seed(self, seed, strategy):
        """The seed of the model's initialisation (the data keeps the config's)."""
        return seed

    def reduction(self, strategy):
        """How the training step reduces gradients over the replicas (`tfdist.step`)."""
        return strategy.reduce_gradients

    def strategy_callbacks(self, callbacks):
        return callbacks

    def on_input(self, windows, input_context):
        """Called with each training input pipeline's `Windows` and `InputContext`."""

    def save_checkpoint(self, manager, step):
        """Writes backup `step` with its `tf.train.CheckpointManager` (maybe in the background)."""
        manager.save(checkpoint_number=step)

    def on_backup(self, backup):
        """Called with the run's `tfdist.callbacks.BackupAndRestore` once it is made."""


def train(c, workdir, overwrite=False, verbose="auto", extra_callbacks=(), hooks=None):
    """Runs training for config `c` into `workdir`. Returns a dict of results.

    `extra_callbacks` run after tfdist's own (after the backup of a step has been written).
    `hooks`: a `Hooks` (tests). The chief holds the workdir's lock (`tfdist.lock`) throughout.
    A preemption signal ends it with `tfdist.preemption.Preempted` (a SystemExit, status 75)
    once the backup of the step in progress is written.
    """
    hooks = hooks or Hooks()
    with contextlib.ExitStack() as held:  # the workdir's lock, the preemption signal handlers
        layout, strategy, data, model = _start(c, hooks)
        backup, log, start = _resume(c, workdir, held, overwrite, strategy, data, model, hooks)
        say = print if strategy.is_chief else (lambda *a, **k: None)
        _say_what_runs(c, layout, strategy, data, model, backup.backup_dir, start, say)
        callbacks = _callbacks(c, workdir, held, strategy, backup, log, start, extra_callbacks)
        t = c.train
        if start < t.steps:
            strategy.fit(model, _windows(c, data, "train", hooks), epochs=t.steps // t.steps_per_epoch,
                         steps_per_epoch=t.steps_per_epoch, initial_step=start,
                         callbacks=callbacks, validation_data=_windows(c, data, "val"),
                         validation_steps=t.eval_steps,
                         verbose=verbose if strategy.is_chief else 0,  # one progress per cluster
                         progress_every=t.log_every_steps,
                         strategy_callbacks=hooks.strategy_callbacks(strategy.callbacks()))
        else:  # the last epoch's validation is in metrics.json already (logged before the backup)
            log.set_model(model)
            log.on_train_end()
        return _finish(c, workdir, layout, strategy, model, backup, log, start, say)


def _start(c, hooks):
    """The layout judged, threads and devices set, the strategy built (a server task serves
    and ends here), the seed and precision set, the data opened, the model built for the layout
    with its optimizer and tfdist's training step. Returns (layout, strategy, data, model)."""
    import tensorflow as tf
    from tfdist import compat
    from tfdist.layout import Layout

    if hooks.disable_patches:
        compat.disable(*hooks.disable_patches)
    plugin = strategies.get_class(c.strategy.name)
    layout = Layout.from_config(c, plugin)  # the one judge of a layout (tfdist.layout)
    # Before anything initialises TF's runtime: thread pools, devices, then the strategy.
    tf.config.threading.set_intra_op_parallelism_threads(c.train.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(c.train.inter_op_threads)
    layout.split_cpu()
    strategy = strategies.from_config(c)
    strategy.serve()  # a task that only serves others (parameter server) ends here
    layout = Layout.from_config(c, plugin, replicas=strategy.num_replicas)
    devices = layout.place_devices()

    import keras
    from tfdist.data import open_store
    from tfdist.models.gpt import loss_fn
    from tfdist.optimizers import make_optimizer
    from tfdist.step import TrainStep

    t = c.train
    say = print if strategy.is_chief else (lambda *a, **k: None)
    _apply_recommended(c, strategy, say)
    from tfdist import host
    for key, value, why in host.recommendations(
            c, device="gpu" if tf.config.list_physical_devices("GPU") else "cpu"):
        say(f"tfdist: recommended here: --config.{key}={str(value).lower()}: {why} (not "
            f"applied: it changes the numbers)")
    if t.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(hooks.model_seed(c.seed, strategy))
    keras.mixed_precision.set_dtype_policy(t.precision)
    data = open_store(c.data, progress=strategy.is_chief)
    model_vocab(c, data)
    with strategy.scope():
        model = layout.build_model(c.model, devices)
        model.compile(optimizer=make_optimizer(t, t.steps), loss=loss_fn(),
                      jit_compile=t.jit_compile, steps_per_execution=t.steps_per_execution)
        TrainStep(model, strategy, layout, clipnorm=t.grad_clip, reduce=hooks.reduction(strategy))
    return layout, strategy, data, model


def _windows(c, data, split, hooks=None):
    from tfdist.data import Windows
    t = c.train
    if split == "train":
        return Windows(data.split("train"), c.model.block_size, t.batch_size, seed=c.seed,
                       on_input=hooks.on_input)
    return Windows(data.split("val"), c.model.block_size, t.batch_size, seed=c.seed + 1)


def _resume(c, workdir, held, overwrite, strategy, data, model, hooks):
    """The workdir readied (the chief holds its lock), the backup restored: (backup callback,
    training log, the step to start at)."""
    from tfdist import callbacks as cb
    from tfdist.errors import UsageError

    t = c.train
    backup_dir = c.backup.dir or os.path.join(workdir, "backup")
    if strategy.is_chief:  # one run per workdir: before anything there is read or removed
        held.enter_context(WorkdirLock(workdir))
    if strategy.is_chief or not overwrite:  # after every input has been checked; only the
        prepare_workdir(workdir, backup_dir, overwrite)  # chief deletes
    backup = cb.BackupAndRestore(  # removed at the end, once model.keras is written
        backup_dir, every_steps=c.backup.every_steps, total_steps=t.steps, keep=c.backup.keep,
        delete_on_success=False, is_chief=strategy.is_chief,
        save_checkpoint=hooks.save_checkpoint, barrier=strategy.barrier,
        asynchronous=c.backup.asynchronous,
        worker_index=strategy.worker_index, collective=strategy.collective_checkpoints,
        signature={"model": c.model.to_dict(), "data": {
            "store": data.manifest["source"], "fingerprint": data.fingerprint, "seed": c.seed,
            "batch_size": t.batch_size, "grad_accum_steps": t.grad_accum_steps}})
    hooks.on_backup(backup)  # (it holds the unsplit GPT's names: it restores into any layout)
    # With --overwrite the chief deletes the old backup; the other workers must not read it
    # meanwhile. Every worker starts at step 0 then (the chief's deletion precedes its first step,
    # which no worker can finish without it).
    start = backup.restore(model) if c.backup.enabled and not overwrite else 0
    if start > t.steps:
        raise UsageError(f"the backup in {backup_dir} is at step {start}, beyond train.steps="
                         f"{t.steps}; raise train.steps or remove the backup")
    log = cb.TrainingLog(workdir, tokens_per_step=t.batch_size * c.model.block_size,
                         initial_step=start, total_steps=t.steps, is_chief=strategy.is_chief,
                         log_every_steps=t.log_every_steps,
                         flush_every_steps=c.backup.every_steps if c.backup.enabled else 0,
                         val_bytes_per_token=data.split("val").bytes_per_token,
                         batch={"global_batch": t.batch_size,
                                "replicas": strategy.num_replicas})
    if strategy.is_chief:
        save_tokenizer(data, workdir)
    return backup, log, start


def _say_what_runs(c, layout, strategy, data, model, backup_dir, start, say):
    say(f"tfdist: {strategy.describe()}")
    say(f"tfdist: layout: {layout.describe()}")
    if layout.split:
        say(f"tfdist: {model.describe()}")
    if layout.zero:
        from tfdist.zero import describe
        say(f"tfdist: {describe(model.optimizer)}")
    say(f"tfdist: model {model.num_params():,} parameters; {data.describe()}")
    if start == c.train.steps:  # killed after the last backup, before model.keras: only that is left
        say(f"tfdist: the backup in {backup_dir} is at the final step {start}; training is done, "
            f"finishing the run")
    elif start:
        say(f"tfdist: resuming from {backup_dir} at step {start} of {c.train.steps}")


def _callbacks(c, workdir, held, strategy, backup, log, start, extra_callbacks):
    """tfdist's callbacks, in order: the log, the backup, the caller's, a profiled step, and the
    preemption handler last (the others see the step first)."""
    from tfdist import callbacks as cb
    from tfdist.preemption import Preemption

    callbacks = [log] + ([backup] if c.backup.enabled else []) + list(extra_callbacks)
    if start < c.train.profile_step:  # after the log, which counts the step
        callbacks.append(cb.ProfileStep(c.train.profile_step, os.path.join(
            workdir, "profile", f"worker-{strategy.worker_index}"), log))
    if c.backup.enabled and c.backup.preemption_signals.strip():
        def save_now():  # every process calls it, after the same step
            log.flush()
            backup.save(wait=True)  # (after the write in flight: within the grace period)
            strategy.barrier()  # none exits (and has a launcher stop the rest) before all saved
            return int(backup.step.numpy())
        callbacks.append(held.enter_context(Preemption(
            c.backup.preemption_signals.split(","), save=save_now, agree=strategy.any_process,
            grace_secs=c.backup.grace_secs)))
    return callbacks


def _finish(c, workdir, layout, strategy, model, backup, log, start, say):
    """The memory report of a split model, the result, and on the chief `model.keras` (then the
    backup is removed)."""
    from tfdist.models.state import plain_gpt

    if layout.split:
        for row in model.memory_report(layout.batch // layout.dp):
            measured = row["measured_peak_bytes"]
            where = f"stage {row['stage']}" + (f" shard {row['shard']}" if layout.tp > 1 else "")
            say(f"tfdist: {where} on {row['device']}: {row['params']:,} parameters, "
                f"estimated peak {row['total_bytes'] / 2**20:,.1f} MiB; measured peak "
                + (f"{measured / 2**20:,.1f} MiB ({row['measured_scope']})" if measured is not None
                   else "not available (TF keeps no memory stats for this device)"))
    if c.backup.enabled:
        say(f"tfdist: {backup.describe()}")
    last_eval = (log.history["evals"] or [{}])[-1]
    result = {"steps_run": log.step - start, "final_step": log.step,
              "val_loss": last_eval.get("loss"), "val_bits_per_byte": last_eval.get("bits_per_byte"),
              "tokens_per_sec": log.steady_tokens_per_sec(), "workdir": workdir}
    from tfdist import zero3
    if zero3.of(model):  # ZeRO-3: every process gathers the whole model (a collective), into
        zero3.of(model).materialize()  # local variables (outside the scope: none is mirrored)
    if strategy.is_chief:
        # The plain GPT (tensor-parallel shards joined): it samples on any device.
        plain_gpt(model).save(os.path.join(workdir, "model.keras"))
        if c.backup.enabled and c.backup.delete_on_success:
            backup.remove()  # only now: a kill before model.keras was written resumes from it
        say(f"tfdist: done: {result['steps_run']} steps run (step {log.step} of {c.train.steps}), "
            f"validation loss {result['val_loss']:.4f} nats/token"
            + (f" ({result['val_bits_per_byte']:.4f} bits/byte), "
               if result["val_bits_per_byte"] is not None else " (bits/byte unknown), ") +
            f"peak RSS {peak_rss_mib():,.0f} MiB, "
            f"{result['tokens_per_sec']:,.0f} tokens/s; model saved to {workdir}/model.keras")
    return result


def model_vocab(c, data):
    """Sets model.vocab_size from the store's tokenizer when it is 0; a smaller one contradicts
    the tokenizer (its ids would fall outside the embedding)."""
    if c.model.vocab_size == 0:
        c.model.vocab_size = data.vocab_size
    elif c.model.vocab_size < data.vocab_size:
        from tfdist.errors import UsageError
        raise UsageError(f"model.vocab_size ({c.model.vocab_size}) is smaller than the tokenizer's "
                         f"vocabulary ({data.vocab_size}, {data.tokenizer_config['kind']}); set it "
                         f"to 0 (follow the tokenizer) or at least {data.vocab_size}")


def save_tokenizer(data, workdir):
    """Copies the store's tokenizer into <workdir>/tokenizer, so `tfdist sample` can decode."""
    import json
    import tensorflow as tf
    from tfdist.data import store
    out = os.path.join(workdir, "tokenizer")
    tf.io.gfile.makedirs(out)
    config = data.tokenizer_config
    if config.get("file"):
        tf.io.gfile.copy(os.path.join(data.dir, config["file"]), os.path.join(out, config["file"]),
                         overwrite=True)
    store.write_atomic(os.path.join(out, "config.json"), json.dumps(config))


def peak_rss_mib():
    """This process's peak resident memory (MiB): VmHWM of its own address space. (ru_maxrss
    would also count the parent it was forked from: Linux keeps that high-water mark across
    exec.)"""
    try:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):  # not Linux
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _apply_recommended(c, strategy, say):
    """The strategy's recommended config values (TPU: bfloat16, several steps per execution),
    where the config still has tfdist's defaults."""
    from tfdist import config as config_lib
    defaults = config_lib.default_config()
    for key, value in strategy.recommended.items():
        section, name = key.split(".")
        if c[section][name] != defaults[section][name]:
            continue  # the user chose
        if name == "steps_per_execution":  # must divide the epoch
            value = max(d for d in range(1, value + 1) if c.train.steps_per_epoch % d == 0)
        c[section][name] = value
        say(f"tfdist: {strategy.name}: {key}={value} (recommended; set it to override)")


def main(argv):
    del argv
    c = resolve_config()
    workdir = _WORKDIR.value or os.path.join("runs", os.path.splitext(
        os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"])))[0])
    if _PREPARE_ONLY.value:
        prepare(c, workdir, overwrite=_OVERWRITE.value)
        print(f"tfdist: prepared {workdir} (dataset ready, config checked)")
        return
    backup_dir = c.backup.dir or os.path.join(workdir, "backup")
    if os.environ.get("TFDIST_RESTART_COUNT", "0") != "0" and finished(workdir, backup_dir):
        # A launcher's restart of a group that had finished (it was stopped on its way out,
        # e.g. to resize): nothing is left to run.
        print(f"tfdist: {workdir} holds the finished run (model.keras); nothing left to resume")
        return
    train(c, workdir, overwrite=_OVERWRITE.value)


def run(argv=None):
    early.hold(["USR1"])  # a stop asked for while TF starts: honoured at the first step
    cli.run(main, argv or sys.argv)


if __name__ == "__main__":
    run()
