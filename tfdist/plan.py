"""`tfdist plan`: for a model and a cluster, which parallel layout fits in memory, and which is fastest.

A first-principles model, read top to bottom: devices, models, layouts, memory per device, time
per step, the search, and the command line. It covers data parallelism (DP), pipeline stages (PP:
K stages, M microbatches), tensor parallelism (TP) and ZeRO-1/2/3 optimizer-state sharding. TP
and ZeRO are modelled only: tfdist cannot run them yet, so the recommended command is the best
layout tfdist runs (DP x PP, no ZeRO).

One number is fitted: the fraction of peak FLOP/s that matrix multiplies reach. It is calibrated
on Megatron-LM's GPT-3 175B run and then checked, without refitting, against Megatron's 1T run and
LLaMA-2 70B's published cost (`tfdist plan --validate`). On this machine it is fitted to the bench's
measured step time instead, and the bench's other figures are predicted (`tfdist plan --measured`).

    tfdist plan --config=configs/gpt2_xl.py --device=a100-80gb --devices=16 --batch=512
    tfdist plan --model=llama2-70b --device=a100-80gb --devices=2048 --batch=1024
    tfdist plan --validate

In Python:

    from tfdist import plan
    m = plan.MODELS["gpt3-175b"]
    best = plan.search(m, plan.Cluster(plan.DEVICES["a100-80gb"], 1024), batch=1536)[0]
    print(best.layout, best.tflops_per_device)
"""
import dataclasses
import json
import math
import os
import sys

from tfdist.errors import UsageError

GB = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (configs/)

# ---------------------------------------------------------------------------------------------
# Devices. Peak = dense bf16/fp16 matrix FLOP/s, and for float32 training the rate float32
# matmuls run at (TF uses TF32 on NVIDIA GPUs since Ampere; TPUs, at XLA's default precision,
# multiply float32 in bf16 passes); memory as the runtime reports it (nvidia-smi's MiB for GPUs);
# bandwidths in bytes/s: intra = one direction of the device's link inside a node (NVLink, ICI),
# inter = its share of the node's network (per device, one direction).


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


MiB = 2**20
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s bf16 dense, 156 TF32, {mem}, NVLink "
         "600 GB/s bidirectional; DGX A100 user guide: 8 x 200 Gb/s HDR InfiniBand for 8 GPUs (25 GB/s each)")
_H = ("NVIDIA {name} datasheet (SXM): 989 TFLOP/s bf16 dense, 494 TF32, {mem}, NVLink 900 GB/s "
      "bidirectional; DGX H100: 8 x 400 Gb/s NDR for 8 GPUs (50 GB/s each)")
DEVICES = {
    "a100-40gb": Device("a100-40gb", 312e12, 40960 * MiB, 1.555e12, 300 * GB, 25 * GB, 8,
                        _A100.format(mem="40 GB HBM2 (40,960 MiB) at 1,555 GB/s"), 156e12),
    "a100-80gb": Device("a100-80gb", 312e12, 81920 * MiB, 2.039e12, 300 * GB, 25 * GB, 8,
                        _A100.format(mem="80 GB HBM2e (81,920 MiB) at 2,039 GB/s"), 156e12),
    "h100": Device("h100", 989e12, 81559 * MiB, 3.35e12, 450 * GB, 50 * GB, 8,
                   _H.format(name="H100", mem="80 GB HBM3 (81,559 MiB) at 3.35 TB/s"), 494e12),
    "h200": Device("h200", 989e12, 143771 * MiB, 4.8e12, 450 * GB, 50 * GB, 8,
                   _H.format(name="H200", mem="141 GB HBM3e (143,771 MiB) at 4.8 TB/s"), 494e12),
    "tpu-v4": Device("tpu-v4", 275e12, 32 * 2**30, 1.2e12, 150 * GB, 150 * GB, 4,
                     "Cloud TPU v4 docs (cloud.google.com/tpu/docs/v4): 275 TFLOP/s bf16, 32 GiB HBM2 at "
                     "1,200 GB/s, 4 chips per host; ICI 2,400 Gb/s per chip (half each way). A slice is all "
                     "ICI, so 'inter-node' is ICI too"),
    "tpu-v5e": Device("tpu-v5e", 197e12, 16 * GB, 819 * GB, 200 * GB, 200 * GB, 8,
                      "Cloud TPU v5e docs (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16, 16 GB HBM2 at "
                      "819 GB/s, 8 chips per host, ICI 400 GB/s bidirectional per chip; a slice is all ICI"),
}
CPU = "cpu"  # one core of this machine, as measured by `make bench` (see cpu_device)

# ---------------------------------------------------------------------------------------------
# Models: a decoder-only transformer's sizes.


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    n_kv_head: int = 0  # 0: = n_head (multi-head); fewer: grouped-query attention
    ffn: int = 0  # MLP width; 0: 4 x n_embd
    gated_mlp: bool = False  # SwiGLU (three matrices) instead of GELU (two)
    bias: bool = True
    tied_embeddings: bool = True
    learned_positions: bool = True
    dropout: bool = True  # dropout masks are stored for the backward pass
    flash_attention: bool = False  # the attention matrix is never stored (FlashAttention, xformers)
    params_override: float = 0  # a published parameter count to use instead of counting
    source: str = ""

    @property
    def kv(self):
        return self.n_embd * (self.n_kv_head or self.n_head) // self.n_head

    @property
    def ffn_width(self):
        return self.ffn or 4 * self.n_embd

    def layer_matmul_params(self):
        h = self.n_embd
        return 2 * h * h + 2 * h * self.kv + (3 if self.gated_mlp else 2) * h * self.ffn_width

    def layer_params(self):
        h, f = self.n_embd, self.ffn_width
        small = 2 * (2 * h if self.bias else h)  # two norms
        if self.bias:
            small += 2 * h + 2 * self.kv + f * (2 if self.gated_mlp else 1) + h
        return self.layer_matmul_params() + small

    def embedding_params(self):
        h = self.n_embd
        return (self.vocab_size * h * (1 if self.tied_embeddings else 2)
                + (self.seq_len * h if self.learned_positions else 0) + (2 * h if self.bias else h))

    @property
    def params(self):
        if self.params_override:
            return self.params_override
        return self.n_layer * self.layer_params() + self.embedding_params()

    def layer_flops(self):
        """Forward FLOPs of one layer per token: its matmuls, and attention's QK^T and AV
        (counted over the whole sequence, Megatron-LM's convention)."""
        return 2 * self.layer_matmul_params() + 4 * self.seq_len * self.n_embd

    def head_flops(self):
        return 2 * self.n_embd * self.vocab_size

    def model_flops_per_token(self):
        """Training FLOPs per token, forward + backward, without recomputation (for MFU)."""
        return 3 * (self.n_layer * self.layer_flops() + self.head_flops())


def _m(name, **kw):
    return Model(name=name, **kw)


_MEGATRON = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
             "Megatron-LM, SC21, arXiv:2104.04473, Table 1 and section 5")
MODELS = {
    "gpt3-175b": _m("gpt3-175b", n_layer=96, n_embd=12288, n_head=96, vocab_size=51200, seq_len=2048,
                    source="Brown et al. 2020 (GPT-3), sizes as trained in " + _MEGATRON),
    "megatron-1t": _m("megatron-1t", n_layer=128, n_embd=25600, n_head=160, vocab_size=51200,
                      seq_len=2048, source=_MEGATRON),
    "llama2-70b": _m("llama2-70b", n_layer=80, n_embd=8192, n_head=64, n_kv_head=8, ffn=28672,
                     gated_mlp=True, bias=False, tied_embeddings=False, learned_positions=False,
                     dropout=False, flash_attention=True, vocab_size=32000, seq_len=4096,
                     source="Touvron et al., Llama 2, arXiv:2307.09288 (sizes: the released "
                            "config.json; xformers memory-efficient attention)"),
}


def model_from_config(c, name):
    """A Model from a tfdist config (the `model` section of configs/*.py)."""
    from tfdist import config as config_lib
    m = c.model
    return Model(name=name, n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head,
                 vocab_size=config_lib.vocab_size(c) or 256, seq_len=m.block_size, bias=m.bias, dropout=m.dropout > 0)


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
        return (self.intra_bw or self.device.intra_bw) if inside else (self.inter_bw or self.device.inter_bw)


@dataclasses.dataclass(frozen=True)
class Layout:
    """dp x tp x pp devices; each replica's batch in microbatches of `microbatch` sequences.
    Rank order: tensor-parallel ranks adjacent (in a node), then data-parallel, then stages."""
    dp: int
    tp: int = 1
    pp: int = 1
    microbatch: int = 1
    zero: int = 0
    recompute: bool = False

    def microbatches(self, batch):
        return batch // (self.dp * self.microbatch)

    def runs_in_tfdist(self):
        return self.tp == 1 and self.zero == 0

    def __str__(self):
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} mb={self.microbatch} zero={self.zero}"
                f"{' recompute' if self.recompute else ''}")


@dataclasses.dataclass(frozen=True)
class Options:
    precision: str = "mixed"  # "mixed" (bf16/fp16 compute, fp32 master weights) or "float32"
    schedule: str = "gpipe"  # "gpipe" (tfdist: all microbatches in flight) or "1f1b" (Megatron)
    efficiency: float = 0.0  # fraction of peak that matmuls reach; 0: calibrated() on 175B
    usable_memory: float = 0.95  # of the device's memory (runtime context, fragmentation)
    elementwise_passes: float = 3.0  # memory traffic per stored activation byte (see step_time)


# ---------------------------------------------------------------------------------------------
# Memory per device.

# Model-state bytes per parameter: (weights, gradients, optimizer states). Mixed precision is the
# ZeRO paper's: fp16 weights and gradients, and fp32 master weights + Adam's two moments (K = 12).
STATE_BYTES = {"mixed": (2, 2, 12), "float32": (4, 4, 8)}


def stage_params(model, pp):
    """Parameters of the largest pipeline stage (blocks split as evenly as possible; the
    embedding on the first stage, the untied head and final norm on the last)."""
    layers = math.ceil(model.n_layer / pp) * model.layer_params()
    if model.params_override:
        return model.params_override / pp
    emb = model.embedding_params()
    if pp == 1:
        return layers + emb
    head = model.vocab_size * model.n_embd  # the last stage holds the head (a copy, if tied)
    return layers + max(emb - (0 if model.tied_embeddings else head), head)


def activation_bytes_per_layer(model, layout, tokens, precision):
    """Bytes one transformer layer keeps for its backward pass, for `tokens` tokens of one
    microbatch. Korthikanti et al. 2022 (arXiv:2205.05198) eq. 2: s b h (34 + 5 a s / h) at 2
    bytes per value, of which 24 + 5as/h are split by tensor parallelism. Generalised here to
    grouped-query attention, gated MLPs, no dropout and FlashAttention (no s x s matrices)."""
    h, t = model.n_embd, layout.tp
    value = 2 if precision == "float32" else 1  # in units of the paper's 2-byte values
    masks = 2 if model.dropout else 0  # attention-output and MLP-output dropout masks, 1 byte each
    unsplit = 8 * value + masks  # two norms' inputs 4, attention and MLP inputs 4
    split = (4 + 4 * model.kv / h + (8 if model.gated_mlp else 4) * model.ffn_width / h) * value
    scores = 0 if model.flash_attention else (
        (4 * value + 1) if model.dropout else 2 * value) * model.n_head * model.seq_len / h
    return tokens * h * (unsplit + (split + scores) / t)


def memory(model, layout, batch, opts=Options()):
    """Bytes per device, by part, for the largest stage."""
    pb, gb, ob = STATE_BYTES[opts.precision]
    n = stage_params(model, layout.pp) / layout.tp
    d, z = layout.dp, layout.zero
    parts = {"weights": n * pb / (d if z >= 3 else 1),
             "gradients": n * gb / (d if z >= 2 else 1),
             "optimizer": n * ob / (d if z >= 1 else 1)}
    if model.params_override and not model.n_layer:
        return {**parts, "activations": 0.0, "total": sum(parts.values())}
    tokens = layout.microbatch * model.seq_len
    m = layout.microbatches(batch)
    in_flight = (min(m, layout.pp) if opts.schedule == "1f1b" else m) if layout.pp > 1 else 1
    layers = math.ceil(model.n_layer / layout.pp)
    layer = activation_bytes_per_layer(model, layout, tokens, opts.precision)
    value = 4 if opts.precision == "float32" else 2
    if layout.recompute:  # each layer keeps its input; one layer's full set while recomputing
        acts = layers * in_flight * tokens * model.n_embd * value + layer
    else:
        acts = layers * in_flight * layer
    logits = tokens * model.vocab_size * 4 / layout.tp * (in_flight if opts.schedule == "gpipe" else 1)
    parts["activations"] = acts + logits
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------------------------
# Time per step.


def allreduce_seconds(nbytes, n, bandwidth):
    """Ring all-reduce: each device sends and receives 2 (n - 1) / n of the buffer."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bandwidth


def step_time(model, cluster, layout, batch, opts=Options()):
    """Seconds per optimizer step, by part, and the bottleneck.

    Per microbatch, the slowest stage (the last: its blocks and the head) takes the time of its
    matmuls at `efficiency` x peak, plus its memory-bound element-wise work (each stored
    activation byte moved `elementwise_passes` times, once more with recomputation), plus the
    tensor-parallel all-reduces (2 forward, 2 backward per layer, 2 more when recomputing) and
    the activations sent to the next stage and the gradients sent back. A pipeline of M
    microbatches on K stages takes (M + K - 1) microbatch times: the bubble is (K - 1) / (M + K - 1).
    Then the data-parallel gradient all-reduce (ZeRO: reduce-scatter + all-gather, the same volume;
    ZeRO-3 gathers the weights twice: 1.5x), not overlapped with compute, and the optimizer update
    (memory-bound, 28 bytes per parameter held)."""
    dev = cluster.device
    eff = opts.efficiency or calibrated()
    t, pp, b = layout.tp, layout.pp, layout.microbatch
    tokens = b * model.seq_len
    passes = 4 if layout.recompute else 3
    layers = math.ceil(model.n_layer / pp)
    value = 4 if opts.precision == "float32" else 2

    matmul = layers * passes * model.layer_flops() * tokens / t + 3 * model.head_flops() * tokens / t
    compute = matmul / (eff * dev.peak(opts.precision))
    if dev.hbm_bw:
        moved = layers * activation_bytes_per_layer(model, layout, tokens, opts.precision)
        moved += tokens * model.vocab_size * 4 / t  # fp32 logits and their softmax gradient
        elementwise = moved * (opts.elementwise_passes + layout.recompute) / dev.hbm_bw
    else:
        elementwise = 0.0
    tp_comm = layers * (6 if layout.recompute else 4) * allreduce_seconds(
        tokens * model.n_embd * value, t, cluster.bandwidth(t))
    p2p = 0.0
    if pp > 1:  # activations forward, their gradients back; across nodes unless the pipeline fits in one
        p2p = 2 * tokens * model.n_embd * value / max(t, 1) / cluster.bandwidth(2 * t * layout.dp)
    per_microbatch = compute + elementwise + tp_comm + p2p
    m = layout.microbatches(batch)
    pipeline = (m + pp - 1) * per_microbatch
    bubble = (pp - 1) * per_microbatch

    n = stage_params(model, pp) / t
    grad_bytes = n * STATE_BYTES[opts.precision][1]
    dp = allreduce_seconds(grad_bytes, layout.dp, cluster.bandwidth(t * layout.dp))
    if layout.zero >= 3:
        dp *= 1.5
    held = n / (layout.dp if layout.zero >= 1 else 1)
    update = held * 28 / dev.hbm_bw if dev.hbm_bw else 0.0
    total = pipeline + dp + update
    parts = {"compute": m * compute, "memory": m * elementwise + update,
             "network": m * (tp_comm + p2p) + dp, "bubble": bubble}
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
    tflops_per_device: float  # hardware FLOP/s as Megatron-LM reports them (recomputation included)
    overflow: str = ""


def evaluate(model, cluster, layout, batch, opts=Options()):
    mem = memory(model, layout, batch, opts)
    tm = step_time(model, cluster, layout, batch, opts)
    tokens = batch * model.seq_len
    hw = (model.model_flops_per_token()
          + (model.n_layer * model.layer_flops() if layout.recompute else 0)) * tokens
    capacity = cluster.device.memory * opts.usable_memory
    fits = mem["total"] <= capacity
    overflow = "" if fits else (
        f"needs {mem['total'] / GB:.1f} GB > {capacity / GB:.1f} GB usable; largest: "
        + ", ".join(f"{k} {v / GB:.1f}" for k, v in sorted(
            ((k, v) for k, v in mem.items() if k != "total"), key=lambda kv: -kv[1])[:2]))
    return Plan(layout, mem, tm, fits, tokens / tm["total"],
                model.model_flops_per_token() * tokens
                / (tm["total"] * cluster.count * cluster.device.peak(opts.precision)),
                hw / (tm["total"] * cluster.count) / 1e12, overflow)


# ---------------------------------------------------------------------------------------------
# The search.


def _powers_of_two(limit):
    k = 1
    while k <= limit:
        yield k
        k *= 2


def layouts(model, cluster, batch, fixed=None):
    """Every layout of `cluster.count` devices that splits `batch` and the model evenly.
    `fixed` pins dimensions: {"tp": 8, "pp": 16, ...}."""
    fixed = fixed or {}
    g = cluster.count
    tps = [fixed["tp"]] if "tp" in fixed else _powers_of_two(min(cluster.node(), model.n_head))
    for tp in tps:  # searched: powers of two within a node; pinned: as given
        if model.n_head % tp or g % tp:
            continue
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
                    if fixed.get("zero", zero) != zero or (zero and dp == 1) or (zero >= 2 and pp > 1):
                        continue  # ZeRO-2/3 shard what pipelining keeps per microbatch: not combined
                    for rc in (False, True):
                        if fixed.get("recompute", rc) == rc:
                            yield Layout(dp, tp, pp, mb, zero, rc)


def search(model, cluster, batch, fixed=None, opts=Options()):
    """All candidate layouts evaluated; the feasible ones first, fastest first."""
    plans = [evaluate(model, cluster, lay, batch, opts) for lay in layouts(model, cluster, batch, fixed)]
    # equal speeds (compute is linear in the microbatch): fewer, larger microbatches, then less memory
    return sorted(plans, key=lambda p: (not p.fits, -float(f"{p.tokens_per_sec:.4g}"),
                                        -p.layout.microbatch, p.memory["total"]))


# ---------------------------------------------------------------------------------------------
# Calibration and validation against published runs.

PUBLISHED = {
    "calibration": dict(model="gpt3-175b", device="a100-80gb", devices=1024, batch=1536,
                        layout=Layout(dp=8, tp=8, pp=16, microbatch=1, recompute=True),
                        tflops=138.0, source=_MEGATRON + " (GPT-3 175B: 138 TFLOP/s per GPU, 44 % of peak)"),
    "megatron-1t": dict(model="megatron-1t", device="a100-80gb", devices=3072, batch=3072,
                        layout=Layout(dp=6, tp=8, pp=64, microbatch=1, recompute=True),
                        tflops=163.0, source=_MEGATRON + " (1T: 163 TFLOP/s per GPU, 52 % of peak)"),
    "llama2-70b": dict(model="llama2-70b", device="a100-80gb", devices=2048, batch=1024,
                       tokens=2e12, gpu_hours=1_720_320,
                       source="Touvron et al. 2023, Llama 2, arXiv:2307.09288, Table 2: 1,720,320 A100-80GB GPU-hours "
                              "for 70B (2T tokens, 4M-token batches); GPU count not published, "
                              "2048 as for LLaMA-1 65B"),
}
MEGATRON_OPTIONS = Options(schedule="1f1b")


def _fit_efficiency(model, cluster, layout, batch, seconds, opts):
    """The fraction of peak at which the model's step takes `seconds` (time falls as it grows)."""
    lo, hi = 1e-3, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        t = step_time(model, cluster, layout, batch, dataclasses.replace(opts, efficiency=mid))["total"]
        lo, hi = (mid, hi) if t > seconds else (lo, mid)
    return (lo + hi) / 2


def _fit_to_one_process(dev, model, bench, opts):
    """The fraction of peak that reproduces a scaling bench's 1-process step time, and that time."""
    per = bench["batch_per_worker"]
    t1 = per * model.seq_len / bench["tokens_per_sec_1"]
    return _fit_efficiency(model, Cluster(dev, 1), Layout(1), per, t1, opts), t1


def calibrated(_cache={}):
    """The fraction of peak that makes the model reproduce Megatron-LM's 175B run."""
    if "f" not in _cache:
        run = PUBLISHED["calibration"]
        model, cluster = MODELS[run["model"]], Cluster(DEVICES[run["device"]], run["devices"])
        p = evaluate(model, cluster, run["layout"], run["batch"],
                     dataclasses.replace(MEGATRON_OPTIONS, efficiency=0.5))
        flops = p.tflops_per_device * 1e12 * p.time["total"]  # per device per step, any efficiency
        _cache["f"] = _fit_efficiency(model, cluster, run["layout"], run["batch"],
                                      flops / (run["tflops"] * 1e12), MEGATRON_OPTIONS)
    return _cache["f"]


def validate():
    """Rows of (what, published, predicted, error) for the published runs."""
    rows = []
    for key in ("calibration", "megatron-1t"):
        run = PUBLISHED[key]
        model, cluster = MODELS[run["model"]], Cluster(DEVICES[run["device"]], run["devices"])
        p = evaluate(model, cluster, run["layout"], run["batch"], MEGATRON_OPTIONS)
        rows.append({"run": f"{run['model']} on {run['devices']} A100, {run['layout']}",
                     "metric": "TFLOP/s per GPU", "published": run["tflops"],
                     "predicted": p.tflops_per_device, "role": "calibration" if key == "calibration" else "prediction",
                     "source": run["source"]})
    run = PUBLISHED["llama2-70b"]
    model, cluster = MODELS[run["model"]], Cluster(DEVICES[run["device"]], run["devices"])
    best = search(model, cluster, run["batch"], opts=MEGATRON_OPTIONS)[0]
    hours = run["tokens"] / best.tokens_per_sec * cluster.count / 3600
    rows.append({"run": f"llama2-70b, 2T tokens on {run['devices']} A100-80GB, best layout {best.layout}",
                 "metric": "GPU-hours", "published": run["gpu_hours"], "predicted": hours,
                 "role": "prediction", "source": run["source"]})
    for r in rows:
        r["error"] = r["predicted"] / r["published"] - 1
    return rows


def zero_figure1(params=7.5e9, dp=64):
    """ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054) Figure 1: GB per device for 7.5B
    parameters on 64 devices, baseline and ZeRO-1/2/3."""
    model = Model("zero-7.5b", n_layer=0, n_embd=0, n_head=1, vocab_size=0, seq_len=0, params_override=params)
    return {z: memory(model, Layout(dp=dp, zero=z), dp)["total"] / GB for z in (0, 1, 2, 3)}


# ---------------------------------------------------------------------------------------------
# This machine: the CPU as the bench measured it, and the bench's figures predicted.

BENCH_HINT = {"bench.json": "make bench", "scaling.json": "make bench-scaling",
              "scaling-horovod.json": "make bench-scaling-horovod", "allreduce.json": "make bench-allreduce",
              "pipeline.json": "make bench-pipeline"}


def read_bench(bench_dir, name):
    """A bench result, or None when it has not been run here (bench_results/ is not committed)."""
    path = os.path.join(bench_dir, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path} ({e}); re-run `{BENCH_HINT.get(name, 'the bench')}`") from None


def allreduce_bandwidth(bench_dir, implementation="tf ring (MWMS)"):
    """Bus bandwidth (bytes/s) at the largest buffer `make bench-allreduce` measured, or None."""
    ar = read_bench(bench_dir, "allreduce.json")
    if not ar or not ar.get("rows") or implementation not in ar["rows"][-1]:
        return None
    return ar["rows"][-1][implementation]["busbw_GBps"] * GB


def cpu_device(bench_dir):
    """One core of this machine: its share of the matmul peak that `make bench` measured, its
    share of the RAM, and the all-reduce bandwidth `make bench-allreduce` measured between two
    processes (over loopback, so 'inside a node')."""
    bench = read_bench(bench_dir, "bench.json")
    if not bench:
        raise UsageError(f"this CPU has not been measured: no {os.path.join(bench_dir, 'bench.json')}; "
                         f"run `make bench` first (or pick another --device)")
    cores = bench.get("cores") or os.cpu_count()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bw = allreduce_bandwidth(bench_dir) or 0.3 * GB  # 0.29-0.35 GB/s measured on this machine
    return Device(CPU, bench["matmul_peak_flops"] / cores, ram / cores, None, bw, bw, cores,
                  f"{bench_dir}/bench.json (fp32 2048^3 matmul peak / {cores} cores) and allreduce.json")


def measured(bench_dir, model):
    """Predicted against measured on this machine. The fraction of peak is fitted to the
    1-process step time of `make bench-scaling` (gpt_mini, 1 thread per process); then the 2-process
    data-parallel efficiency (collective ring and Horovod) and the 2-stage pipeline speedups are
    predicted with the all-reduce bandwidth `make bench-allreduce` measured. Rows whose bench
    has not been run say which make target to run."""
    dev = cpu_device(bench_dir)
    opts = Options(precision="float32", schedule="gpipe")
    rows = []
    for name, impl, label in (("scaling.json", "tf ring (MWMS)", "2-worker efficiency, multi_worker_mirrored"),
                              ("scaling-horovod.json", "horovod/gloo", "2-rank efficiency, horovod")):
        s = read_bench(bench_dir, name)
        if not s:
            rows.append({"figure": label, "missing": BENCH_HINT[name]})
            continue
        bw = allreduce_bandwidth(bench_dir, impl)
        if bw is None:
            rows.append({"figure": label, "missing": BENCH_HINT["allreduce.json"]})
            continue
        f, t1 = _fit_to_one_process(dev, model, s, opts)
        o = dataclasses.replace(opts, efficiency=f)
        t2 = step_time(model, Cluster(dev, 2, intra_bw=bw, inter_bw=bw), Layout(2),
                       2 * s["batch_per_worker"], o)["total"]
        rows.append({"figure": label, "predicted": t1 / t2, "measured": s["scaling_efficiency"],
                     "note": f"fitted {f:.1%} of the per-core peak; all-reduce at {bw / GB:.2f} GB/s"})
    p = read_bench(bench_dir, "pipeline.json")
    if not p:
        rows.append({"figure": "2-stage pipeline speedup", "missing": BENCH_HINT["pipeline.json"]})
    else:
        batch = p["batch"]
        base = {r["variant"]: r["step_time_s"] for r in p["rows"]}
        one = base.get("unsplit-1")  # the unsplit model on one core: one device's compute
        if one is None:
            return rows + [{"figure": "2-stage pipeline speedup", "missing": BENCH_HINT["pipeline.json"]}]
        f = _fit_efficiency(model, Cluster(dev, 1), Layout(1), batch, one, opts)
        o = dataclasses.replace(opts, efficiency=f)
        for r in p["rows"]:
            if not r.get("microbatches"):
                continue
            m, k = r["microbatches"], p["stages"]
            # the stages are in one process: activations pass between them by reference
            inproc = Cluster(dev, k, intra_bw=math.inf, inter_bw=math.inf)
            t = step_time(model, inproc, Layout(1, pp=k, microbatch=batch // m), batch, o)["total"]
            rows.append({"figure": f"pipeline K={k}, M={m}: speedup vs one core", "predicted": one / t,
                         "measured": r["speedup_vs_1_inter_op_thread"],
                         "note": f"vs unsplit with the same threads: measured {r['speedup']:.2f}"})
    return rows


# ---------------------------------------------------------------------------------------------
# The recommended command, the table and the chart.


def tfdist_command(plan_, cluster, batch, config_arg, precision):
    """The `tfdist train` command for a layout tfdist runs (tp = 1, no ZeRO)."""
    lay = plan_.layout
    m = lay.microbatches(batch)
    flags = [config_arg, f"--config.train.batch_size={batch}"]
    if precision == "mixed":
        flags.append("--config.train.precision=mixed_bfloat16")
    if lay.pp > 1:
        flags += [f"--config.pipeline.stages={lay.pp}", f"--config.pipeline.microbatches={m}"]
        if lay.recompute:
            flags.append("--config.pipeline.recompute=True")
    elif m > 1:  # one microbatch at a time: Keras's gradient accumulation
        flags[1] = f"--config.train.batch_size={batch // m}"
        flags.append(f"--config.train.grad_accum_steps={m}")
    if cluster.device.name.startswith("tpu"):
        return "tfdist train --strategy=tpu " + " ".join(flags)
    if lay.dp == 1:
        return "tfdist train " + " ".join(flags)
    per_node = cluster.node() // lay.pp  # processes per node, each with its pp stages' devices
    if lay.dp <= per_node:
        return f"tfdist launch --workers {lay.dp} -- " + " ".join(flags)
    return (f"sbatch --nodes={math.ceil(lay.dp / per_node)} --ntasks-per-node={per_node} "
            f"launchers/slurm/tfdist.sbatch " + " ".join(flags))


def runnable(plan_, cluster):
    lay = plan_.layout
    if not lay.runs_in_tfdist() or (lay.recompute and lay.pp == 1):
        return False  # no tensor parallelism or ZeRO yet; recomputation is the pipeline's
    if cluster.device.name.startswith("tpu"):
        return lay.pp == 1  # TPUStrategy replicates; no stages
    return lay.pp <= cluster.node()  # a process's stages are on its own node's devices


def format_table(plans, cluster):
    head = (f"{'#':>3}  {'layout':<40} {'GB/dev':>7} {'s/step':>8} {'tok/s':>11} {'MFU':>6}  "
            f"{'bottleneck':<10} tfdist")
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans, 1):
        lines.append(f"{i:>3}  {str(p.layout):<40} {p.memory['total'] / GB:>7.1f} {p.time['total']:>8.3f} "
                     f"{p.tokens_per_sec:>11,.0f} {p.mfu:>6.1%}  {p.time['bottleneck']:<10} "
                     f"{'yes' if runnable(p, cluster) else 'modelled'}")
    return "\n".join(lines)


def chart(plans, cluster, path, title):
    """Two panels: step time by part, and memory per device by part, for the listed layouts."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{p.layout}{' *' if runnable(p, cluster) else ''}" for p in plans][::-1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 0.45 * len(plans) + 3), sharey=True)
    left = [0.0] * len(plans)
    for part, color in (("compute", "tab:blue"), ("memory", "tab:orange"), ("network", "tab:green"),
                        ("bubble", "tab:gray")):
        v = [p.time[part] for p in plans][::-1]
        a.barh(names, v, left=left, color=color, label=part)
        left = [x + y for x, y in zip(left, v)]
    a.set_title("seconds per step, by part")
    a.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=2, frameon=False)
    left = [0.0] * len(plans)
    for part, color in (("weights", "tab:purple"), ("gradients", "tab:red"), ("optimizer", "tab:olive"),
                        ("activations", "tab:cyan")):
        v = [p.memory[part] / GB for p in plans][::-1]
        b.barh(names, v, left=left, color=color, label=part)
        left = [x + y for x, y in zip(left, v)]
    b.axvline(cluster.device.memory / GB, color="k", linestyle="--", label="device memory")
    b.set_title("GB per device, by part")
    b.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=3, frameon=False)
    fig.suptitle(f"{title}   (* runs in tfdist today)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# `tfdist plan`


def _define_flags():
    from absl import flags

    from tfdist import cli
    cli.define_config_flag("config", None, "A tfdist config (configs/*.py): its model, batch and sequence.")
    f = flags
    f.DEFINE_string("model", None, f"A published model instead of --config: {', '.join(MODELS)}.")
    for name, text in (("n_layer", "layers"), ("n_embd", "width"), ("n_head", "attention heads"),
                       ("vocab_size", "vocabulary")):
        f.DEFINE_integer(name, None, f"Model {text} (sizes given directly; overrides --config/--model).")
    f.DEFINE_integer("seq_len", None, "Sequence length (default: the config's block_size).")
    f.DEFINE_float("params", None, "Use this parameter count for the model states (e.g. 7.5e9).")
    f.DEFINE_integer("batch", None, "Global batch in sequences per optimizer step (default: the config's).")
    f.DEFINE_string("device", "a100-80gb", f"Device type: {', '.join(DEVICES)} or {CPU} (this machine, "
                    f"from `make bench`).")
    f.DEFINE_integer("devices", 8, "Number of devices.")
    f.DEFINE_integer("per_node", None, "Devices per node (default: the device's usual node).")
    f.DEFINE_float("intra_node_gbps", None, "Per-device bandwidth inside a node, GB/s one way.")
    f.DEFINE_float("inter_node_gbps", None, "Per-device bandwidth between nodes, GB/s one way.")
    for name in ("dp", "tp", "pp", "microbatch", "zero"):
        f.DEFINE_integer(name, None, f"Fix the layout's {name} (default: search).")
    f.DEFINE_enum("recompute", "search", ["search", "on", "off"], "Activation recomputation.")
    f.DEFINE_enum("precision", None, ["mixed", "float32"], "Default: mixed; float32 on the CPU.")
    f.DEFINE_enum("schedule", "gpipe", ["gpipe", "1f1b"], "Pipeline schedule (tfdist's is gpipe).")
    f.DEFINE_float("efficiency", None, "Fraction of peak FLOP/s matmuls reach (default: calibrated "
                   "on Megatron-LM's 175B run; on the CPU, on the bench).")
    f.DEFINE_integer("top", 10, "Feasible layouts to list.")
    f.DEFINE_string("out", "runs/plan", "Directory for plan.png and plan.json.")
    f.DEFINE_string("bench_dir", "bench_results", "Where `make bench*` wrote its JSON.")
    f.DEFINE_bool("validate", False, "Print predictions against the published runs and exit.")
    f.DEFINE_bool("measured", False, "Print predictions against this machine's benchmarks and exit.")
    return flags.FLAGS


def _positive(name, value):
    if value is not None and value <= 0:
        raise UsageError(f"--{name}={value} must be > 0")


_SET_BY_PLAN = ("train.batch_size", "train.precision", "train.grad_accum_steps", "pipeline.stages",
                "pipeline.microbatches", "pipeline.recompute")


def _model_overrides(model, keys):
    return " ".join(f"--config.model.{'block_size' if k == 'seq_len' else k}={getattr(model, k)}" for k in keys)


def _model_from_flags(F):
    from ml_collections import config_flags
    if F.model and F.config:
        raise UsageError("give --config or --model, not both")
    if F.model:
        if F.model not in MODELS:
            raise UsageError(f"unknown --model '{F.model}'; choose one of {', '.join(MODELS)} "
                             f"or --config=configs/<name>.py")
        model, config_arg = MODELS[F.model], None
        batch = next((r["batch"] for r in PUBLISHED.values() if r["model"] == F.model), None)
    elif F.config:
        c = F.config
        name = os.path.splitext(os.path.basename(config_flags.get_config_filename(F["config"])))[0]
        model, batch = model_from_config(c, name), c.train.batch_size
        config_arg = f"--config={config_flags.get_config_filename(F['config'])}"
    elif F.n_layer or F.params:
        model, batch, config_arg = None, None, None
    else:
        raise UsageError("say which model: --config=configs/<name>.py, --model=<name> "
                         f"({', '.join(MODELS)}), or its sizes (--n_layer --n_embd --n_head --vocab_size)")
    sizes = {k: F[k].value for k in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len")
             if F[k].value is not None}
    for k, v in sizes.items():
        _positive(k, v)
    if model is None:
        missing = [k for k in ("n_layer", "n_embd", "n_head") if k not in sizes] if not F.params else []
        if missing:
            raise UsageError(f"sizes given directly need --{' --'.join(missing)} too")
        model = Model("custom", n_layer=sizes.get("n_layer", 0), n_embd=sizes.get("n_embd", 0),
                      n_head=sizes.get("n_head", 1), vocab_size=sizes.get("vocab_size", 50257),
                      seq_len=sizes.get("seq_len", 2048))
    else:
        model = dataclasses.replace(model, **sizes)
    if config_arg is None:  # tfdist's GPT (GELU, full attention) of the same sizes
        config_arg = "--config=configs/gpt2.py " + _model_overrides(model, ("n_layer", "n_embd", "n_head",
                                                                            "vocab_size", "seq_len"))
    else:  # the config file, the user's own overrides, then the sizes given directly
        own = [a for a in sys.argv if a.startswith("--config.") and a.split("=")[0][9:] not in _SET_BY_PLAN]
        config_arg = " ".join([config_arg, *own, _model_overrides(model, sizes)]).strip()
    if F.params is not None:
        _positive("params", F.params)
        model = dataclasses.replace(model, params_override=F.params)
    if model.n_layer and model.n_embd % model.n_head:
        raise UsageError(f"n_embd ({model.n_embd}) must be a multiple of n_head ({model.n_head})")
    return model, batch, config_arg


def main(argv):
    del argv
    F = _FLAGS
    if F.validate:
        print(f"fraction of peak that matmuls reach, calibrated on Megatron-LM 175B: {calibrated():.3f}")
        for r in validate():
            print(f"{r['role']:<11} {r['run']}\n            {r['metric']}: published {r['published']:,.1f}, "
                  f"predicted {r['predicted']:,.1f} ({r['error']:+.1%})\n            source: {r['source']}")
        z = zero_figure1()
        print("ZeRO Figure 1 (7.5B parameters, 64 devices), GB per device: " + ", ".join(
            f"{k} {z[i]:.2f}" for i, k in enumerate(("baseline", "ZeRO-1", "ZeRO-2", "ZeRO-3")))
            + " (paper: 120, 31.4, 16.6, 1.9)")
        return
    if F.device != CPU and F.device not in DEVICES:
        raise UsageError(f"unknown --device '{F.device}'; choose one of {', '.join(DEVICES)}, {CPU}")
    for name in ("devices", "per_node", "intra_node_gbps", "inter_node_gbps", "batch", "top", "dp", "tp",
                 "pp", "microbatch", "efficiency"):
        _positive(name, F[name].value)
    if F.zero is not None and F.zero not in (0, 1, 2, 3):
        raise UsageError(f"--zero={F.zero} must be 0, 1, 2 or 3")
    if F.efficiency is not None and F.efficiency > 1:
        raise UsageError(f"--efficiency={F.efficiency} is a fraction of peak: give a number in (0, 1]")
    model, config_batch, config_arg = _model_from_flags(F)
    if F.measured:
        if not model.n_layer:
            raise UsageError("--measured needs a model with sizes (e.g. --config=configs/gpt_mini.py)")
        for r in measured(F.bench_dir, model):
            if "missing" in r:
                print(f"{r['figure']:<52} not measured here: run `{r['missing']}`")
            else:
                print(f"{r['figure']:<52} predicted {r['predicted']:6.3f}  measured {r['measured']:6.3f}  "
                      f"({r['note']})")
        return
    device = cpu_device(F.bench_dir) if F.device == CPU else DEVICES[F.device]
    cluster = Cluster(device, F.devices, F.per_node or 0, (F.intra_node_gbps or 0) * GB,
                      (F.inter_node_gbps or 0) * GB)
    batch = F.batch or config_batch
    if not batch:
        raise UsageError("say the global batch: --batch=<sequences per optimizer step>")
    precision = F.precision or ("float32" if F.device == CPU else "mixed")
    eff = F.efficiency or 0.0
    if F.device == CPU and not eff:
        s = read_bench(F.bench_dir, "scaling.json")
        if s and model.n_layer:
            mini = model_from_config(_config(os.path.join(ROOT, "configs", "gpt_mini.py")), "gpt_mini")
            eff, _ = _fit_to_one_process(device, mini, s, Options(precision="float32"))
        else:
            eff = 0.5
    opts = Options(precision=precision, schedule=F.schedule, efficiency=eff)
    fixed = {k: F[k].value for k in ("dp", "tp", "pp", "microbatch", "zero") if F[k].value is not None}
    if F.recompute != "search":
        fixed["recompute"] = F.recompute == "on"
    _check_fixed(model, cluster, batch, fixed)
    plans = search(model, cluster, batch, fixed, opts) if model.n_layer else []
    if not model.n_layer:  # only a parameter count: model states per device, ZeRO stages
        for z in (0, 1, 2, 3):
            lay = Layout(dp=fixed.get("dp", cluster.count), zero=z)
            print(f"ZeRO-{z}: {memory(model, lay, batch, opts)['total'] / GB:.2f} GB of model states per device")
        return
    if not plans:
        raise UsageError(f"no layout of {cluster.count} devices splits a batch of {batch} and "
                         f"{model.n_layer} layers as asked; change --batch, --devices or the fixed dims")
    _report(model, cluster, batch, plans, opts, config_arg, F)


def _config(path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def _check_fixed(model, cluster, batch, fixed):
    g = cluster.count
    tp, pp = fixed.get("tp", 1), fixed.get("pp", 1)
    if model.n_layer and model.n_head % tp:
        raise UsageError(f"--tp={tp} must divide the {model.n_head} attention heads")
    if model.n_layer and pp > model.n_layer:
        raise UsageError(f"--pp={pp} is more stages than the model's {model.n_layer} layers")
    if "dp" in fixed and ("tp" in fixed and "pp" in fixed) and fixed["dp"] * tp * pp != g:
        raise UsageError(f"dp x tp x pp = {fixed['dp'] * tp * pp} but --devices={g}; make them equal")
    if g % (tp * pp):
        raise UsageError(f"--devices={g} is not a multiple of tp x pp = {tp * pp}")
    if fixed.get("zero", 0) >= 2 and pp > 1:
        raise UsageError(f"--zero={fixed['zero']} with --pp={pp}: ZeRO-2/3 shard the gradients that each "
                         f"pipeline stage accumulates over its microbatches; use --zero=1 or --pp=1")
    if fixed.get("zero", 0) and fixed.get("dp") == 1:
        raise UsageError("ZeRO shards over data-parallel replicas and --dp=1 has none; drop --zero")
    dp = fixed.get("dp", g // (tp * pp) if ("tp" in fixed or "pp" in fixed) else None)
    if dp:
        mb = fixed.get("microbatch", 1)
        if batch % (dp * mb):
            raise UsageError(f"--batch={batch} does not split into {dp} data-parallel replicas x "
                             f"microbatches of {mb}; give a batch that is a multiple of {dp * mb}")


def _report(model, cluster, batch, plans, opts, config_arg, F):
    feasible = [p for p in plans if p.fits]
    print(f"{model.name}: {model.params / 1e9:.2f} B parameters, {model.seq_len} tokens per sequence; "
          f"batch {batch} sequences; {cluster.count} x {cluster.device.name} "
          f"({cluster.device.memory / GB:.1f} GB, {cluster.device.peak(opts.precision) / 1e12:,.1f} TFLOP/s peak ({opts.precision}), "
          f"{cluster.node()} per node); matmuls at {(opts.efficiency or calibrated()):.1%} of peak; "
          f"{len(plans)} layouts, {len(feasible)} fit")
    if feasible:
        print(format_table(feasible[:F.top], cluster))
    over = [p for p in plans if not p.fits]
    if over:  # those that would be fastest if they fitted, with what overflows
        over.sort(key=lambda p: -p.tokens_per_sec)
        print(f"\ndo not fit ({len(over)}), fastest first:")
        for p in over[:min(F.top, 5)]:
            print(f"  {str(p.layout):<40} {p.overflow}")
    best = next((p for p in feasible if runnable(p, cluster)), None)
    print()
    if feasible:
        b = feasible[0]
        print(f"best: {b.layout}: {b.tokens_per_sec:,.0f} tokens/s, MFU {b.mfu:.1%}, "
              f"{b.memory['total'] / GB:.1f} GB per device, bound by {b.time['bottleneck']}")
    if best is None:
        print("no layout tfdist can run today fits (tfdist has no tensor parallelism or ZeRO yet)")
    else:
        if best is not feasible[0]:
            print(f"best that tfdist runs today (no tensor parallelism or ZeRO yet): {best.layout}, "
                  f"{best.tokens_per_sec / feasible[0].tokens_per_sec:.0%} of the best's speed")
        print("  " + tfdist_command(best, cluster, batch, config_arg or "--config=<your config>",
                                     opts.precision))
    os.makedirs(F.out, exist_ok=True)
    shown = feasible[:F.top] or over[:F.top]
    chart(shown, cluster, os.path.join(F.out, "plan.png"),
          f"{model.name} on {cluster.count} x {cluster.device.name}, batch {batch}")
    with open(os.path.join(F.out, "plan.json"), "w") as f:
        json.dump({"model": dataclasses.asdict(model), "devices": cluster.count,
                   "device": dataclasses.asdict(cluster.device), "batch": batch,
                   "efficiency": opts.efficiency or calibrated(),
                   "plans": [{"layout": dataclasses.asdict(p.layout), "fits": p.fits, "memory": p.memory,
                              "time": p.time, "tokens_per_sec": p.tokens_per_sec, "mfu": p.mfu,
                              "overflow": p.overflow} for p in plans]}, f, indent=1)
    print(f"wrote {os.path.join(F.out, 'plan.png')} and plan.json")


_FLAGS = None


def run(argv=None):
    global _FLAGS
    from tfdist import cli
    _FLAGS = _define_flags()
    cli.run(main, argv or sys.argv)


if __name__ == "__main__":
    run()
