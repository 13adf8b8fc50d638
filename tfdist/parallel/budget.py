"""`tfdist.strategies.get("auto")`: a user's Keras model measured once it is built, and trained
in the least costly way that fits a process's memory budget at the batch its data asks for.

At the model's first `fit` (`KerasProgram.stepped`) tfdist measures, on this process:

* its weights (trainable and not) and gradients: their bytes, as Keras holds them;
* its optimizer's slots per weight: a copy of the optimizer (from its config) built on one
  variable, counted (Adam: 2; with Keras's gradient accumulation: 3);
* one step's activations: the allocator's peak (`tf.config.experimental.get_memory_info`) over a
  forward and backward pass of this replica's share of the data's first batch, less its peak
  over one row (the gradients and the step's fixed temporaries), scaled to the rows. The
  model's state (a BatchNormalization's moving statistics, its dropout seeds) is put back after
  the probe: training computes what it would without it. (TF's CPU allocator counts in chunks of
  up to 1 MiB: a model's activations are resolved to about that.)

Then it takes the first option, in order of cost, that fits the budget (`memory_gb`, default:
this host's available memory shared by its processes): each of these layouts with its batch in
1, 2, 4, ... pieces a step (gradient accumulation: the data re-batched, the same rows an update;
the sums kept between pieces: every gradient's, 1/replicas under ZeRO-2 and 3), before the next
layout:

    data parallel     weights + gradients + slots + activations
    ZeRO-1, ZeRO-2    weights + gradients + their padded pieces and flat buffer (the
                      reduce-scatter's) + slots / replicas + activations (stage 2 shards only the
                      sums accumulated between steps)
    ZeRO-3            (weights + gradients + slots) / replicas + two units gathered
                      + activations (tfdist.parallel.zero.weights: a unit is a layer)
    ZeRO-3, offload   ZeRO-3 with the master weights and slots in host memory (a GPU's
      to host         budget; on a CPU the host's memory is the device's: not offered)
    ZeRO-3, offload   the master weights and slots on disk; the process keeps the gathered
      to disk         units, the activations, its share of the gradients and the CPU step's
                      buffers

in that order because each adds traffic or copies the one before does not (the flat buffers'
copies; the gathers and a recomputed forward; host copies; disk reads and writes: 1.07x, 1.11x,
1.36x and 2.9x plain data parallel's step in bench_results/zero.json and offload.json), and
accumulation only a pass's fixed time per piece. Where nothing fits, one
line says what the least needs. The data is re-batched where it is a tf.data.Dataset
(unbatched and batched again, in order) or arrays with `batch_size`; `steps_per_epoch` grows by
the pieces.

    >>> from tfdist.parallel import budget
    >>> m = budget.Measured(trainable=400e6, frozen=0, slots=2, activations=80e6, rows=8,
    ...                        unit=40e6)
    >>> budget.choose(m, replicas=2, budget=1.2e9, device="cpu").name
    'ZeRO-3'
    >>> budget.choose(m, replicas=2, budget=3e9, device="cpu").name
    'data parallel'
"""
import dataclasses

from tfdist.errors import UsageError

#: The layouts in order of cost: (name, ZeRO stage, offload).
LAYOUTS = (("data parallel", 0, "none"), ("ZeRO-1", 1, "none"), ("ZeRO-2", 2, "none"),
           ("ZeRO-3", 3, "none"),
           ("ZeRO-3, offloaded to host memory", 3, "host"),
           ("ZeRO-3, offloaded to disk", 3, "disk"))
SUBGROUP = 2 ** 25  # parameters per sub-group of the offloaded CPU step (zero.offload's)


@dataclasses.dataclass(frozen=True)
class Measured:
    """A built model's bytes (float32 as Keras holds them): trainable and other weights, the
    optimizer's slots per trainable weight, a step's activations at `rows` rows a replica, and the
    largest ZeRO-3 unit's weights."""
    trainable: float
    frozen: float
    slots: int
    activations: float
    rows: int
    unit: float

    def describe(self):
        gib = 2 ** 30
        return (f"weights {(self.trainable + self.frozen) / gib:.3g} GiB, optimizer "
                f"{self.slots * self.trainable / gib:.3g} GiB ({self.slots} slot(s) a weight), "
                f"activations {self.activations / gib:.3g} GiB at {self.rows} row(s) a replica "
                f"(measured)")


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str
    zero: int
    offload: str
    bytes: float  # a process's
    others: tuple  # ((name, bytes), ...) of the options before it (they did not fit)
    accumulate: int = 1  # batches per update (the data re-batched into k pieces)
    index: int = 0  # its place in `options`' order of cost

    @property
    def describe(self):
        return self.name + (f", {self.accumulate} batches per update" if self.accumulate > 1
                            else "")


def process_bytes(m, layout, replicas, accumulate=1):
    """Bytes a process holds under `layout` (one of LAYOUTS's), its batch in `accumulate`
    pieces."""
    _, zero, offload = layout
    states = m.trainable * (2 + m.slots)  # weights, gradients, slots
    acts = m.activations / accumulate
    # with accumulation, the sums kept between a step and the next: every variable's, or (ZeRO-2,
    # ZeRO-3) this replica's share
    acts += 0 if accumulate == 1 else m.trainable / (replicas if zero >= 2 else 1)
    if not zero:
        return states + m.frozen + acts
    if zero < 3:  # the slots sharded over the replicas; the step's whole gradients, their
        # padded pieces and flat buffer at the reduce-scatter (tfdist.parallel.zero.optimizer:
        # stage 2 shards only the sums that outlive a step)
        return 4 * m.trainable + m.slots * m.trainable / replicas + m.frozen + acts
    gathered = 2 * m.unit
    if offload == "none":
        return states / replicas + m.frozen + gathered + acts
    if offload == "host":
        return m.frozen + gathered + acts  # (the rest in host memory)
    params = m.trainable / 4 / replicas
    buffers = 3 * 4 * min(SUBGROUP, params) * 12
    return m.frozen + gathered + acts + m.trainable / replicas + buffers


def options(m, replicas, device):
    """Every option in order of cost: (layout, batches per update, bytes a process). Each layout
    of LAYOUTS (host offload on GPUs only) at 1, 2, 4, ... batches per update (its replica's rows
    split evenly): accumulation costs a pass's fixed time per piece, less than the next layout's
    traffic."""
    out = []
    for layout in LAYOUTS:
        if layout[2] == "host" and device != "gpu":
            continue  # (a CPU's device memory is its host's: host offload saves nothing)
        if layout[1] in (1, 2) and replicas == 1:
            continue  # (nothing to shard over)
        k = 1
        while k <= m.rows:
            if m.rows % k == 0:
                out.append((layout, k, process_bytes(m, layout, replicas, k)))
            k *= 2
    return out


def choose(m, replicas, budget, device):
    """The first option (`options`) that fits `budget` bytes a process, with `replicas` replicas;
    UsageError when none does."""
    every = options(m, replicas, device)
    for index, (_, _, need) in enumerate(every):
        if need <= budget:
            return choose_at(m, index, replicas, device)
    gib = 2 ** 30
    least = min(every, key=lambda t: t[2])
    raise UsageError(f"strategy auto: the model does not fit in {budget / gib:.3g} GiB a process "
                     f"at {m.rows} row(s) a replica: {m.describe()}; the least, {least[0][0]} "
                     f"in {least[1]} batch(es) an update, needs {least[2] / gib:.3g} GiB; pass a "
                     f"larger memory_gb, a smaller batch, or run more processes")


def choose_at(m, index, replicas, device):
    """The Choice of option `index` (another process's: every process takes the costliest), with
    the whole-batch needs of the layouts before it."""
    every = options(m, replicas, device)
    layout, k, need = every[index]
    before = tuple((x[0][0], x[2]) for x in every[:index] if x[1] == 1)
    return Choice(layout[0], layout[1], layout[2], need, before, k, index)


def lines(m, choice, replicas, budget):
    gib = 2 ** 30
    out = [f"tfdist: auto: {m.describe()}; {replicas} replica(s), {budget / gib:.3g} GiB a "
           f"process",
           f"tfdist: auto: chose {choice.describe}: {choice.bytes / gib:.3g} GiB a process"
           + (f" (the data re-batched into {choice.accumulate} pieces: the same rows an update)"
              if choice.accumulate > 1 else "")]
    for name, need in choice.others:
        out.append(f"tfdist: auto: not {name}: it needs {need / gib:.3g} GiB")
    return out


# ---------------------------------------------------------------------------------------------
# The measurement (TensorFlow from here).


def measure(model, batch, replicas):
    """Measured of a built, compiled `model` from `batch` (the data's first batch: x, y and
    optionally sample weights, `replicas` replicas' worth of rows)."""
    from tfdist.parallel.zero.weights import units_of
    from tfdist.runtime.lazy import keras
    trainable = sum(_nbytes(v) for v in model.trainable_variables)
    frozen = sum(_nbytes(v) for v in model.non_trainable_variables)
    units = units_of(model)
    unit = max((u.parameters * 4 for u in units), default=0)
    x, y, sw = keras.utils.unpack_x_y_sample_weight(batch)
    rows = max(1, _rows(x) // max(replicas, 1))
    peak = _step_peak(model, x, y, sw, rows)
    if rows > 1:  # (the gradients and the step's fixed temporaries are in both peaks)
        activations = (peak - _step_peak(model, x, y, sw, 1)) * rows / (rows - 1)
    else:
        activations = peak - trainable
    activations = max(0.0, activations)
    return Measured(float(trainable), float(frozen), _slots(model.optimizer), activations, rows,
                    float(unit))


def _nbytes(v):
    import numpy as np
    return int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize


def _rows(x):
    from tfdist.runtime.lazy import tf
    first = tf.nest.flatten(x)[0]
    return int(first.shape[0])


def _slots(optimizer):
    """Slot variables a trainable weight gets from `optimizer` (a copy of it, built on one
    variable, counted)."""
    from tfdist.runtime.lazy import keras
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    probe = type(inner).from_config(inner.get_config())
    before = len(probe.variables)
    probe.build([keras.Variable([0.0], name="probe")])
    return max(0, len(probe.variables) - before)


def _step_peak(model, x, y, sw, n):
    """The allocator's peak (bytes above its level before) over one forward and backward pass of
    the first `n` rows; the model's non-trainable state put back after it."""
    from tfdist.runtime.lazy import tf
    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    cut = lambda t: None if t is None else tf.nest.map_structure(lambda a: a[:n], t)  # noqa: E731
    xs, ys, ws = cut(x), cut(y), cut(sw)
    saved = [(v, v.numpy()) for v in model.non_trainable_variables]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            pred = model(xs, training=True)
            loss = model.compute_loss(x=xs, y=ys, y_pred=pred, sample_weight=ws, training=True)
        return tape.gradient(loss, model.trainable_variables)
    step.get_concrete_function()  # (traced before the peak is reset)
    tf.config.experimental.reset_memory_stats(device)
    base = tf.config.experimental.get_memory_info(device)["current"]
    grads = step()
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    del grads
    for v, value in saved:
        v.assign(value)
    return float(peak - base)


def budget_bytes(memory_gb, processes_here):
    """A process's budget: `memory_gb` GiB, or this host's available memory shared by its
    processes."""
    from tfdist.runtime import host
    return memory_gb * 2 ** 30 if memory_gb else host.host_memory() / max(processes_here, 1)
