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

from tfdist import cli
from tfdist.lock import WorkdirLock
from tfdist.preemption import Preemption

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

_OUTPUTS = ("model.keras", "metrics.json", "loss.png", "tensorboard", "backup", "tokenizer")


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


def prepare_workdir(workdir, backup_dir, overwrite):
    """Refuses to clobber a finished run unless --overwrite; a run with a backup is resumed."""
    import tensorflow as tf
    from tfdist.errors import UsageError

    finished = tf.io.gfile.exists(os.path.join(workdir, "model.keras"))
    has_backup = tf.io.gfile.exists(backup_dir) and tf.train.latest_checkpoint(backup_dir)
    if overwrite:
        for name in _OUTPUTS:
            p = os.path.join(workdir, name)
            if tf.io.gfile.isdir(p):
                tf.io.gfile.rmtree(p)
            elif tf.io.gfile.exists(p):
                tf.io.gfile.remove(p)
        if tf.io.gfile.exists(backup_dir):
            tf.io.gfile.rmtree(backup_dir)
    elif finished and not has_backup:
        raise UsageError(f"{workdir} already holds a finished run (model.keras); pass --overwrite "
                         f"to replace it or choose another --workdir")


def prepare(c, workdir, overwrite=False):
    """What must happen once per run, before any worker starts: the config and the strategy name
    are checked, the dataset is prepared, and `--overwrite` clears the workdir."""
    from tfdist import strategies
    from tfdist.data import open_store

    strategies.get_class(c.strategy.name)
    model_vocab(c, open_store(c.data))
    with WorkdirLock(workdir):  # a run on it now: refused here, before any worker starts
        prepare_workdir(workdir, c.backup.dir or os.path.join(workdir, "backup"), overwrite)


class Hooks:
    """The points where a test driver may change a run on purpose (`tests/faulty_train.py`
    injects faults and leaves out corrections through them). The defaults change nothing.

    Example:

        class NoBroadcast(Hooks):
            def strategy_callbacks(self, callbacks):
                return [cb for cb in callbacks if "Broadcast" not in type(cb).__name__]
        train(c, "runs/x", hooks=NoBroadcast())
    """

    #: names of `tfdist.compat.PATCHES` not to apply
    disable_patches = ()

    def model_seed(self, seed, strategy):
        """The seed of the model's initialisation (the data keeps the config's)."""
        return seed

    def wrap_optimizer(self, optimizer, strategy, zero_stage=0):
        return strategy.wrap_optimizer(optimizer, zero_stage)

    def strategy_callbacks(self, callbacks):
        return callbacks

    def on_input(self, windows, input_context):
        """Called with each training input pipeline's `Windows` and `InputContext`."""

    def save_checkpoint(self, manager, step):
        """Writes backup `step` with its `tf.train.CheckpointManager`."""
        manager.save(checkpoint_number=step)


def train(c, workdir, overwrite=False, verbose="auto", extra_callbacks=(), hooks=None):
    """Runs training for config `c` into `workdir`. Returns a dict of results.

    `extra_callbacks` run after tfdist's own (after the backup of a step has been written).
    `hooks`: a `Hooks` (tests). The chief holds the workdir's lock (`tfdist.lock`) throughout.
    A preemption signal ends it with `tfdist.preemption.Preempted` (a SystemExit, status 75)
    once the backup of the step in progress is written.
    """
    with contextlib.ExitStack() as held:  # the workdir's lock, the preemption signal handlers
        return _train(c, workdir, held, overwrite, verbose, extra_callbacks, hooks or Hooks())


def _train(c, workdir, held, overwrite, verbose, extra_callbacks, hooks):
    import tensorflow as tf
    from tfdist import strategies
    from tfdist.errors import UsageError
    from tfdist.strategies.base import configure_logical_cpus

    if hooks.disable_patches:
        from tfdist import compat
        compat.disable(*hooks.disable_patches)

    # Before anything initialises TF's runtime: thread pools, then the strategy (which may split
    # the CPU into logical devices).
    tf.config.threading.set_intra_op_parallelism_threads(c.train.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(c.train.inter_op_threads)
    p, tp = c.pipeline, c.tensor.parallel
    pipelined = p.stages > 1 or p.microbatches > 1
    split = pipelined or tp > 1  # the GPT laid out over this process's devices
    plugin = strategies.get_class(c.strategy.name)
    if split and not plugin.supports_pipeline:
        raise UsageError(f"strategy {c.strategy.name} cannot run a pipeline or tensor parallelism "
                         f"(pipeline.stages / pipeline.microbatches / tensor.parallel); leave them "
                         f"at 1 or pick another strategy")
    if c.zero.stage and plugin.zero_collectives is None:
        raise UsageError(f"strategy {c.strategy.name} cannot shard the optimizer (zero.stage="
                         f"{c.zero.stage}); use horovod or multi_worker_mirrored, or set "
                         f"zero.stage=0")
    if c.train.grad_accum_steps > 1 and not plugin.supports_grad_accumulation:
        raise UsageError(f"train.grad_accum_steps > 1 does not work with strategy {plugin.name} "
                         f"on Keras 3.15 (keras-team/keras#20582: the accumulation's update calls "
                         f"merge_call inside a cond); set it to 1, or use horovod")
    if tp > 1 and plugin.uses_local_devices:
        raise UsageError(f"tensor parallelism and the {plugin.name} strategy both want this "
                         f"process's devices; combine tensor.parallel with one replica per process "
                         f"(horovod or multi_worker_mirrored)")
    devices_needed, gpus = p.stages * tp, len(tf.config.list_physical_devices("GPU"))
    if devices_needed > 1 and not p.devices and gpus < devices_needed:
        if gpus:
            raise UsageError(f"pipeline.stages x tensor.parallel = {p.stages} x {tp} needs "
                             f"{devices_needed} devices and this process sees {gpus} GPU(s); "
                             f"lower them or give pipeline.devices")
        if plugin.uses_local_devices:
            raise UsageError(f"pipeline stages and the {plugin.name} strategy both want this "
                             f"machine's devices; combine a pipeline with one replica per process "
                             f"(horovod or multi_worker_mirrored)")
        configure_logical_cpus(devices_needed)  # one logical CPU device per stage and shard
    strategy = strategies.from_config(c)
    strategy.serve()  # a task that only serves others (parameter server) ends here

    import keras
    from tfdist import callbacks as cb
    from tfdist.data import Windows, open_store
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.models.pipeline import Pipeline
    from tfdist.models.state import plain_gpt
    from tfdist.optimizers import make_optimizer

    t = c.train
    say = print if strategy.is_chief else (lambda *a, **k: None)
    _apply_recommended(c, strategy, say)
    if t.jit_compile and not strategy.supports_jit_compile:
        raise UsageError(f"train.jit_compile=True does not work with strategy {strategy.name} on "
                         f"TF 2.21 (cross-device resource access); set it to False")
    if t.batch_size % strategy.num_replicas:
        raise UsageError(f"train.batch_size ({t.batch_size}) must be divisible by the "
                         f"{strategy.num_replicas} replicas of strategy {strategy.name}")
    if t.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(hooks.model_seed(c.seed, strategy))
    keras.mixed_precision.set_dtype_policy(t.precision)

    data = open_store(c.data, progress=strategy.is_chief)
    model_vocab(c, data)
    train_windows = Windows(data.split("train"), c.model.block_size, t.batch_size, seed=c.seed,
                            on_input=hooks.on_input)
    val_windows = Windows(data.split("val"), c.model.block_size, t.batch_size, seed=c.seed + 1)

    per_replica = t.batch_size // strategy.num_replicas
    if per_replica % p.microbatches:
        raise UsageError(f"pipeline.microbatches ({p.microbatches}) must divide the batch of each "
                         f"replica ({per_replica} = train.batch_size {t.batch_size} / "
                         f"{strategy.num_replicas} replica(s))")

    with strategy.scope():
        model = GPT.from_model_config(c.model)
        if split:
            model = Pipeline(model, stages=p.stages, microbatches=p.microbatches,
                             tensor_parallel=tp, schedule=p.schedule,
                             layers_per_stage=[int(x) for x in p.layers_per_stage.split(",")]
                             if p.layers_per_stage else None,
                             devices=p.devices.split(",") if p.devices else None,
                             recompute=p.recompute)
        model.build()
        optimizer = hooks.wrap_optimizer(make_optimizer(t, t.steps), strategy, c.zero.stage)
        model.compile(optimizer=optimizer, loss=loss_fn(), jit_compile=t.jit_compile,
                      steps_per_execution=t.steps_per_execution)
        optimizer.build(model.trainable_variables)
    if c.zero.stage:
        from tfdist.zero import describe
        say(f"tfdist: {describe(optimizer)}")

    backup_dir = c.backup.dir or os.path.join(workdir, "backup")
    if strategy.is_chief:  # one run per workdir: before anything there is read or removed
        held.enter_context(WorkdirLock(workdir))
    if strategy.is_chief or not overwrite:  # after every input has been checked; only the
        prepare_workdir(workdir, backup_dir, overwrite)  # chief deletes
    backup = cb.BackupAndRestore(  # removed below, once model.keras is written
        backup_dir, every_steps=c.backup.every_steps, total_steps=t.steps, keep=c.backup.keep,
        delete_on_success=False, is_chief=strategy.is_chief,
        save_checkpoint=hooks.save_checkpoint, barrier=strategy.barrier,
        worker_index=strategy.worker_index, collective=strategy.collective_checkpoints,
        signature={"model": c.model.to_dict(), "data": {
            "store": data.manifest["source"], "fingerprint": data.fingerprint, "seed": c.seed,
            "batch_size": t.batch_size, "grad_accum_steps": t.grad_accum_steps}})
    # (the backup holds the unsplit GPT's names: it restores into any layout)
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
                         val_bytes_per_token=data.split("val").bytes_per_token)
    if strategy.is_chief:
        save_tokenizer(data, workdir)
    say(f"tfdist: {strategy.describe()}")
    if split:
        say(f"tfdist: {model.describe()}")
    say(f"tfdist: model {model.num_params():,} parameters; {data.describe()}")
    if start == t.steps:  # killed after the last backup, before model.keras: only that is left
        say(f"tfdist: the backup in {backup_dir} is at the final step {start}; training is done, "
            f"finishing the run")
    elif start:
        say(f"tfdist: resuming from {backup_dir} at step {start} of {t.steps}")

    callbacks = [log] + ([backup] if c.backup.enabled else []) + list(extra_callbacks)
    if start < t.profile_step:  # after the log, which counts the step
        callbacks.append(cb.ProfileStep(t.profile_step, os.path.join(
            workdir, "profile", f"worker-{strategy.worker_index}"), log))
    if c.backup.enabled and c.backup.preemption_signals.strip():  # last: the others see the step
        def save_now():  # every process calls it, after the same step
            log.flush()
            backup.save()
            strategy.barrier()  # none exits (and has a launcher stop the rest) before all saved
            return int(backup.step.numpy())
        callbacks.append(held.enter_context(Preemption(
            c.backup.preemption_signals.split(","), save=save_now, agree=strategy.any_process,
            grace_secs=c.backup.grace_secs)))
    if start < t.steps:
        strategy.fit(model, train_windows, epochs=t.steps // t.steps_per_epoch,
                     steps_per_epoch=t.steps_per_epoch, initial_step=start, callbacks=callbacks,
                     validation_data=val_windows, validation_steps=t.eval_steps,
                     verbose=verbose if strategy.is_chief else 0,  # one progress bar per cluster
                     strategy_callbacks=hooks.strategy_callbacks(strategy.callbacks()))
    else:  # the last epoch's validation is in metrics.json already (logged before the backup)
        log.set_model(model)
        log.on_train_end()

    if split:
        for row in model.memory_report(per_replica):
            measured = row["measured_peak_bytes"]
            where = f"stage {row['stage']}" + (f" shard {row['shard']}" if tp > 1 else "")
            say(f"tfdist: {where} on {row['device']}: {row['params']:,} parameters, "
                f"estimated peak {row['total_bytes'] / 2**20:,.1f} MiB; measured peak "
                + (f"{measured / 2**20:,.1f} MiB ({row['measured_scope']})" if measured is not None
                   else "not available (TF keeps no memory stats for this device)"))
    last_eval = (log.history["evals"] or [{}])[-1]
    result = {"steps_run": log.step - start, "final_step": log.step,
              "val_loss": last_eval.get("loss"), "val_bits_per_byte": last_eval.get("bits_per_byte"),
              "tokens_per_sec": log.steady_tokens_per_sec(), "workdir": workdir}
    if strategy.is_chief:
        # The plain GPT (tensor-parallel shards joined): it samples on any device.
        plain_gpt(model).save(os.path.join(workdir, "model.keras"))
        if c.backup.enabled and c.backup.delete_on_success:
            backup.remove()  # only now: a kill before model.keras was written resumes from it
        say(f"tfdist: done: {result['steps_run']} steps run (step {log.step} of {t.steps}), "
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
    train(c, workdir, overwrite=_OVERWRITE.value)


def run(argv=None):
    cli.run(main, argv or sys.argv)


if __name__ == "__main__":
    run()
