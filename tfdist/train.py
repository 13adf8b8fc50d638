"""A training run, top to bottom: config -> layout -> strategy -> data -> model -> fit ->
model.keras.

`tfdist train` (its command line: `tfdist/cli/train.py`) calls `train(config, workdir)`:

1. `_start`: the layout judged, threads and devices set, the strategy built (a server task serves
   and ends there), the seed and precision set, the data opened, the model built for the layout,
   compiled, and tfdist's training step set as its `train_step`;
2. `_resume`: the workdir readied (the chief holds its lock), the newest backup restored, the log
   opened at the step it holds;
3. `_say_what_runs`: what runs, said once every input has been checked;
4. `_callbacks` and the strategy's `fit` from that step;
5. `_finish`: `model.keras` written by the chief, then the backup removed.

Each stage reads and fills one `Run`, the record of the run. A run writes into its workdir:
`backup/` while it trains (removed at the end), `tensorboard/`, `metrics.json` (per-step loss,
lr, tokens/s; validation loss per epoch in nats/token and bits per byte), `loss.png`,
`tokenizer/` and `model.keras`. Run the same command again after a crash and it resumes at the
exact step.

Usage (not run as a doctest: a run sets TensorFlow's thread pools and devices, which a process
does once, before its first op; `tests/test_cli.py` runs it):

    from tfdist import config
    from tfdist.train import train
    c = config.default_config()
    c.train.update(steps=4, steps_per_epoch=2)
    result = train(config.validate(c), "runs/small")  # {"final_step": 4, "val_loss": ...}
"""
import contextlib
import dataclasses
import json
import os
import resource

import keras
import tensorflow as tf

from tfdist import callbacks as cb
from tfdist import compat, strategies
from tfdist import config as config_lib
from tfdist.data import Windows, open_store, store
from tfdist.errors import UsageError
from tfdist.models import huggingface
from tfdist.models.gpt import loss_fn
from tfdist.models.state import plain_gpt
from tfdist.optimizers import make_optimizer
from tfdist.parallel import zero
from tfdist.parallel.dp import islands
from tfdist.parallel.layout import Layout
from tfdist.plan import auto, probe
from tfdist.runtime import cluster, cpu
from tfdist.runtime.lock import WorkdirLock, prepare_workdir
from tfdist.runtime.preemption import Preemption
from tfdist.step import TrainStep


def backup_dir(c, workdir):
    """Where the run's backup lives: `backup.dir`, or `<workdir>/backup`."""
    return c.backup.dir or os.path.join(workdir, "backup")


class Hooks:
    """The points where a test driver may change a run on purpose (`tools/faults/faulty_train.py`
    injects faults and leaves out corrections through them). The defaults change nothing.
    Example:

        class NoBroadcast(Hooks):
            def strategy_callbacks(self, callbacks):
                return [cb for cb in callbacks if cb.name != "broadcast_from_root"]
        train(c, "runs/x", hooks=NoBroadcast())
    """

    #: names of `tfdist.compat.PATCHES` not to apply
    disable_patches = ()
    #: options of the ZeRO stage (`tfdist.parallel.zero.make`): `skip` leaves out a collective
    zero_options = {}

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

    def on_memory(self, snapshots):
        """Called with the run's `MemorySnapshots` callback, when the run keeps snapshots."""

    def save_checkpoint(self, manager, step):
        """Writes backup `step` with its `tf.train.CheckpointManager` (maybe in the background)."""
        manager.save(checkpoint_number=step)

    def on_backup(self, backup):
        """Called with the run's `tfdist.callbacks.BackupAndRestore` once it is made (before its
        first save)."""

    def on_offload(self, offload):
        """Called with the run's `tfdist.parallel.zero.offload.Offload` once it is made."""


@dataclasses.dataclass
class Run:
    """The record of one training run: what it was given, and what each stage of `train` adds."""

    config: object  # the validated config
    workdir: str
    hooks: Hooks
    layout: Layout = None  # judged with the strategy's replicas
    strategy: object = None  # the plugin (tfdist.strategies)
    data: object = None  # the token store
    model: object = None  # compiled, with tfdist's step as its train_step
    backup: cb.BackupAndRestore = None
    log: cb.TrainingLog = None
    start: int = 0  # the step it starts (or resumed) at
    rollbacks: list = dataclasses.field(default_factory=list)  # loss spikes' (callbacks.spike)
    undone: int = 0  # steps run, then undone by a rollback
    offload: object = None  # ZeRO-Offload's store of this process (tfdist.parallel.zero.offload)
    keepers: dict = None  # this process's keepers, when its state goes to memory too
    memory: object = None  # its snapshots in memory (tfdist.callbacks.memory)
    from_memory: tuple = None  # (the plan, the disk backup's step) of a resume from memory
    notes: list = dataclasses.field(default_factory=list)  # said once the inputs are checked
    overwrite: bool = False  # --overwrite: the workdir's earlier run is not resumed
    decision: object = None  # config.layout=auto's (tfdist.plan.auto.Decision)

    @property
    def backup_dir(self):
        return backup_dir(self.config, self.workdir)

    def say(self, *args, **kwargs):
        """Prints on the chief only: one voice per cluster."""
        if self.strategy is None or self.strategy.is_chief:
            print(*args, **kwargs)


# Callbacks this process's launcher adds to every run in it: factories `f(c, workdir)`
# (tfdist/launch/ray_train.py: each Ray Train worker reports to Ray, whether it runs `tfdist
# train` or a program that calls `train`).
LAUNCHER_CALLBACKS = []


def train(c, workdir, overwrite=False, verbose="auto", extra_callbacks=(), hooks=None):
    """Runs training for config `c` into `workdir`. Returns a dict of results.

    `extra_callbacks` run after tfdist's own (after the backup of a step has been written), then
    those of `LAUNCHER_CALLBACKS`.
    `hooks`: a `Hooks` (tests). The chief holds the workdir's lock (`tfdist.runtime.lock`)
    throughout. A preemption signal ends it with `tfdist.runtime.preemption.Preempted` (a
    SystemExit, status 75) once the backup of the step in progress is written.
    """
    c = config_lib.validate(huggingface.apply_init_from(c))  # (its shape, from its config.json)
    place = islands.Place.here()
    if place.islands > 1:  # local-SGD islands: each island's run in a directory of its own
        workdir = os.path.join(workdir, f"island-{place.island}")
        tf.io.gfile.makedirs(workdir)
    run = Run(c, workdir, hooks or Hooks(), overwrite=overwrite)
    with contextlib.ExitStack() as held:  # the workdir's lock, the preemption signal handlers
        held.callback(lambda: run.offload and run.offload.close())
        _start(run)
        _resume(run, held, overwrite)
        if run.decision is not None and run.strategy.is_chief:
            auto.write(run.decision, workdir)
        _say_what_runs(run)
        callbacks = _callbacks(run, held, [*extra_callbacks, *(
            make(c, workdir) for make in LAUNCHER_CALLBACKS)])
        t, strategy = c.train, run.strategy
        watch = None
        if t.spike:  # loss-spike rollback (tfdist.callbacks.spike)
            watch = cb.SpikeWatch(t.spike, t.spike_steps, t.spike_window, run.start)
            callbacks = callbacks + [watch]
        if run.start >= t.steps:  # the last epoch's validation is in metrics.json already
            run.log.set_model(run.model)
            run.log.on_train_end()
        while run.start < t.steps:
            with _offload_errors(run):
                strategy.fit(run.model, _windows(run, "train"),
                             epochs=t.steps // t.steps_per_epoch,
                             steps_per_epoch=t.steps_per_epoch, initial_step=run.start,
                             callbacks=callbacks, validation_data=_windows(run, "val"),
                             validation_steps=t.eval_steps,
                             verbose=verbose if strategy.is_chief else 0,  # one progress
                             progress_every=t.log_every_steps,
                             strategy_callbacks=run.hooks.strategy_callbacks(
                                 strategy.callbacks()))
            if watch is None or watch.spike is None:
                break
            _roll_back(run, watch)
        return _finish(run)


def _roll_back(run, watch):
    """After a loss spike: back to the newest backup before it, the data order moved on by
    `train.spike_skip` batches from there, recorded (`tfdist.callbacks.spike`)."""
    t = run.config.train
    first, seen = watch.spike
    step = run.backup.rollback(run.model, before=first)
    record = {"step": step, "skip": t.spike_skip, "spike": [first, seen]}
    run.rollbacks.append(record)
    if run.strategy.is_chief:
        cb.spike.record_rollback(run.backup_dir, run.rollbacks)
    run.say(f"tfdist: {watch.describe()}; rolled back to the backup of step {step}, the data "
            f"order moved on by {t.spike_skip} batches from there", flush=True)
    run.log.rewind(step, record)
    watch.restart(step)
    run.undone += seen - run.start  # (the steps of this segment, run again from `step`)
    run.start = step


def prepare(c, workdir, overwrite=False, sizes=()):
    """What must happen once per run, before any worker starts (`tfdist launch` runs it through
    `tfdist train --prepare_only`): the config, the strategy name and the layout are checked (at
    every worker count of `sizes`, an elastic job's), the dataset is prepared, and `--overwrite`
    clears the workdir."""
    c = config_lib.validate(huggingface.apply_init_from(c))
    plugin = strategies.get_class(c.strategy.name)
    if c.layout == "auto":
        auto.check(plugin)
    Layout.from_config(c, plugin)
    Layout.check_sizes(c, plugin, sizes)
    islands.check_launch(c.dp.islands)  # (started as islands, as many as the config's)
    placed = os.environ.get("TFDIST_WORKER_HOSTS")  # (tfdist launch: each worker's host)
    if placed and plugin.dp_collectives is not None:
        from tfdist.parallel import dp
        from tfdist.parallel.dp.hosts import Hosts
        dp.Settings.from_config(c.dp).route(Hosts(tuple(placed.split(",")), 0))
    model_vocab(c, open_store(c.data))
    with WorkdirLock(workdir):  # a run on it now: refused here, before any worker starts
        prepare_workdir(workdir, backup_dir(c, workdir), overwrite)


def _start(run):
    """The layout judged, threads and devices set, the strategy built (a server task serves
    and ends here), the seed and precision set, the data opened, the model built for the layout
    with its optimizer, and tfdist's training step set as its `train_step`."""
    c, hooks = run.config, run.hooks
    if hooks.disable_patches:
        compat.disable(*hooks.disable_patches)
    plugin = strategies.get_class(c.strategy.name)
    if c.layout == "auto":
        auto.check(plugin)
    layout = Layout.from_config(c, plugin)  # the one judge of a layout (tfdist.parallel.layout)
    # Before anything initialises TF's runtime: thread pools, devices, then the strategy.
    tf.config.threading.set_intra_op_parallelism_threads(c.train.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(c.train.inter_op_threads)
    layout.split_cpu()
    run.strategy = strategy = strategies.from_config(c)
    strategy.serve()  # a task that only serves others (parameter server) ends here
    if c.layout == "auto":  # the layout keys chosen for this machine (tfdist.plan.auto)
        _auto_layout(run, plugin)
    run.layout = layout = Layout.from_config(c, plugin, replicas=strategy.num_replicas)
    devices = layout.place_devices()

    t = c.train
    run.notes += _apply_recommended(c, strategy)
    blocked = cpu.bf16_blocked() if t.precision == "mixed_bfloat16" else None
    if blocked and not tf.config.list_physical_devices("GPU"):
        raise UsageError(f"train.precision=mixed_bfloat16 cannot run here: {blocked}; unset "
                         f"ONEDNN_MAX_CPU_ISA (or set TF_ENABLE_ONEDNN_OPTS=0), or train in "
                         f"float32")
    if t.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(hooks.model_seed(c.seed, strategy))
    keras.mixed_precision.set_dtype_policy(t.precision)
    run.data = open_store(c.data, progress=strategy.is_chief)
    model_vocab(c, run.data)
    with strategy.scope():
        run.model = model = layout.build_model(c.model, devices)
        model.compile(optimizer=make_optimizer(t, t.steps), loss=loss_fn(),
                      jit_compile=t.jit_compile, steps_per_execution=t.steps_per_execution)
        run.offload = _offload(c, run.workdir, strategy)
        if run.offload is not None:
            hooks.on_offload(run.offload)
        TrainStep(model, strategy, layout, clipnorm=t.grad_clip,
                  reduce=hooks.reduction(strategy), zero_options=hooks.zero_options,
                  skip_nonfinite=t.skip_nonfinite, offload=run.offload).install()


def _auto_layout(run, plugin):
    """config.layout=auto: the layout planned for this run's replicas, this host and its
    measured rates, set in the config and said. A resumed run keeps the batches per update it
    started with (its steps and backups count them)."""
    c, strategy = run.config, run.strategy
    pinned = auto.pinned_keys(c)
    earlier = None if run.overwrite else auto.earlier(run.workdir)
    if earlier is not None:
        k = earlier["overrides"].get("train.grad_accum_steps", 1)
        if k != c.train.grad_accum_steps:
            pinned["train.grad_accum_steps"] = k
    run.decision = auto.choose(c, plugin, strategy.num_replicas, cluster.processes_here(),
                               machine=auto.measure(say=run.say), pinned=pinned)
    auto.apply(c, run.decision)
    config_lib.validate(c)
    run.notes += run.decision.lines()
    if earlier is not None and earlier["chosen"]["layout"] != run.decision.chosen.name:
        run.notes.append(f"layout=auto: planned again at this size: the run before ran "
                         f"{earlier['chosen']['describe']}")


def _offload(c, workdir, strategy):
    """This process's ZeRO-Offload (zero.offload), or None: its files in a directory of its own
    under zero.offload_dir (default <workdir>/offload)."""
    z = c.zero
    if z.offload == "none":
        return None
    base = z.offload_dir or os.path.join(workdir, "offload")
    where = zero.offload.directory(base, strategy.worker_index) if z.offload == "disk" else None
    return zero.offload.Offload(z.offload, where, subgroup=z.offload_subgroup,
                                prefetch=z.offload_prefetch)


@contextlib.contextmanager
def _offload_errors(run):
    """An offload store that failed during a step (a full disk): its one line, not TF's."""
    try:
        yield
    except tf.errors.OpError:
        failure = run.offload and run.offload.store.failure
        if failure:
            raise failure from None
        raise


def _windows(run, split):
    """The step-addressed batches of `split` ("train", or "val" with a seed of its own)."""
    c = run.config
    if split == "train":
        return Windows(run.data.split("train"), c.model.block_size, c.train.batch_size,
                       seed=c.seed, on_input=run.hooks.on_input,
                       accumulate=c.train.grad_accum_steps, skips=cb.spike.skips(run.rollbacks))
    return Windows(run.data.split("val"), c.model.block_size, c.train.batch_size, seed=c.seed + 1)


def _resume(run, held, overwrite):
    """The workdir readied (the chief holds its lock), the backup restored, the log opened at
    the step it holds."""
    c, strategy, data = run.config, run.strategy, run.data
    t = c.train
    if strategy.is_chief:  # one run per workdir: before anything there is read or removed
        held.enter_context(WorkdirLock(run.workdir))
    # after every input has been checked; only the chief deletes
    if strategy.is_chief or not overwrite:
        prepare_workdir(run.workdir, run.backup_dir, overwrite)
    run.backup = cb.BackupAndRestore(  # removed at the end, once model.keras is written
        run.backup_dir, every_steps=c.backup.every_steps, total_steps=t.steps,
        keep=c.backup.keep, delete_on_success=False, is_chief=strategy.is_chief,
        save_checkpoint=run.hooks.save_checkpoint, barrier=strategy.barrier,
        asynchronous=c.backup.asynchronous,
        worker_index=strategy.worker_index, collective=strategy.collective_checkpoints,
        signature={"model": c.model.to_dict(), "data": {
            "store": data.manifest["source"], "fingerprint": data.fingerprint, "seed": c.seed,
            "batch_size": t.batch_size, "grad_accum_steps": t.grad_accum_steps}})
    run.hooks.on_backup(run.backup)  # (it holds the unsplit GPT's names: any layout restores it)
    run.keepers = _keepers(c, strategy)
    # With --overwrite the chief deletes the old backup; the other workers must not read it
    # meanwhile. Every worker starts at step 0 then (the chief's deletion precedes its first step,
    # which no worker can finish without it).
    carried = []
    if c.backup.enabled and not overwrite:
        run.start, carried = _restore(run)
    if c.init_from and not run.start:  # (a resumed run has its own weights)
        huggingface.load_weights(run.model, huggingface.Checkpoint(c.init_from))
        run.notes.append(f"weights from the Hugging Face checkpoint in "
                         f"{huggingface.directory_of(c.init_from)} ({c.model.arch})")
    if run.start:  # the data order the run read (its loss spikes' skips)
        run.rollbacks = cb.spike.read_rollbacks(run.backup_dir)
    if run.start > t.steps:
        raise UsageError(f"the backup in {run.backup_dir} is at step {run.start}, beyond "
                         f"train.steps={t.steps}; raise train.steps or remove the backup")
    run.log = cb.TrainingLog(  # (an island's step: its part of the global batch)
        run.workdir, tokens_per_step=t.batch_size // c.dp.islands * c.model.block_size,
        initial_step=run.start,
        total_steps=t.steps, is_chief=strategy.is_chief, log_every_steps=t.log_every_steps,
        flush_every_steps=c.backup.every_steps if c.backup.enabled else 0,
        val_bytes_per_token=data.split("val").bytes_per_token,
        batch={"global_batch": t.batch_size, "replicas": strategy.num_replicas})
    run.log.carry(carried)  # (the steps metrics.json had not reached, from memory)
    if strategy.is_chief:
        save_tokenizer(data, run.workdir)


def _keepers(c, strategy):
    """This process's keepers (`tfdist launch` gives them) when its state goes to memory: a
    synchronous group (`Launch.recovery`), snapshots on (`backup.memory_every_steps`), no
    offload (its state is on disk already). Else None."""
    keepers = cluster.keepers()
    spec = type(strategy).launch
    if (keepers is None or not c.backup.enabled or not c.backup.memory_every_steps
            or spec is None or spec.recovery is not None or c.zero.offload != "none"):
        return None
    return keepers


def _restore(run):
    """The step to resume at, and the step records that came with it: from the keepers' memory
    when the launcher's plan (`tfdist.launch.recovery`) is at least as new as the newest disk
    backup, else from disk."""
    plan = cluster.recovery_plan() if run.keepers else None
    disk = run.backup.newest_step()
    if plan is None or plan["step"] < disk:
        return run.backup.restore(run.model), []
    rank, size = _rank(run)
    step, carried = cb.memory.restore(run.backup, run.model, plan, rank=rank, size=size,
                                      local=run.keepers["local"])
    run.from_memory = (plan, disk)
    return step, carried


def _rank(run):
    """(rank, size) of this process's state: its ZeRO shard's, or its worker's."""
    sharded = zero.of(run.model)
    if sharded is not None:
        return sharded.collectives.rank, sharded.collectives.size
    return run.strategy.worker_index, run.strategy.num_workers


def _say_what_runs(run):
    """What runs: the strategy, the layout, the model, the data, where it starts, and the notes
    (recommendations) gathered on the way. Said once every input has been checked, so that a run
    stopped by bad input prints its one error line and nothing before it."""
    c, layout, model, say = run.config, run.layout, run.model, run.say
    say(f"tfdist: {run.strategy.describe()}")
    say(f"tfdist: layout: {layout.describe()}")
    if layout.split:
        say(f"tfdist: {model.describe()}")
    if layout.zero:
        say(f"tfdist: {zero.of(model).describe()}")
    say(f"tfdist: model {model.num_params():,} parameters; {run.data.describe()}")
    sizes = getattr(model, "arch_sizes", None)  # (a GPT's, or a pipeline's)
    if sizes is not None:
        say(f"tfdist: {expected_memory(c, layout, sizes)}")
    for note in run.notes:
        say(f"tfdist: {note}")
    device = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
    probed = probe.cached_steps(c) if device == "cpu" else None  # (this host's, or None)
    for key, value, why in cpu.recommendations(c, probed, device=device):
        say(f"tfdist: recommended here: --config.{key}={str(value).lower()}: {why} (not "
            f"applied: it changes the numbers)")
    unmeasured = cpu.not_measured(c, device) if probed is None else None
    if unmeasured:
        say(f"tfdist: {unmeasured}")
    if run.start == c.train.steps:  # killed after the last backup, before model.keras
        say(f"tfdist: the backup in {run.backup_dir} is at the final step {run.start}; training "
            f"is done, finishing the run")
    elif run.from_memory:
        plan, disk = run.from_memory
        keepers = sorted({a for addresses in plan["sources"].values() for a in addresses})
        say(f"tfdist: resuming from memory:{','.join(keepers)} at step {run.start} of "
            f"{c.train.steps} (the keepers' snapshots"
            + (", each replica's shard" if plan["sharded"] else "")
            + f"; the newest disk backup is at step {disk})")
    elif run.start:
        say(f"tfdist: resuming from {run.backup_dir} at step {run.start} of {c.train.steps}")


def _callbacks(run, held, extra_callbacks):
    """tfdist's callbacks, in order: the log, the backup, the caller's, a profiled step, and the
    preemption handler last (the others see the step first)."""
    c, strategy, backup, log = run.config, run.strategy, run.backup, run.log
    callbacks = [log] + ([backup] if c.backup.enabled else [])
    if run.keepers:  # after the backup, whose step it reads
        rank, size = _rank(run)
        run.memory = cb.memory.MemorySnapshots(
            backup, run.keepers, rank=rank, size=size, every=c.backup.memory_every_steps,
            peer_every=c.backup.peer_every_steps, accumulate=c.train.grad_accum_steps, log=log)
        cluster.before_hard_exit(lambda: run.memory.wait(timeout=10))
        run.hooks.on_memory(run.memory)
        held.callback(run.memory.close)
        callbacks.append(run.memory)
    callbacks += list(extra_callbacks)
    if run.start < c.train.profile_step:  # after the log, which counts the step
        callbacks.append(cb.ProfileStep(c.train.profile_step, os.path.join(
            run.workdir, "profile", f"worker-{strategy.worker_index}"), log))
    if c.backup.enabled and c.backup.preemption_signals.strip():
        def save_now():  # every process calls it, after the same step
            log.flush()
            backup.save(wait=True)  # (after the write in flight: within the grace period)
            strategy.barrier()  # none exits (and has a launcher stop the rest) before all saved
            return int(backup.step.numpy())
        callbacks.append(held.enter_context(Preemption(
            c.backup.preemption_signals.split(","), save=save_now, agree=strategy.any_process,
            grace_secs=c.backup.grace_secs, every=c.train.grad_accum_steps)))
    return callbacks


def _finish(run):
    """The memory report of a split model, the result, and on the chief `model.keras` (then the
    backup is removed)."""
    c, layout, model, log, say = run.config, run.layout, run.model, run.log, run.say
    if layout.split:
        for row in model.memory_report(layout.batch // layout.dp):
            say(f"tfdist: {_memory_line(row, layout)}")
    if c.backup.enabled:
        say(f"tfdist: {run.backup.describe()}")
    if run.memory is not None:
        say(f"tfdist: {run.memory.describe()}")
    if run.offload is not None:
        say(f"tfdist: {run.offload.summary()}")
    last_eval = (log.history["evals"] or [{}])[-1]
    result = {"steps_run": log.step - run.start + run.undone, "final_step": log.step,
              "val_loss": last_eval.get("loss"),
              "val_bits_per_byte": last_eval.get("bits_per_byte"),
              "tokens_per_sec": log.steady_tokens_per_sec(), "workdir": run.workdir,
              "updates": int(keras.ops.convert_to_numpy(model.optimizer.iterations))}
    sharded = zero.of(model)
    if sharded:  # ZeRO-3: every process gathers the whole model (a collective), into local
        sharded.materialize()  # variables (outside the scope: none is mirrored)
    if run.strategy.is_chief:
        # The plain GPT (tensor-parallel shards joined): it samples on any device.
        plain_gpt(model).save(os.path.join(run.workdir, "model.keras"))
        if c.backup.enabled and c.backup.delete_on_success:
            run.backup.remove()  # only now: a kill before model.keras was written resumes from it
        bits = result["val_bits_per_byte"]
        k = c.train.grad_accum_steps
        updates = f"; optimizer update {result['updates']}, of {k} batches each" if k > 1 else ""
        say(f"tfdist: done: {result['steps_run']} steps run (step {log.step} of "
            f"{c.train.steps}{updates}), validation loss {result['val_loss']:.4f} nats/token"
            + (f" ({bits:.4f} bits/byte), " if bits is not None else " (bits/byte unknown), ")
            + f"peak RSS {peak_rss_mib():,.0f} MiB, {result['tokens_per_sec']:,.0f} tokens/s; "
            f"model saved to {run.workdir}/model.keras")
    return result


def expected_memory(c, layout, sizes):
    """One line: the bytes a process of the run expects to hold, by part (the planner's model,
    `tfdist.parallel.memory`, of the model's `sizes`: Keras keeps float32 weights, gradients and
    Adam moments under either precision; activations at the run's precision), and what offload
    holds off it."""
    from tfdist.parallel import memory
    states = memory.memory(sizes, layout, memory.Defaults(
        precision="float32", offload_subgroup=c.zero.offload_subgroup))
    if c.train.precision != "float32":
        states["activations"] = memory.memory(sizes, layout)["activations"]
    parts = [(k, states[k]) for k in ("weights", "gathered", "gradients", "optimizer",
                                      "activations") if k in states]
    text = ", ".join(f"{k} {v / 2**30:,.2f} GiB" for k, v in parts)
    total = sum(v for _, v in parts)
    off = ""
    if layout.offload != "none":
        host = states["host_gradients"]
        off = (f"; off the device: {layout.offload} {states['offloaded'] / 2**30:,.2f} GiB"
               + (f", host memory {host / 2**30:,.2f} GiB (ZeRO-3's gradients)" if host else "")
               + f"; the CPU step holds up to {states['update_peak'] / 2**30:,.2f} GiB "
               f"(buffers {states['buffers'] / 2**30:,.2f} GiB)")
    return (f"memory expected per process (before TensorFlow's own): {text}; "
            f"{total / 2**30:,.2f} GiB on the device{off}")


def _memory_line(row, layout):
    """One line of a split model's memory report: a device's parameters and peak bytes."""
    where = f"stage {row['stage']}" + (f" shard {row['shard']}" if layout.tp > 1 else "")
    measured = row["measured_peak_bytes"]
    if measured is None:
        peak = "not available (TF keeps no memory stats for this device)"
    else:
        peak = f"{measured / 2**20:,.1f} MiB ({row['measured_scope']})"
    return (f"{where} on {row['device']}: {row['params']:,} parameters, estimated peak "
            f"{row['total_bytes'] / 2**20:,.1f} MiB; measured peak {peak}")


def model_vocab(c, data):
    """Sets model.vocab_size from the store's tokenizer when it is 0; a smaller one contradicts
    the tokenizer (its ids would fall outside the embedding)."""
    if c.model.vocab_size == 0:
        c.model.vocab_size = data.vocab_size
    elif c.model.vocab_size < data.vocab_size:
        raise UsageError(f"model.vocab_size ({c.model.vocab_size}) is smaller than the "
                         f"tokenizer's vocabulary ({data.vocab_size}, "
                         f"{data.tokenizer_config['kind']}); set it to 0 (follow the tokenizer) "
                         f"or at least {data.vocab_size}")


def save_tokenizer(data, workdir):
    """Copies the store's tokenizer into <workdir>/tokenizer, so `tfdist sample` can decode."""
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
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _apply_recommended(c, strategy):
    """The strategy's recommended config values (TPU: bfloat16, several steps per execution),
    applied where the config still has tfdist's defaults. Returns what to say of them."""
    defaults = config_lib.default_config()
    said = []
    for key, value in strategy.recommended.items():
        section, name = key.split(".")
        if c[section][name] != defaults[section][name]:
            continue  # the user chose
        if name == "steps_per_execution":  # must divide the epoch; a step per call under
            if c.train.grad_accum_steps > 1:  # accumulation (config.py)
                continue
            value = max(d for d in range(1, value + 1) if c.train.steps_per_epoch % d == 0)
        c[section][name] = value
        said.append(f"{strategy.name}: {key}={value} (recommended; set it to override)")
    return said
