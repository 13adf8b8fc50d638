"""The planner's model, pure and first-principles: a device, a model, a cluster and a layout; the
memory per device, the time per step, and the search over layouts.

The transformer's own arithmetic (parameters, FLOPs, activation bytes, model-state bytes) is
tfdist.models.arithmetic's, the same that the GPT and the pipeline's memory estimate use. The
layout is tfdist.parallel.layout's, the class `tfdist train` judges and runs. The published devices,
models and runs, and the calibration on them (the fraction of peak, `Options.efficiency`), are in
published.py.
"""
import dataclasses
import math

from tfdist.models import arithmetic
from tfdist.parallel import memory as memory_model
from tfdist.parallel.layout import Layout
from tfdist.plan import overheads

GB = 1e9

# ---------------------------------------------------------------------------------------------
# Devices. Peak = dense bf16/fp16 matrix FLOP/s, and for float32 training the rate float32
# matmuls run at (TF uses TF32 on NVIDIA GPUs since Ampere; TPUs, at XLA's default precision,
# multiply float32 in bf16 passes); memory as the runtime reports it (nvidia-smi's MiB for GPUs);
# bandwidths in bytes/s: intra = one direction of the device's link inside a node (NVLink, ICI),
# inter = its share of the node's network (per device, one direction). The devices themselves,
# from their datasheets: published.DEVICES.


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float
    memory: float
    hbm_bw: float  # None: not modelled (the CPU: its memory traffic is inside the fitted fraction)
    intra_bw: float
    inter_bw: float
    per_node: int
    source: str
    fp32_flops: float = 0.0  # 0: same as peak_flops

    def peak(self, precision):
        return self.peak_flops if precision == "mixed" else (self.fp32_flops or self.peak_flops)


# ---------------------------------------------------------------------------------------------
# Models: a decoder-only transformer's sizes (the published ones: published.MODELS).


@dataclasses.dataclass(frozen=True)
class Model(arithmetic.Transformer):
    """A decoder-only transformer's sizes (`arithmetic.Transformer`: GPT-2's kind by default;
    grouped-query attention, a SwiGLU MLP, RMSNorm, an untied head and no position embeddings
    for Llama's), named, with an optional published parameter count to use instead of counting
    (`params_override`), and the tfdist config file of its shape, if any (`config`: what
    `tfdist plan --model` recommends running)."""
    name: str = ""
    params_override: float = 0
    source: str = ""
    config: str = ""

    @property
    def params(self):
        return self.params_override or arithmetic.Transformer.params(self)


def model_from_config(c, name):
    """A Model from a tfdist config (the `model` section of configs/*.py): GPT-2's kind or
    Llama's (`model.arch`), as tfdist's GPT builds it (`GPT.arch_sizes`)."""
    from tfdist import config as config_lib
    m = config_lib.resolve_architecture(c.model.copy_and_resolve_references())
    llama = m.arch == "llama"
    return Model(name=name, n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head,
                 vocab_size=config_lib.vocab_size(c) or 256, seq_len=m.block_size, bias=m.bias,
                 dropout=m.dropout > 0, n_kv_head=m.n_kv_head, gated_mlp=llama,
                 ffn=m.ffn_hidden or arithmetic.default_ffn_hidden(m.arch, m.n_embd),
                 tied_embeddings=m.tie_embeddings, learned_positions=not llama, rms_norm=llama)


def config_of(model):
    """The `model` config keys of tfdist's GPT of `model`'s shape (the inverse of
    `model_from_config`): arch llama for a gated MLP (tfdist's Llama: SwiGLU, RMSNorm and rotary
    positions together), else gpt2; ffn_hidden 0 where the width is the architecture's default."""
    arch = "llama" if model.gated_mlp else "gpt2"
    ffn = model.ffn_width
    return {"arch": arch, "n_layer": model.n_layer, "n_head": model.n_head,
            "n_embd": model.n_embd, "block_size": model.seq_len, "vocab_size": model.vocab_size,
            "n_kv_head": model.n_kv_head,
            "ffn_hidden": 0 if ffn == arithmetic.default_ffn_hidden(arch, model.n_embd) else ffn,
            "bias": model.bias, "tie_embeddings": model.tied_embeddings}


# ---------------------------------------------------------------------------------------------
# A cluster and a layout.


@dataclasses.dataclass(frozen=True)
class Cluster:
    device: Device
    count: int
    per_node: int = 0  # 0: the device's usual node
    intra_bw: float = 0  # 0: the device's
    inter_bw: float = 0

    def node(self):
        return self.per_node or self.device.per_node

    def bandwidth(self, group_span):
        """Per-device bandwidth of a group of devices `group_span` consecutive ranks wide."""
        inside = group_span <= self.node()
        return ((self.intra_bw or self.device.intra_bw) if inside
                else (self.inter_bw or self.device.inter_bw))


def planned(batch, dp, tp=1, pp=1, microbatch=1, zero=0, recompute=False, schedule="gpipe",
            sp=False):
    """The layout of `dp` x `tp` x `pp` devices for `batch` sequences per optimizer update in
    pieces of `microbatch` sequences per replica (`tfdist.parallel.layout.Layout.planned`; `sp`:
    sequence parallelism over the tp ranks). Rank order: tensor-parallel ranks adjacent (in a
    node), then data-parallel, then stages."""
    return Layout.planned(batch, dp, tp, pp, microbatch, zero, recompute, schedule, sp)


@dataclasses.dataclass(frozen=True)
class Options:
    precision: str = "mixed"  # "mixed" (bf16/fp16 compute, fp32 master weights) or "float32"
    schedule: str = "gpipe"  # "gpipe" (tfdist: all microbatches in flight) or "1f1b" (Megatron)
    efficiency: float = None  # fraction of peak that matmuls reach (published.calibrated())
    usable_memory: float = 0.95  # of the device's memory (runtime context, fragmentation)
    elementwise_passes: float = 3.0  # memory traffic per stored activation byte (see step_time)
    # Megatron-LM splits the embedding and the logits over the tensor-parallel ranks; tfdist
    # keeps them whole on each stage's first device (tfdist.models.tensor_parallel)
    vocab_parallel: bool = True
    # The data-parallel all-reduce in buckets that start during the backward pass (tfdist's
    # multi_worker_mirrored and horovod do it by default, as PyTorch DDP and Megatron-LM do; not
    # under ZeRO); False: after the backward pass. bucket_bytes: tfdist's strategy.bucket_mb.
    overlap: bool = False
    bucket_bytes: float = 25 * 2 ** 20
    # CPU hosts, where the processes compute on cores they share (tfdist.plan.machine):
    # core_share is the speed of a device's compute against one core of its own (below 1 when
    # other processes compute on the same cores, above 1 when its own ops use more than one);
    # comm_cpu_bw is the bus bandwidth the cores alone give the gradient all-reduce (its copies
    # and reductions, as measured between processes on one host): that part of the all-reduce
    # runs on the cores that compute, so overlap cannot hide it. 0: devices whose network
    # engines move the bytes (GPUs, TPUs).
    core_share: float = 1.0
    comm_cpu_bw: float = 0.0
    # ZeRO-Offload (tfdist.parallel.zero.offload): parameters per sub-group of the CPU step, and
    # the disk's bandwidths (bytes/s, make bench-disk) and the CPU optimizer's rate (parameters
    # per second) that price it; 0: not measured (an offloaded layout is then not priced).
    offload_subgroup: float = 2 ** 25
    disk_read_bw: float = 0.0
    disk_write_bw: float = 0.0
    cpu_adam_rate: float = 0.0
    cpu_adam_disk_rate: float = 0.0  # (with its state on the disk: the reads and writes on the
    # same cores)
    # The framework's own seconds beyond this arithmetic, on a machine where they were fitted
    # (tfdist.plan.overheads: {kind: (a, b)}, a + b x parameters a pass, and a ZeRO stage's or an
    # offload's a step); None: none (the published runs' large steps)
    overheads: dict = None


# ---------------------------------------------------------------------------------------------
# Memory per device: tfdist.parallel.memory's (the model `tfdist train` states at start, too).
STATE_BYTES = memory_model.STATE_BYTES
stage_params = memory_model.stage_params
activation_bytes_per_layer = memory_model.activation_bytes_per_layer
memory = memory_model.memory
offload_io = memory_model.offload_io


# ---------------------------------------------------------------------------------------------
# Time per step.


def allreduce_seconds(nbytes, n, bandwidth):
    """Ring all-reduce: each device sends and receives 2 (n - 1) / n of the buffer."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bandwidth


def exposed_allreduce(comm, backward, grad_bytes, bucket_bytes):
    """Seconds of a bucketed gradient all-reduce (`comm` s in all) that a backward pass of
    `backward` s does not hide (tfdist/parallel/buckets.py). The gradients come out at an even rate
    over the backward pass, the last layers' first, so bucket i of n is ready at
    backward x (i + 1) / n; the buckets are reduced one after another, each taking comm / n. The
    last bucket is ready only when the backward pass ends, so at least comm / n stays exposed; one
    bucket hides nothing."""
    n = max(1, math.ceil(grad_bytes / bucket_bytes))
    t = 0.0
    for i in range(n):
        t = max(t, backward * (i + 1) / n) + comm / n
    return t - backward


def step_time(model, cluster, layout, opts=Options()):
    """Seconds per optimizer step, by part, and the bottleneck.

    Per microbatch, the slowest stage (the last: its blocks and the head) takes the time of its
    matmuls at `efficiency` x peak, plus its memory-bound element-wise work (each stored
    activation byte moved `elementwise_passes` times, once more with recomputation), plus the
    tensor-parallel all-reduces (2 forward, 2 backward per layer, 2 more when recomputing) and
    the activations sent to the next stage and the gradients sent back. A pipeline of M
    microbatches on K stages takes (M + K - 1) microbatch times: the bubble is
    (K - 1) / (M + K - 1). Then the data-parallel gradient all-reduce (ZeRO: reduce-scatter +
    all-gather, the same volume; ZeRO-3 gathers the weights twice: 1.5x): with `opts.overlap` (and
    no ZeRO) only the part that the last microbatch's backward pass does not hide
    (`exposed_allreduce`), else all of it; and the optimizer update (memory-bound, 28 bytes per
    parameter held). On CPU hosts the compute runs at `opts.core_share` of a core's speed, and the
    all-reduce's copies and reductions (`opts.comm_cpu_bw`) are never hidden: only the rest of it,
    the wire's, overlaps. `opts.efficiency` must be given (`tfdist.plan.calibrated()`:
    Megatron-LM's 175B run)."""
    if not opts.efficiency:
        raise ValueError("Options.efficiency (the fraction of peak matmuls reach) is needed; "
                         "tfdist.plan.calibrated() gives the one fitted on Megatron-LM's 175B run")
    dev = cluster.device
    a = model
    eff = opts.efficiency
    t, pp, b = layout.tp, layout.pp, layout.microbatch
    tokens = b * model.seq_len
    # (ZeRO-3 as tfdist runs it recomputes each unit's forward in its backward, with the weights
    # gathered again: tfdist.parallel.zero.weights)
    passes = 4 if layout.recompute or layout.zero >= 3 else 3
    layers = math.ceil(model.n_layer / pp)
    hidden = a.hidden_bytes(tokens, opts.precision)  # one layer's input: what TP and PP send

    matmul = layers * passes * a.layer_flops() * tokens / t + 3 * a.head_flops() * tokens / t
    compute = matmul / (eff * dev.peak(opts.precision) * opts.core_share)
    if dev.hbm_bw:
        moved = layers * activation_bytes_per_layer(model, layout, tokens, opts.precision)
        moved += a.logits_bytes(tokens, t)  # fp32 logits and their softmax gradient
        elementwise = moved * (opts.elementwise_passes + layout.recompute) / dev.hbm_bw
    else:
        elementwise = 0.0
    tp_comm = (layers * (6 if layout.recompute else 4)
               * allreduce_seconds(hidden, t, cluster.bandwidth(t)))
    p2p = 0.0
    if pp > 1:
        # activations forward, their gradients back; across nodes unless the pipeline fits in one
        p2p = 2 * hidden / max(t, 1) / cluster.bandwidth(2 * t * layout.dp)
    per_microbatch = compute + elementwise + tp_comm + p2p
    m = layout.passes
    pipeline = (m + pp - 1) * per_microbatch
    bubble = (pp - 1) * per_microbatch

    n = stage_params(model, pp, t)
    grad_bytes = n * STATE_BYTES[opts.precision][1]
    dp = allreduce_seconds(grad_bytes, layout.dp, cluster.bandwidth(t * layout.dp))
    cores = (allreduce_seconds(grad_bytes, layout.dp, opts.comm_cpu_bw) if opts.comm_cpu_bw
             else 0.0)
    cores = min(cores, dp)  # the cores' part of the all-reduce; the rest is the wire's
    if layout.zero >= 3:
        # the ZeRO paper's 1.5x an all-reduce, for each pass: each microbatch (and accumulated
        # batch) gathers the weights and reduce-scatters their gradients again
        dp, cores = 1.5 * m * dp, 1.5 * m * cores
    if opts.overlap and not layout.zero and dp:
        dp = cores + exposed_allreduce(dp - cores, compute * (passes - 1) / passes, grad_bytes,
                                       opts.bucket_bytes)
    held = n / (layout.dp if layout.zero >= 1 else 1)
    update = held * 28 / dev.hbm_bw if dev.hbm_bw else 0.0
    if layout.offload != "none":  # the CPU step by sub-groups; ZeRO-3's weights read in passes
        io = offload_io(model, layout, opts)
        if io["update_s"] is None:
            raise ValueError("an offloaded layout is priced with the disk's and the CPU step's "
                             "measured rates (Options.disk_read_bw, ...: make bench-disk)")
        update = io["update_s"]
        # the weights' reads: ahead while a device computes; on a CPU the cores that compute
        # also do the reads' work (as comm_cpu_bw's copies): not hidden
        reads = io["passes_read_s"] or 0.0
        pipeline = max(pipeline, reads) if dev.hbm_bw else pipeline + reads
    framework = 0.0
    if opts.overheads:
        framework = m * overheads.seconds(opts.overheads, "pass", model)
        kind = overheads.kind_of(layout)
        if kind:
            framework += (overheads.seconds(opts.overheads, kind, model, layout.dp)
                          * (m if kind == "zero3" else 1))
    total = pipeline + dp + update + framework
    parts = {"compute": m * compute, "memory": m * elementwise + update,
             "network": m * (tp_comm + p2p) + dp, "bubble": bubble, "framework": framework}
    return {**parts, "total": total, "bottleneck": max(parts, key=parts.get),
            "per_microbatch": per_microbatch}


@dataclasses.dataclass
class Plan:
    layout: Layout
    memory: dict
    time: dict
    fits: bool
    tokens_per_sec: float
    mfu: float
    # hardware FLOP/s as Megatron-LM reports them (recomputation included)
    tflops_per_device: float
    overflow: str = ""
    tfdist_fits: bool = True  # also as tfdist runs it: the embedding and head whole, ...
    model: Model = None
    # ... and the attention scores stored (tfdist's GPT has no FlashAttention): what overflows
    # when it does not fit so ("head kept whole" or "scores stored"; "": it fits)
    tfdist_overflow: str = ""


def evaluate(model, cluster, layout, opts=Options()):
    mem = memory(model, layout, opts)
    tm = step_time(model, cluster, layout, opts)
    tokens = layout.batch * layout.accumulate * model.seq_len  # per optimizer update
    hw = (model.model_flops_per_token()
          + (model.n_layer * model.layer_flops() if layout.recompute else 0)) * tokens
    capacity = cluster.device.memory * opts.usable_memory
    held = mem["total"]
    if layout.offload != "none" and not cluster.device.hbm_bw:  # a CPU: its memory is the host's
        held = max(held + mem["host_gradients"], mem["update_peak"]) + (
            mem["offloaded"] if layout.offload == "host" else 0)
    fits = held <= capacity
    overflow = "" if fits else (
        f"needs {held / GB:.1f} GB > {capacity / GB:.1f} GB usable; largest: "
        + ", ".join(f"{k} {v / GB:.1f}" for k, v in sorted(
            ((k, v) for k, v in mem.items() if k != "total"), key=lambda kv: -kv[1])[:2]))
    whole = dataclasses.replace(opts, vocab_parallel=False)
    tfdist_overflow = ("head kept whole" if memory(model, layout, whole)["total"] > capacity
                       else "scores stored" if model.flash_attention and memory(
                           dataclasses.replace(model, flash_attention=False), layout,
                           whole)["total"] > capacity else "")
    return Plan(layout, mem, tm, fits, tokens / tm["total"],
                model.model_flops_per_token() * tokens
                / (tm["total"] * cluster.count * cluster.device.peak(opts.precision)),
                hw / (tm["total"] * cluster.count) / 1e12, overflow,
                tfdist_fits=not tfdist_overflow, model=model, tfdist_overflow=tfdist_overflow)


# ---------------------------------------------------------------------------------------------
# The search.


def _powers_of_two(limit):
    k = 1
    while k <= limit:
        yield k
        k *= 2


def layouts(model, cluster, batch, fixed=None, schedule="gpipe"):
    """Every layout of `cluster.count` devices that splits `batch` and the model evenly.
    `fixed` pins dimensions: {"tp": 8, "pp": 16, ...}."""
    fixed = fixed or {}
    g = cluster.count
    tps = [fixed["tp"]] if "tp" in fixed else _powers_of_two(min(cluster.node(), model.n_head))
    for tp in tps:  # searched: powers of two within a node; pinned: as given
        if model.n_head % tp or (model.n_kv_head or model.n_head) % tp or g % tp:
            continue  # (each tensor-parallel device: whole query heads and key/value heads)
        for pp in range(1, model.n_layer + 1):
            if g % (tp * pp) or fixed.get("pp", pp) != pp:
                continue
            dp = g // (tp * pp)
            if fixed.get("dp", dp) != dp or batch % dp:
                continue
            mbs = [fixed["microbatch"]] if "microbatch" in fixed else _powers_of_two(batch // dp)
            for mb in mbs:
                if batch % (dp * mb):
                    continue
                for zero in (0, 1, 2, 3):
                    if (fixed.get("zero", zero) != zero or (zero and dp == 1)
                            or (zero == 2 and pp > 1)):
                        continue  # ZeRO-2 shards what pipelining accumulates per microbatch
                    for rc in (False, True):
                        for sp in ((False, True) if tp > 1 else (False,)):
                            if fixed.get("recompute", rc) == rc and fixed.get("sp", sp) == sp:
                                yield planned(batch, dp, tp, pp, mb, zero, rc, schedule, sp)


def offloaded(model, cluster, batch, fixed=None, schedule="gpipe"):
    """The layouts that offload (`tfdist.parallel.zero.offload`): ZeRO 1-3 of an unsplit model
    (also over one device, where ZeRO-3 keeps the master weights off it), to host memory or to
    disk."""
    g = cluster.count
    for mb in ([fixed["microbatch"]] if fixed and "microbatch" in fixed else
               _powers_of_two(batch // g)):
        for zero in (1, 2, 3):
            if batch % (g * mb) or (fixed or {}).get("zero", zero) != zero:
                continue
            for kind in ("host", "disk"):
                lay = planned(batch, g, 1, 1, mb, zero, False, schedule)
                yield dataclasses.replace(lay, offload=kind)


def search(model, cluster, batch, fixed=None, opts=Options()):
    """All candidate layouts evaluated; the feasible ones first, fastest first. When none fits
    and offload is priced (the measured rates in `opts`), the offloaded layouts are added: the
    planner chooses offload when nothing else fits."""
    plans = [evaluate(model, cluster, lay, opts)
             for lay in layouts(model, cluster, batch, fixed, opts.schedule)]
    split = (fixed or {}).get("pp", 1) > 1 or (fixed or {}).get("tp", 1) > 1
    if not any(p.fits for p in plans) and opts.cpu_adam_rate and not split:
        plans += [evaluate(model, cluster, lay, opts)
                  for lay in offloaded(model, cluster, batch, fixed, opts.schedule)]
    # equal speeds (compute is linear in the microbatch): fewer, larger microbatches, then less
    # memory
    return sorted(plans, key=lambda p: (not p.fits, -float(f"{p.tokens_per_sec:.4g}"),
                                        -p.layout.microbatch, p.memory["total"]))
