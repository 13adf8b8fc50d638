"""The bytes a device holds for a layout, by part: weights, gradients, optimizer state,
activations, ZeRO-3's gathered weights, and what ZeRO-Offload moves off the device; and an
offloaded update's bytes read and written. The planner prices layouts with it (`tfdist.plan`),
and `tfdist train` states it at start (`tfdist.train.expected_memory`).

`model` is a `tfdist.models.arithmetic.Transformer` (the planner's `Model`), `layout` a
`tfdist.parallel.layout.Layout`; `opts` anything with the planner's `Options` fields it reads
(default: `Options()`'s): precision, schedule, vocab_parallel, offload_subgroup, and for
`offload_io`'s seconds disk_read_bw, disk_write_bw, cpu_adam_rate (and cpu_adam_disk_rate: the
CPU step's rate with its state on the disk, which shares the cores with its reads and writes).

Example (GPT-2 XL's shape, ZeRO-3 over 1 replica with disk offload: nothing of the model's state
stays on the device but the gathered units):

    >>> from tfdist.models.arithmetic import Transformer
    >>> from tfdist.parallel.layout import Layout
    >>> from tfdist.parallel.memory import Defaults, memory
    >>> xl = Transformer(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, seq_len=256)
    >>> parts = memory(xl, Layout(dp=1, zero=3, offload="disk", batch=1, seq=256),
    ...                Defaults(precision="float32"))
    >>> round(parts["offloaded"] / 2**30, 1), parts["weights"], parts["optimizer"]
    (17.4, 0.0, 0.0)
"""
import dataclasses
import math

from tfdist.models import arithmetic

STATE_BYTES = arithmetic.STATE_BYTES  # {"mixed": (2, 2, 12), "float32": (4, 4, 8)}


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The fields of the planner's `Options` that the memory model reads, with its defaults."""
    precision: str = "mixed"
    schedule: str = "gpipe"
    vocab_parallel: bool = True
    offload_subgroup: float = 2 ** 25
    disk_read_bw: float = 0.0
    disk_write_bw: float = 0.0
    cpu_adam_rate: float = 0.0
    cpu_adam_disk_rate: float = 0.0


def stage_params(model, pp, tp=1, vocab_parallel=True):
    """Parameters of the largest pipeline stage (blocks split as evenly as possible; the
    embedding on the first stage, the untied head and final norm on the last), per device of its
    `tp` tensor-parallel ones: the blocks split over them, the embedding and head too when
    `vocab_parallel` (else whole on one of them)."""
    layers = math.ceil(model.n_layer / pp) * model.layer_params() / tp
    if getattr(model, "params_override", 0):
        return model.params_override / pp / tp
    v = tp if vocab_parallel else 1
    emb = model.embedding_params() / v
    if pp == 1:
        return layers + emb
    head = model.head_params() / v  # the last stage holds the head (a copy, if tied)
    return layers + max(emb - (0 if model.tied_embeddings else head), head)


def activation_bytes_per_layer(model, layout, tokens, precision):
    """Bytes one transformer layer keeps for its backward pass, for `tokens` tokens of one
    microbatch, split over the layout's tensor-parallel ranks: Korthikanti et al. 2022
    (arXiv:2205.05198) eq. 2, s b h (34 + 5 a s / h) at 2 bytes per value, of which 24 + 5as/h
    are split by tensor parallelism, and all of it with sequence parallelism (eq. 4, `layout.sp`);
    generalised to grouped-query attention, gated MLPs, no dropout and FlashAttention
    (tfdist.models.arithmetic.Transformer.activation_bytes_per_layer)."""
    return model.activation_bytes_per_layer(tokens, precision, layout.tp, sp=layout.sp)


def memory(model, layout, opts=None):
    """Bytes per device, by part, for the largest stage. Offloaded (`layout.offload`: host or
    disk, tfdist.parallel.zero.offload) the optimizer state, and under ZeRO-3 the master weights,
    leave the device for the store ("offloaded", in host memory or on disk; not in the total),
    under ZeRO-3 the gradients for host memory ("host_gradients"; not in the total either),
    "buffers" holds the CPU step's sub-groups in flight (host memory; not in the total), and
    "update_peak" is what the CPU step holds at once in host memory (not in the total)."""
    opts = opts or Defaults()
    pb, gb, ob = STATE_BYTES[opts.precision]
    n = stage_params(model, layout.pp, layout.tp, opts.vocab_parallel)
    d, z = layout.dp, layout.zero
    parts = {"weights": n * pb / (d if z >= 3 else 1),
             "gradients": n * gb / (d if z >= 2 else 1),
             "optimizer": n * ob / (d if z >= 1 else 1)}
    off, buffers = {}, 0.0
    if layout.offload != "none" and z:
        off["optimizer"], parts["optimizer"] = parts["optimizer"], 0.0
        if z >= 3:
            off["weights"], parts["weights"] = parts["weights"], 0.0
            # (handed to host memory unit by unit in the backward pass)
            off["gradients"], parts["gradients"] = parts["gradients"], 0.0
        # three sub-groups in flight (one read ahead, one updated, one written behind), each its
        # 12 bytes per parameter (weight, two moments) up to four times: the buffer read, the
        # stand-ins' TF copy, the updated value, the buffer written
        buffers = 3 * 4 * min(opts.offload_subgroup, n / d) * 12
    if getattr(model, "params_override", 0) and not model.n_layer:
        return {**parts, "activations": 0.0, "total": sum(parts.values())}
    if z >= 3:
        # gathered whole while they run: a layer's weights, and the next one's (prefetch,
        # tfdist.parallel.zero.weights; the embedding's unit is smaller than two layers for every
        # model here)
        parts["gathered"] = 2 * model.layer_params() / layout.tp * pb
    tokens = layout.microbatch * model.seq_len
    m = layout.passes
    in_flight = (min(m, layout.pp) if opts.schedule == "1f1b" else m) if layout.pp > 1 else 1
    layers = math.ceil(model.n_layer / layout.pp)
    layer = activation_bytes_per_layer(model, layout, tokens, opts.precision)
    if layout.recompute:  # each layer keeps its input; one layer's full set while recomputing
        kept = model.activation_bytes_per_layer(tokens, opts.precision, recompute=True)
        acts = layers * in_flight * kept + layer
    else:
        acts = layers * in_flight * layer
    logits = model.logits_bytes(tokens, layout.tp if opts.vocab_parallel else 1) * \
        (in_flight if opts.schedule == "gpipe" else 1)
    parts["activations"] = acts + logits
    parts["total"] = sum(parts.values())
    if off:  # off the device
        parts["buffers"] = buffers  # (host memory)
        parts["host_gradients"] = off.pop("gradients", 0.0)
        parts["offloaded"] = sum(off.values())
        # the CPU step's peak in host memory: the update's gradients taken out of host memory and
        # their clipped copy (the step clips in its graph), and the sub-groups in flight
        parts["update_peak"] = 2 * (parts["host_gradients"] or n * gb / d) + parts["buffers"]
    return parts


def offload_io(model, layout, opts=None):
    """One optimizer update's offload per device, for disk offload (host: the same bytes in
    memory): {"read", "written": bytes; "update_s": the CPU step's seconds, each sub-group's
    read, update and write overlapped with its neighbours' (prefetch), so the slowest of the
    three; "passes_read_s": ZeRO-3's reads of the weights by the forward and the backward pass,
    which prefetch overlaps with their compute} (the seconds None without the measured rates).
    The CPU step reads and writes each owned parameter's state: tfdist's store holds float32
    (Keras keeps float32 variables under mixed precision), Adam's two moments, and ZeRO-3's
    master weight."""
    opts = opts or Defaults()
    n = stage_params(model, layout.pp, layout.tp, opts.vocab_parallel) / layout.dp
    state = n * (8 + (4 if layout.zero >= 3 else 0))
    read = state + (2 * n * 4 if layout.zero >= 3 else 0)
    written = state
    out = {"read": read, "written": written, "update_s": None, "passes_read_s": None}
    if opts.disk_read_bw and opts.disk_write_bw and opts.cpu_adam_rate:
        rate = (opts.cpu_adam_disk_rate or opts.cpu_adam_rate) if layout.offload == "disk" \
            else opts.cpu_adam_rate
        out["update_s"] = max(state / opts.disk_read_bw, written / opts.disk_write_bw, n / rate)
        out["passes_read_s"] = (read - state) / opts.disk_read_bw
    return out
