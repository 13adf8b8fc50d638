"""Per-layer decisions (PaSE, Elango 2021): for tfdist's GPT on a mesh of `t` devices
(`tfdist.parallel.mesh`, Keras's ModelParallel), a dynamic program over the layers picks, for each
layer that can be split, whether it is: the token embedding by vocabulary rows
(vocabulary-parallel), an untied head by vocabulary columns, each block's attention (its q|k|v
kernel by input rows) and each block's MLP (its first kernel by input rows); and which blocks
recompute their forward in the backward pass (their input kept, not their activations:
`keras.remat`). The result is a layout map a user reads, and passes to
`tfdist.plan.layers.to_layout_map(path, mesh)`, with the blocks to recompute for
`GPT(recompute=...)`.

The model of a layer, per device, on this machine's rates:

    memory   its weights, gradients and Adam's two moments (float32, as Keras keeps them: 16 bytes
             a parameter), over t when split; the activations and the logits are the same either
             way (a row-split kernel's output is summed whole on every device) and are counted
             once, as `fixed`
    time     its matmuls' FLOPs (forward and backward: 6 a parameter and token) at the device's
             rate, over t when split; a split layer adds its collectives: the summed output's
             all-reduce and, backward, the all-gather of its input's gradient (the embedding: one
             all-reduce of its output; the head: the logits' all-gather)

A block recomputed keeps its input only and runs its forward once more (2 FLOPs a parameter and
token, priced as if whole: an upper bound); one block's activations are then held while it
recomputes. Between layers every activation is whole on every device, so one layer's choice
does not change the next one's cost (PaSE's DP carries the layout at the boundary; here that
state is always "whole"): the program is a knapsack over the layers, minimising the step's time
with the memory a device holds within its budget, on a grid of 1/`GRID` of the budget (each
layer's bytes rounded up: what it picks fits; 10 times finer where that leaves nothing). A layer
is split, or a block recomputed, only where memory requires it or where it is faster.

    >>> from tfdist.plan import layers, model as m
    >>> gpt = m.Model(name="g", n_layer=2, n_embd=256, n_head=4, vocab_size=50304, seq_len=256)
    >>> rates = layers.Rates(flops=50e9, allreduce_bw=0.3e9)
    >>> roomy = layers.plan(gpt, t=4, tokens=2048, budget=2e9, rates=rates)
    >>> roomy.split["wte"]
    False
    >>> tight = layers.plan(gpt, t=4, tokens=2048, budget=roomy.bytes - 100e6, rates=rates)
    >>> tight.split["wte"]
    True
"""
import dataclasses
import json
import math

from tfdist.errors import UsageError

GRID = 2000  # memory buckets of the budget
STATE = 16  # bytes a parameter: float32 weight, gradient and Adam's two moments


@dataclasses.dataclass(frozen=True)
class Rates:
    """A device's matmul rate (FLOP/s) and the all-reduce's bus bandwidth (bytes/s)."""
    flops: float
    allreduce_bw: float


@dataclasses.dataclass(frozen=True)
class Option:
    split: bool
    seconds: float
    bytes: float
    axes: tuple = None  # the weight's layout when chosen (None: whole)


@dataclasses.dataclass
class Plan:
    picks: dict  # layer name -> the index of its chosen option (0: whole, or kept)
    seconds: float
    bytes: float  # a device's
    fixed: float  # a device's bytes that no choice changes (activations, logits, norms)
    options: dict  # layer name -> (whole Option, split Option, ...)
    paths: dict = None  # layer name -> its weight's LayoutMap key (a user's model; None: GPT's)

    @property
    def split(self):
        """{layer name: whether it is split (a block: recomputed)}."""
        return {name: bool(k) for name, k in self.picks.items()}

    def recomputed(self):
        """The blocks whose forward is recomputed in the backward (`GPT(recompute=...)`)."""
        return [int(n.split(".")[1]) for n, on in self.split.items()
                if n.startswith("remat.") and on]

    def layout_map(self):
        """{regex of tfdist's GPT weight paths: axes}: the split layers' (Keras's LayoutMap keys,
        over the mesh axis "model")."""
        out = {}
        for name, split in self.split.items():
            if not split or name.startswith("remat."):
                continue
            if self.paths is not None:  # a user's model: the chosen option's axes
                out[self.paths[name]] = self.options[name][self.picks[name]].axes
            else:
                key, axes = _KEYS[name.split(".")[0]]
                out[key.format(i=name.split(".")[-1])] = axes
        return out

    def to_json(self):
        return {"split": self.split, "seconds": self.seconds, "bytes": self.bytes,
                "fixed_bytes": self.fixed, "layout_map": self.layout_map(),
                "recompute": self.recomputed(),
                "options": {k: [dataclasses.asdict(o) for o in v]
                            for k, v in self.options.items()}}


# layer kind -> (LayoutMap key of its weight, axes) for tfdist's GPT (tfdist.models.gpt)
_KEYS = {"wte": (r"gpt/wte/embeddings", ("model", None)),
         "head": (r"gpt/lm_head/kernel", (None, "model")),
         "attn": (r"gpt/h_{i}/attn/c_attn/kernel", ("model", None)),
         "mlp": (r"gpt/h_{i}/c_fc/kernel", ("model", None))}


def _allreduce(nbytes, t, bw):
    return 2 * (t - 1) / t * nbytes / bw


def _gather(nbytes, t, bw):
    return (t - 1) / t * nbytes / bw


def options(model, t, tokens, rates, memory_of=None, recompute=False):
    """{layer: (whole Option, split Option)} for `model` (a `tfdist.plan.model.Model`) on `t`
    devices, `tokens` a step; with `recompute`, each block's `remat.<i>` too: (kept, recomputed:
    only its input kept, its forward run again in the backward). `memory_of(kind, params)`: a
    layer's bytes (default: STATE bytes a parameter; a test's companion passes another)."""
    memory_of = memory_of or (lambda kind, params: STATE * params)
    h, v, f = model.n_embd, model.vocab_size, model.ffn_width
    kv = model.kv
    act = tokens * h * 4  # one whole activation (float32)
    out = {}

    def add(name, kind, params, flops, comm):
        whole = Option(False, flops / rates.flops, memory_of(kind, params))
        split = Option(True, flops / t / rates.flops + comm, memory_of(kind, params) / t)
        out[name] = (whole, split)

    add("wte", "wte", v * h, 0.0, _allreduce(act, t, rates.allreduce_bw))
    for i in range(model.n_layer):
        qkv = h * (h + 2 * kv)
        add(f"attn.{i}", "attn", qkv + h * h, 6 * tokens * (qkv + h * h),
            _allreduce(tokens * (h + 2 * kv) * 4, t, rates.allreduce_bw)
            + _gather(act, t, rates.allreduce_bw))
        up = h * f * (2 if model.gated_mlp else 1)
        add(f"mlp.{i}", "mlp", up + f * h, 6 * tokens * (up + f * h),
            _allreduce(tokens * up // h * 4, t, rates.allreduce_bw)
            + _gather(act, t, rates.allreduce_bw))
    if not model.tied_embeddings:
        add("head", "head", h * v, 6 * tokens * h * v,
            _gather(tokens * v * 4, t, rates.allreduce_bw))
    if recompute:
        kept = model.activation_bytes_per_layer(tokens, "float32")
        again = 2 * tokens * (model.layer_params()) / rates.flops  # its forward once more
        for i in range(model.n_layer):  # (the forward's time as if whole: an upper bound)
            out[f"remat.{i}"] = (
                Option(False, 0.0, kept),
                Option(True, again, model.activation_bytes_per_layer(tokens, "float32",
                                                                     recompute=True)))
    return out


def fixed_bytes(model, tokens, recompute=False):
    """What a device holds whichever layers are split: every block's activations (Korthikanti's
    count, float32; with `recompute`, one block's, what recomputing it holds in its backward: the
    blocks' own are their `remat` items), the logits and their gradient, the norms' states."""
    layer = model.activation_bytes_per_layer(tokens, "float32")
    acts = layer if recompute else model.n_layer * layer
    logits = 2 * tokens * model.vocab_size * 4
    norms = STATE * (2 * model.n_layer + 1) * model.n_embd
    return acts + logits + norms


def plan(model, t, tokens, budget, rates, memory_of=None, fixed=None, recompute=True):
    """The fastest per-layer split (and, with `recompute`, which blocks recompute) within `budget`
    bytes a device (a Plan); UsageError, one line, when even every layer split does not fit."""
    opts = options(model, t, tokens, rates, memory_of, recompute)
    fixed = fixed_bytes(model, tokens, recompute) if fixed is None else fixed
    return solve(opts, fixed, budget, t, tokens)


def solve(opts, fixed, budget, t, tokens):
    """The Plan of the options `opts` ({layer: (Option, ...)}) with `fixed` bytes a device held
    whatever they choose: the least seconds within `budget`."""
    room = budget - fixed
    least = fixed + sum(min(x.bytes for x in o) for o in opts.values())
    if room <= 0 or least > budget:
        raise UsageError(f"no per-layer split of the model fits {budget / 2 ** 30:.3g} GiB a "
                         f"device on {t} devices: with every layer split it needs "
                         f"{least / 2 ** 30:.3g} GiB ({fixed / 2 ** 30:.3g} GiB of activations "
                         f"and logits at {tokens} tokens); lower the batch or add devices")
    names = list(opts)
    for grid in (GRID, 10 * GRID):  # (each option's bytes rounded up to a cell: a finer grid
        chosen = _knapsack(opts, names, room / grid, grid)  # where that leaves nothing)
        if chosen is not None:
            break
    else:
        raise UsageError(f"no per-layer split of the model fits {budget / 2 ** 30:.4g} GiB a "
                         f"device on {t} devices with room to spare: every layer split needs "
                         f"{least / 2 ** 30:.4g} GiB; raise the budget a little or lower the "
                         f"batch")
    total = fixed + sum(opts[n][k].bytes for n, k in chosen.items())
    seconds = sum(opts[n][k].seconds for n, k in chosen.items())
    return Plan({n: chosen[n] for n in names}, seconds, total, fixed, opts)


def _knapsack(opts, names, unit, grid):
    """{layer: its option's index} with the least seconds whose bytes, each rounded up to a cell
    of `unit` bytes, fit `grid` cells; None where none does."""
    inf = math.inf
    # best[m]: the least seconds of the layers so far within m cells; each layer's pick per m
    best = [0.0] * (grid + 1)
    picks = []
    for name in names:
        nxt = [inf] * (grid + 1)
        pick = [None] * (grid + 1)
        for k, option in enumerate(opts[name]):
            need = math.ceil(option.bytes / unit - 1e-9)
            for m in range(need, grid + 1):
                s = best[m - need] + option.seconds
                if s < nxt[m]:  # (ties keep the whole layer: it comes first)
                    nxt[m], pick[m] = s, k
        best = nxt
        picks.append(pick)
    m = min(range(grid + 1), key=lambda i: (best[i], i))
    if best[m] == inf:
        return None
    chosen = {}
    for name, pick in zip(reversed(names), reversed(picks)):
        chosen[name] = pick[m]
        m -= math.ceil(opts[name][pick[m]].bytes / unit - 1e-9)
    return chosen


def keras_options(model, t, rows, rates, memory_of=None):
    """({layer: (Option, ...)}, {layer: its kernel's path}, the other weights' bytes) of a built
    Keras model under keras.distribution on `t` devices, `rows` rows a step: each Dense and
    EinsumDense kernel whole, by input rows (the output summed: an all-reduce; backward, the
    input's gradient gathered) or by output columns (the output gathered; backward, the input's
    gradient summed), and each Embedding by vocabulary rows (the lookup summed) or whole, each
    layer's output whole on every device after it (as tfdist's GPT: so the choices are
    independent). A layer's tokens are its output's positions a row (its shape's inner
    dimensions); its matmul 6 FLOPs a parameter and token."""
    import numpy as np
    from keras import layers as kl
    memory_of = memory_of or (lambda kind, params: STATE * params)
    opts, paths, placed = {}, {}, set()
    for layer in _leaves(model):
        kind = ("embedding" if isinstance(layer, kl.Embedding) else "dense"
                if isinstance(layer, (kl.Dense, kl.EinsumDense)) else None)
        if kind is None:
            continue
        w = layer.embeddings if kind == "embedding" else layer.kernel
        shape = tuple(int(d) for d in w.shape)
        params = int(np.prod(shape))
        out_shape = tuple(layer.output.shape)[1:] if _has_output(layer) else ()
        tokens = rows * int(np.prod(out_shape[:-1] or (1,)))
        width_in, width_out = shape[0], params // shape[0]
        bytes_ = memory_of(kind, params)
        flops = 0.0 if kind == "embedding" else 6 * tokens * params
        bw = rates.allreduce_bw
        out_bytes, in_bytes = tokens * width_out * 4, tokens * width_in * 4
        rows_split = (flops / t / rates.flops + _allreduce(out_bytes, t, bw)
                      + (0.0 if kind == "embedding" else _gather(in_bytes, t, bw)))
        choices = [Option(False, flops / rates.flops, bytes_),
                   Option(True, rows_split, bytes_ / t, ("model",) + (None,) * (len(shape) - 1))]
        if kind == "dense":
            columns = flops / t / rates.flops + _gather(out_bytes, t, bw) + _allreduce(
                in_bytes, t, bw)
            choices.append(Option(True, columns, bytes_ / t,
                                  (None,) * (len(shape) - 1) + ("model",)))
        opts[layer.name] = tuple(choices)
        paths[layer.name] = w.path
        placed.add(id(w))
    rest = sum(STATE * int(np.prod(v.shape)) for v in model.trainable_variables
               if id(v) not in placed)
    return opts, paths, rest


def keras_plan(model, t, rows, budget, rates, activations=0.0, memory_of=None):
    """The fastest per-layer layout of a user's built Keras model on `t` devices within `budget`
    bytes a device (its `activations` a step, e.g. `tfdist.parallel.budget.measure`'s, held
    either way): a Plan whose `layout_map()` is {kernel path: axes}."""
    opts, paths, rest = keras_options(model, t, rows, rates, memory_of)
    if not opts:
        raise UsageError("the model has no Dense, EinsumDense or Embedding layer to split: "
                         "nothing to plan per layer")
    p = solve(opts, rest + activations, budget, t, rows)
    p.paths = paths
    return p


def to_layout_map(p, device_mesh):
    """A keras.distribution.LayoutMap on `device_mesh` of plan `p` (a user's model's, or the
    path of one `write` wrote)."""
    import keras
    layouts = keras.distribution.LayoutMap(device_mesh)
    for key, axes in (read_layout_map(p) if isinstance(p, str) else p.layout_map()).items():
        layouts[key] = axes
    return layouts


def _leaves(model):
    """The model's layers, nested models' layers in their place, each once."""
    import keras
    seen, out = set(), []

    def visit(container):
        for layer in container.layers:
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            if isinstance(layer, keras.Model):
                visit(layer)
            else:
                out.append(layer)
    visit(model)
    return out


def _has_output(layer):
    try:
        return layer.output is not None
    except (AttributeError, ValueError):  # (a subclassed model's layer: no symbolic output)
        return False


def write(p, path):
    from tfdist.data import store
    store.write_atomic(path, json.dumps(p.to_json(), indent=1))


def read_layout_map(path):
    """{regex: axes} of a plan written by `write` (`tfdist.models.gpt.layout_map(mesh,
    plan=path)`)."""
    try:
        with open(path) as f:
            return {k: tuple(v) for k, v in json.load(f)["layout_map"].items()}
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot read the per-layer plan {path} ({e}); write one with "
                         f"`tfdist plan --per_layer`") from None
