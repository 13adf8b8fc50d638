"""The layout of a run, judged in one place: data x pipeline x tensor x ZeRO.

A layout says how the GPT and each batch are spread: `dp` data-parallel replicas (as many as the
strategy makes), each holding the model in `pp` pipeline stages x `tp` tensor-parallel shards on
pp x tp devices of its process; each replica's share of a batch in `microbatches` pieces that
the pipeline schedule runs (`schedule`, `recompute`); `accumulate` batches summed before each
optimizer update; ZeRO `zero` sharding the optimizer state (1) and the gradients (2) over the
replicas. `tfdist train` builds one with `Layout.from_config`, from the config and from what the
strategy plugin declares it can do (`supports_pipeline`, `zero_collectives`, ...), and nothing
else judges a layout: every refusal below is one line naming the keys and what to do. The number
of replicas is known once the strategy is built (then it is built again with them). Then the
layout places the devices (`split_cpu` before the strategy, `place_devices` after it: GPUs, or the
CPU split into logical devices) and builds the model for itself (`build_model`).

`tfdist plan` enumerates and prices the same class (`Layout.planned`), prints the command that
runs a layout from `config_overrides()`, and calls runnable only what `accepts` (these checks).

Example:

    >>> from tfdist import config, strategies
    >>> from tfdist.errors import UsageError
    >>> from tfdist.parallel.layout import Layout
    >>> c = config.default_config()
    >>> c.model.n_layer = 4
    >>> c.pipeline.stages = 2
    >>> c.pipeline.microbatches = 4
    >>> layout = Layout.from_config(c, strategies.get_class("horovod"), replicas=2)
    >>> print(layout, "|", layout.describe())
    dp=2 tp=1 pp=2 mb=4 zero=0 | 2 replica(s) x 2 stage(s), 4 microbatch(es) of 4 sequence(s)
    >>> c.pipeline.stages = 5
    >>> try:
    ...     Layout.from_config(c, strategies.get_class("horovod"))
    ... except UsageError as e:
    ...     print(e)
    pipeline.stages (5) cannot exceed the model's blocks (model.n_layer = 4)
"""
import dataclasses

from tfdist.errors import UsageError
from tfdist.runtime.lazy import tf


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1  # data-parallel replicas; 0 while the strategy is not built yet
    tp: int = 1  # tensor-parallel shards of each block (Megatron-LM), per stage
    sp: bool = False  # sequence parallelism: the norms and residuals split over the tp shards
    seq: int = 0  # tokens per sequence (model.block_size); 0: not given
    pp: int = 1  # pipeline stages
    microbatches: int = 1  # pieces of each replica's batch, run by the pipeline schedule
    accumulate: int = 1  # batches per optimizer update (gradient accumulation)
    zero: int = 0  # ZeRO stage: 1 optimizer state, 2 also the gradients, sharded over the dp
    offload: str = "none"  # ZeRO-Offload: the optimizer state (ZeRO-3: weights) in host or disk
    recompute: bool = False  # a stage's activations computed again in the backward pass
    schedule: str = "gpipe"
    batch: int = 0  # global sequences per step (train.batch_size); 0: not given
    layers_per_stage: tuple = ()  # blocks per stage; (): balanced by compute
    devices: tuple = ()  # pp x tp device names, stage by stage; (): the GPUs, else logical CPUs
    overlap: str = "auto"  # the gradient all-reduce in buckets during the backward pass
    jit_compile: bool = False

    # -- from a config, or from the planner -------------------------------------------------------
    @classmethod
    def from_config(cls, c, plugin, replicas=0, local_devices=None):
        """The layout config `c` asks for under strategy plugin class `plugin`, with `replicas`
        data-parallel replicas (0: not known yet, so the batch's split is not checked: `tfdist
        train` calls this again once the strategy is built). UsageError, one line, when it
        cannot run (`check`)."""
        p = c.pipeline
        layout = cls(
            dp=replicas, tp=c.tensor.parallel, sp=c.tensor.sequence_parallel,
            seq=c.model.block_size, pp=p.stages, microbatches=p.microbatches,
            accumulate=c.train.grad_accum_steps, zero=c.zero.stage, offload=c.zero.offload,
            recompute=p.recompute,
            schedule=p.schedule, batch=c.train.batch_size,
            layers_per_stage=tuple(int(x) for x in p.layers_per_stage.split(",") if x.strip()),
            devices=tuple(d.strip() for d in p.devices.split(",") if d.strip()),
            overlap=c.strategy.get("overlap", "auto"), jit_compile=c.train.jit_compile)
        from tfdist.models.arithmetic import default_ffn_hidden
        layout.check(c.model.n_layer, c.model.n_head, plugin, local_devices,
                     n_kv_head=c.model.n_kv_head,
                     ffn_hidden=c.model.ffn_hidden or default_ffn_hidden(c.model.arch,
                                                                         c.model.n_embd))
        from tfdist.parallel import dp
        # (config.dp: a strategy that routes, a layout it can compress)
        dp.Settings.from_config(c.dp).require(plugin, layout.zero, layout.split)
        if c.train.skip_nonfinite and not plugin.updates_together:
            raise UsageError(f"train.skip_nonfinite={c.train.skip_nonfinite} under {plugin.name}: "
                             f"its workers apply their updates on their own, with no step at "
                             f"which all of them skip one; set it to 0")
        return layout

    @classmethod
    def check_sizes(cls, c, plugin, workers):
        """UsageError (one line) if config `c` cannot run on some number of workers in `workers`
        (an elastic job's sizes; one replica per worker)."""
        if len(workers) > 1 and c.strategy.get("lr_scaling", "none") != "none":
            raise UsageError(f"strategy.lr_scaling={c.strategy.lr_scaling} scales the learning "
                             f"rate by the number of workers, which an elastic job changes; set "
                             f"it to none (the global batch, and so the rate, stay the same)")
        for n in workers:
            try:
                cls.from_config(c, plugin, replicas=n)
            except UsageError as e:
                raise UsageError(f"an elastic job may run on {n} worker(s) (--min_workers="
                                 f"{workers[0]} .. --max_workers={workers[-1]}): {e}") from None

    @classmethod
    def planned(cls, batch, dp, tp=1, pp=1, microbatch=0, zero=0, recompute=False,
                schedule="gpipe", sp=False):
        """The layout `tfdist plan` prices: `batch` sequences per optimizer update, in pieces of
        `microbatch` sequences per replica (0: one piece); a pipeline runs them as its
        microbatches, otherwise they are accumulated batches (gradient accumulation)."""
        m = batch // (dp * (microbatch or batch // dp))
        if pp > 1:
            return cls(dp=dp, tp=tp, sp=sp, pp=pp, microbatches=m, zero=zero,
                       recompute=recompute, schedule=schedule, batch=batch)
        return cls(dp=dp, tp=tp, sp=sp, microbatches=1, accumulate=m, zero=zero,
                   recompute=recompute, schedule=schedule, batch=batch // m)

    # -- the one judge ----------------------------------------------------------------------------
    def check(self, n_layer, n_head, plugin, local_devices=None, n_kv_head=0, ffn_hidden=0):
        """Raises UsageError (one line) for the first thing this layout cannot run: with a GPT of
        `n_layer` blocks and `n_head` heads, under strategy plugin class `plugin`, on a process
        with `local_devices` devices for its stages and shards (None: not known; the CPU can be
        split)."""
        self._check_model(n_layer, n_head, n_kv_head, ffn_hidden)
        self._check_strategy(plugin, local_devices)
        if not self.dp:
            return
        if self.batch % self.dp:
            raise UsageError(f"train.batch_size ({self.batch}) must be divisible by the {self.dp} "
                             f"replicas of strategy {plugin.name}")
        if (self.batch // self.dp) % self.microbatches:
            raise UsageError(f"pipeline.microbatches ({self.microbatches}) must divide the batch "
                             f"of each replica ({self.batch // self.dp} = train.batch_size "
                             f"{self.batch} / {self.dp} replica(s))")

    def _check_model(self, n_layer, n_head, n_kv_head=0, ffn_hidden=0):
        """What the model's shape allows."""
        if self.pp > n_layer:
            raise UsageError(f"pipeline.stages ({self.pp}) cannot exceed the model's blocks "
                             f"(model.n_layer = {n_layer})")
        counts = self.layers_per_stage
        if counts and (len(counts) != self.pp or min(counts) < 1 or sum(counts) != n_layer):
            raise UsageError(f"pipeline.layers_per_stage ({','.join(map(str, counts))}) must give "
                             f"{self.pp} positive block counts adding up to model.n_layer "
                             f"({n_layer})")
        if self.devices and len(self.devices) != self.pp * self.tp:
            raise UsageError(f"pipeline.devices lists {len(self.devices)} device(s); "
                             f"pipeline.stages x tensor.parallel is {self.pp} x {self.tp}")
        if n_head % self.tp:
            raise UsageError(f"tensor.parallel={self.tp} must divide model.n_head ({n_head}): "
                             f"each device runs whole attention heads; pick t among the "
                             f"divisors of {n_head}")
        if n_kv_head and n_kv_head % self.tp:
            raise UsageError(f"tensor.parallel={self.tp} must divide model.n_kv_head "
                             f"({n_kv_head}): each device holds whole key/value heads; pick t "
                             f"among the divisors of {n_kv_head}")
        if ffn_hidden and ffn_hidden % self.tp:
            raise UsageError(f"tensor.parallel={self.tp} must divide the MLP's width "
                             f"(model.ffn_hidden {ffn_hidden}): each device holds an equal share "
                             f"of its units")
        if self.sp and self.tp == 1:
            raise UsageError("tensor.sequence_parallel=True splits the sequence over the "
                             "tensor-parallel shards, and tensor.parallel is 1; set "
                             "tensor.parallel > 1 or leave sequence_parallel False")
        if self.sp and self.seq % self.tp:
            raise UsageError(f"tensor.sequence_parallel=True splits each sequence over "
                             f"tensor.parallel={self.tp} shards: model.block_size ({self.seq}) "
                             f"must be divisible by {self.tp}")
        if self.schedule == "1f1b" and self.microbatches < self.pp:
            raise UsageError(f"pipeline.schedule=1f1b needs at least as many microbatches as "
                             f"stages (pipeline.microbatches {self.microbatches} < pipeline.stages "
                             f"{self.pp}); raise the microbatches or use gpipe")
        if self.recompute and not self.split:
            raise UsageError("pipeline.recompute=True needs a split model: it recomputes a "
                             "pipeline stage's activations (pipeline.stages, "
                             "pipeline.microbatches or tensor.parallel > 1); set it to False")

    def _check_strategy(self, plugin, local_devices):
        """What the strategy can combine (its plugin's declarations)."""
        name = plugin.name
        if self.split and not plugin.supports_pipeline:
            raise UsageError(f"strategy {name} cannot run a pipeline or tensor parallelism "
                             f"(pipeline.stages / pipeline.microbatches / tensor.parallel); leave "
                             f"them at 1 or pick another strategy")
        if self.zero and plugin.zero_collectives is None:
            raise UsageError(f"strategy {name} cannot shard the optimizer "
                             f"(zero.stage={self.zero}); use horovod or multi_worker_mirrored, "
                             f"or set zero.stage=0")
        if self.offload != "none" and self.split:
            raise UsageError(f"zero.offload={self.offload} runs on a model that is not split: set "
                             f"pipeline.stages=1 and tensor.parallel=1, or zero.offload=none")
        if self.zero and self.overlap == "on":
            raise UsageError(f"strategy.overlap=on cannot be combined with zero.stage={self.zero} "
                             f"under {name}: ZeRO reduce-scatters every gradient at once after "
                             f"the backward pass; set strategy.overlap=auto or off, or "
                             f"zero.stage=0")
        if self.jit_compile and not plugin.supports_jit_compile:
            raise UsageError(f"train.jit_compile=True does not work with strategy {name} on "
                             f"TF 2.21 (cross-device resource access); set it to False")
        local = self.pp * self.tp
        if local > 1 and plugin.uses_local_devices and not self.devices:
            what = "tensor parallelism" if self.tp > 1 else "pipeline stages"
            raise UsageError(f"{what} and the {name} strategy both want this process's devices; "
                             f"combine them with one replica per process (horovod or "
                             f"multi_worker_mirrored)")
        if local_devices is not None and local > local_devices:
            raise UsageError(f"pipeline.stages x tensor.parallel = {self.pp} x {self.tp} needs "
                             f"{local} devices and a process has {local_devices}; lower them")

    # -- derived ----------------------------------------------------------------------------------
    @property
    def split(self):
        """The model is laid out over its process's devices (a `Pipeline`)."""
        return self.pp > 1 or self.microbatches > 1 or self.tp > 1

    @property
    def microbatch(self):
        """Sequences per microbatch of a replica (0 while the replicas are not known)."""
        return self.batch // (self.dp * self.microbatches) if self.dp else 0

    @property
    def passes(self):
        """Forward and backward passes per optimizer update, per replica."""
        return self.microbatches * self.accumulate

    def config_overrides(self, c=None):
        """{"section.key": value}: the config keys that give this layout (with the strategy). With
        accumulation and a config `c`, also its epoch, steps and backup interval rounded up to
        whole updates where they are not (`tfdist.config`: a backup falls on an update's end)."""
        out = {"train.batch_size": self.batch}
        for key, value, default in (
                ("tensor.parallel", self.tp, 1),
                ("tensor.sequence_parallel", self.sp, False),
                ("pipeline.stages", self.pp, 1),
                ("pipeline.microbatches", self.microbatches, 1),
                ("pipeline.schedule", self.schedule, "gpipe"),
                ("pipeline.recompute", self.recompute, False),
                ("train.grad_accum_steps", self.accumulate, 1),
                ("zero.stage", self.zero, 0),
                ("zero.offload", self.offload, "none")):
            if value != default:
                out[key] = value
        k = self.accumulate
        if c is not None and k > 1:
            per_epoch = -(-c.train.steps_per_epoch // k) * k
            if per_epoch != c.train.steps_per_epoch:
                out["train.steps_per_epoch"] = per_epoch
            if c.train.steps % per_epoch:
                out["train.steps"] = -(-c.train.steps // per_epoch) * per_epoch
            if c.backup.enabled and c.backup.every_steps % k:
                out["backup.every_steps"] = -(-c.backup.every_steps // k) * k
        return out

    def accepts(self, c, plugin, local_devices=None):
        """Whether config `c` with this layout's keys (and its replicas) is one `tfdist train`
        runs, with `local_devices` devices per process: the config's own rules, then this
        class's (what `tfdist plan` calls runnable)."""
        return self.refusal(c, plugin, local_devices) is None

    def refusal(self, c, plugin, local_devices=None):
        """Why `tfdist train` refuses config `c` with this layout (`accepts`): its one-line
        error, or None where it runs it."""
        from tfdist import config as config_lib
        c = c.copy_and_resolve_references()
        for key, value in self.config_overrides(c).items():
            section, name = key.split(".")
            c[section][name] = value
        try:
            config_lib.validate(c)
            Layout.from_config(c, plugin, self.dp, local_devices)
        except UsageError as e:
            return str(e)
        return None

    def describe(self):
        parts = [f"{self.dp or '?'} replica(s)"]
        if self.pp > 1:
            parts.append(f"{self.pp} stage(s)")
        if self.tp > 1:
            parts.append(f"{self.tp} tensor-parallel shard(s)"
                         + (" (sequence parallel)" if self.sp else ""))
        text = " x ".join(parts)
        if self.microbatches > 1:
            text += f", {self.microbatches} microbatch(es) of {self.microbatch or '?'} sequence(s)"
        if self.accumulate > 1:
            text += f", {self.accumulate} batches per update"
        offload = f" offloaded to {self.offload}" if self.offload != "none" else ""
        return text + (f", ZeRO-{self.zero}{offload}" if self.zero else "")

    def __str__(self):  # the planner's table
        mb = self.batch // (self.dp * self.microbatches) if self.dp else 0
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} mb={mb} zero={self.zero}"
                f"{' sp' if self.sp else ''}{' recompute' if self.recompute else ''}"
                f"{' offload=' + self.offload if self.offload != 'none' else ''}")

    # -- devices and the model (TensorFlow from here) ---------------------------------------------
    def split_cpu(self):
        """Before TensorFlow starts its runtime (and so before the strategy: MultiWorkerMirrored
        configures its collectives at startup): the CPU split into pp x tp logical devices, where
        the model is split, no `devices` are given and there is no GPU. Lists no device, which
        would start the runtime."""
        if not self.split or self.devices:
            return
        n = self.pp * self.tp
        gpus = len(tf.config.list_physical_devices("GPU"))  # (physical: the runtime waits)
        if gpus and gpus < n:
            raise UsageError(f"pipeline.stages x tensor.parallel = {self.pp} x {self.tp} needs {n} "
                             f"devices and this process sees {gpus} GPU(s); lower them or give "
                             f"pipeline.devices")
        if not gpus:
            configure_logical_cpus(n)  # one logical CPU device per stage and shard

    def place_devices(self):
        """The pp x tp device names of this process's replica, stage by stage (after `split_cpu`
        and the strategy): `devices` as given (they must exist), else the first GPUs, else the
        CPU's logical devices. [] when the model is not split."""
        if not self.split:
            return []
        if self.devices:
            _check_devices_exist(self.devices)
            return list(self.devices)
        kind = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
        return [d.name for d in tf.config.list_logical_devices(kind)[:self.pp * self.tp]]

    def build_model(self, model_config, devices=()):
        """The GPT of `model_config` (the config's `model` section) for this layout: itself, or
        split into a `Pipeline` over `devices` (`place_devices`); built (its variables on their
        devices)."""
        from tfdist.models.gpt import GPT
        model = GPT.from_model_config(model_config)
        if self.split:
            from tfdist.models.pipeline import Pipeline
            model = Pipeline(model, stages=self.pp, microbatches=self.microbatches,
                             tensor_parallel=self.tp, schedule=self.schedule,
                             layers_per_stage=list(self.layers_per_stage) or None,
                             devices=list(devices), recompute=self.recompute,
                             sequence_parallel=self.sp)
        model.build()
        return model


def configure_logical_cpus(n):
    """Splits the host CPU into `n` logical devices (before TensorFlow initialises its runtime)."""
    cpus = tf.config.list_physical_devices("CPU")
    current = tf.config.get_logical_device_configuration(cpus[0])
    if current is not None and len(current) == n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:
        raise UsageError(f"cannot split the CPU into {n} logical devices: TensorFlow is already "
                         f"initialised in this process; create the strategy before any TF "
                         f"op") from None


def _check_devices_exist(devices):
    """Each named device is one of this process's (TF would otherwise place its ops elsewhere
    without a word)."""
    have = {(d.device_type, int(d.name.rsplit(":", 1)[1]))
            for d in tf.config.list_logical_devices()}
    for name in devices:
        spec = tf.DeviceSpec.from_string(name)
        if spec.job is None and (spec.device_type, spec.device_index or 0) not in have:
            names = ", ".join(sorted(f"{t}:{i}" for t, i in have))
            raise UsageError(f"pipeline.devices names {name}, which this process does not have "
                             f"(it has {len(have)} device(s): {names}); pipeline.stages x "
                             f"tensor.parallel is more than the devices")
