"""`--config.layout=auto`: tfdist plans the run's layout on the machine it finds, runs the fastest
that fits, and says why.

The inputs are what the run was given: the model (the config's GPT, `model_from_config`), its
replicas (the strategy's workers), the processes on this host and their share of its cores, the
memory a process may hold (`train.memory_gb`; 0: this host's RAM shared by its processes), and
this machine's measured rates (`Machine`): the matmul peak, the fraction of it the GPT's step
reaches, how much slower two cores compute side by side, the all-reduce between processes, the
disk and the CPU optimizer (ZeRO-Offload). They come from `bench_results/` when it was measured on
this CPU model with as many cores; otherwise the short benches of `tfdist.plan.probe` measure
the matmul peak, the step's fraction of it and two cores' contention here (about half a minute,
once: cached in ~/.cache/tfdist), and the rest (all-reduce; offload, not priced) is said to be
another machine's.

The candidates are every layout the strategy runs at this size (`tfdist.parallel.layout.Layout`'s
checks: the same judge as a named layout): ZeRO 0-3 where the strategy shards, ZeRO-Offload to
host memory or disk, and gradient accumulation in smaller batches (the same global batch per
update). Pipeline stages and tensor parallelism inside a CPU process are not candidates: its
logical devices share the cores the unsplit model already uses (bench_results/pipeline.json). The
planner prices each (`tfdist.plan.model.step_time`, the memory of `tfdist.parallel.memory` as
`tfdist train` states it) and the fastest that fits is chosen; the decision, the two runners-up
with why they lost, and every candidate go to the console and to `<workdir>/layout.json`.

A layout key the config sets away from its default (zero.stage, zero.offload,
train.grad_accum_steps) is pinned: auto chooses the rest. A run that resumes plans again for its
new size, keeping the accumulation it started with (its steps count batches of that size).

    >>> from tfdist import config
    >>> from tfdist.plan import auto
    >>> from tfdist.strategies import get_class
    >>> c = config.default_config()
    >>> c.model.update(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=256)
    >>> c.train.batch_size = 8
    >>> m = auto.Machine.assumed(cores=2, ram=2 ** 34)
    >>> d = auto.choose(c, get_class("horovod"), replicas=2, processes_here=2, machine=m)
    >>> str(d.chosen.layout)
    'dp=2 tp=1 pp=1 mb=4 zero=0'
"""
import dataclasses
import json
import math
import os

from tfdist.errors import UsageError
from tfdist.parallel import memory as memory_lib
from tfdist.plan import machine as machine_lib
from tfdist.plan import overheads
from tfdist.plan import probe as probe_lib
from tfdist.plan.model import (
    GB,
    Cluster,
    Device,
    Options,
    layouts,
    model_from_config,
    offloaded,
    step_time,
)
from tfdist.runtime import host as host_lib

#: The layout keys auto sets (Layout.config_overrides's), and the defaults it may change.
KEYS = {"zero.stage": 0, "zero.offload": "none", "train.grad_accum_steps": 1}
#: Config keys counted in batches: multiplied when auto accumulates k batches per update, so that
#: the run trains the same updates on the same tokens.
IN_BATCHES = ("train.steps", "train.steps_per_epoch", "train.warmup_steps", "train.eval_steps",
              "backup.every_steps")
#: Strategies whose layout is not tfdist's to choose, and why.
NOTHING_TO_CHOOSE = {"parameter_server": "its workers update asynchronously and hold no shards: "
                                         "no ZeRO, no offload, no pipeline",
                     "tpu": "XLA lays the TPU program out itself"}
BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench_results")
#: The fraction of one core's fp32 peak the GPT's step reaches, and two busy cores' slow-down,
#: where this CPU has not been benchmarked (this project's 2-core AMD EPYC: scaling.json and
#: tensor.json, 2026-11).
ASSUMED_EFFICIENCY, ASSUMED_CONTENTION = 0.88, 1.044
ASSUMED_ALLREDUCE = 0.3 * GB  # bytes/s between two processes of one host (allreduce.json: 0.3)


# ---------------------------------------------------------------------------------------------
# The machine's rates.


@dataclasses.dataclass(frozen=True)
class Machine:
    """This host's measured rates, and where each came from (`source`)."""
    cpu: str
    cores: int
    ram: float  # bytes a run may hold on this host
    peak: float  # fp32 FLOP/s of all cores (a 2048^3 matmul)
    efficiency: float  # of one core's peak, reached by the GPT's step on it
    contention: float  # how much slower a core computes beside another busy one
    allreduce: dict  # allreduce.json: 2 processes' all-reduce by size and implementation
    offload: dict  # Options' disk_read_bw, ... (empty: not measured; offload is not priced)
    bf16: float = 1.0  # bf16 matmul peak over fp32's
    source: str = ""
    overheads: dict = None  # the framework's own time (tfdist.plan.overheads), where fitted

    @classmethod
    def assumed(cls, cores, ram, peak=100e9):
        """A machine of `cores` cores and `ram` bytes with this project's measured fractions
        (docstring examples, tests)."""
        return cls("assumed", cores, ram, peak, ASSUMED_EFFICIENCY, ASSUMED_CONTENTION, {},
                   {}, source=f"assumed ({peak / 1e9:.0f} GFLOP/s)")

    def allreduce_seconds(self, implementation, nbytes):
        """Seconds of a 2-process all-reduce of `nbytes` on this host (allreduce.json), or at
        ASSUMED_ALLREDUCE where it was not measured."""
        t = machine_lib.allreduce_time(self.allreduce, implementation, nbytes)
        return t if t is not None else nbytes / ASSUMED_ALLREDUCE


def _same_type(bench_dir, cpu, cores):
    """Whether bench_dir's benches ran on this CPU model with as many cores (scaling.json's
    host)."""
    s = machine_lib.read_bench(bench_dir, "scaling.json") or {}
    host = s.get("host") or {}
    return host.get("cpu") == cpu and host.get("cores") == cores


def measure(bench_dir=BENCH_DIR, say=print, probe=None):
    """This machine's rates: bench_dir's where they were measured on this machine type, else the
    short benches' (`tfdist.plan.probe`: the matmul peak, the step's fraction of it, two cores'
    contention) of this CPU model, run here at first use and cached in ~/.cache/tfdist. `probe`
    (cpu, cores, say) -> Probe replaces `probe_lib.measure` (tests)."""
    cpu, cores = host_lib.this_cpu()
    ram = host_lib.host_memory()
    if _same_type(bench_dir, cpu, cores) and machine_lib.read_bench(bench_dir, "bench.json"):
        m = benched(bench_dir, ram)
        return dataclasses.replace(m, source=f"{os.path.relpath(bench_dir)} of this machine type "
                                             f"({cpu}, {cores} cores): {m.source}")
    rest = (f"the all-reduce's rate assumed from this project's 2-core AMD EPYC "
            f"({os.path.relpath(bench_dir)} is another machine type's); offload not priced "
            f"(make bench-allreduce and make bench-disk measure them here)")
    p = probe_lib.cached(cpu, cores)
    if p is None:
        try:
            p = (probe or probe_lib.measure)(cpu, cores, say)
        except RuntimeError as e:
            say(f"tfdist: layout=auto: the short benches failed here ({e}); planning with this "
                f"project's machine's figures", flush=True)
            m = Machine.assumed(cores, ram)
            return dataclasses.replace(m, cpu=cpu, source=f"{m.source}: not measured here; {rest}")
    return Machine(cpu, cores, ram, p.peak, p.efficiency, p.contention, {}, {},
                   source=f"{p.describe()} ({probe_lib.cache_path(cpu, cores)}); {rest}")


def benched(bench_dir, ram=None):
    """The Machine bench_dir's benches measured (its host's CPU, `ram` bytes: default this
    host's available memory), the framework's own time fitted on its auto.json."""
    host = (machine_lib.read_bench(bench_dir, "scaling.json") or {}).get("host") or {}
    from tfdist.plan.model import model_from_config as of_config
    from tfdist.plan.report import load_config
    mini = of_config(load_config(os.path.join(os.path.dirname(os.path.abspath(bench_dir)),
                                              "configs", "gpt_mini.py")), "gpt_mini")
    h = machine_lib.host(bench_dir, mini)
    ar = machine_lib.read_bench(bench_dir, "allreduce.json") or {"rows": []}
    rates = machine_lib.offload_rates(bench_dir)
    bf16 = machine_lib.bf16_over_fp32(bench_dir) or 1.0
    cores = h.dev.per_node
    ram = host_lib.host_memory() if ram is None else ram
    m = Machine(host.get("cpu", "unknown CPU"), cores, ram, h.dev.fp32_flops * cores, h.unloaded,
                h.contention, ar, rates, bf16)
    fitted = fit_overheads(bench_dir, m)
    return dataclasses.replace(
        m, overheads=fitted,
        source="scaling.json, tensor.json, allreduce.json" + (", disk.json" if rates else "")
               + (", auto.json (the framework's own time)" if fitted else ""))


def fit_overheads(bench_dir, machine):
    """{kind: (a, b)} from bench_dir/auto.json's rows of FIT_MODELS (empty without it), priced on
    `machine` (a tfdist.plan.auto.Machine, its overheads left out)."""
    bench = machine_lib.read_bench(bench_dir, "auto.json") or {}
    bare = dataclasses.replace(machine, overheads={})
    residuals = {k: [] for k in overheads.KINDS}
    predicted = {}
    for case in bench.get("cases", []):
        if case["model"] not in overheads.FIT_MODELS or "config" not in case:
            continue
        for cand, row in bench_candidates(case, bare, os.path.dirname(os.path.abspath(bench_dir))):
            predicted[(case["model"], case["workers"], row["layout"])] = (cand, row)
    for cand, row in predicted.values():  # passes first: plain rows
        if overheads.kind_of(cand.layout) is None:
            per = cand.layout.passes
            residuals["pass"].append((overheads.seconds({"pass": (0.0, 1.0)}, "pass", cand.model),
                                      (row["seconds_per_update"] - cand.seconds) / per,
                                      (per / row["seconds_per_update"]) ** 2))
    out = {"pass": overheads.line(residuals["pass"])}
    for cand, row in predicted.values():
        kind = overheads.kind_of(cand.layout)
        if kind is None:
            continue
        passes = cand.layout.passes * overheads.seconds(out, "pass", cand.model)
        per = cand.layout.passes if kind == "zero3" else 1
        residuals[kind].append((overheads.seconds({kind: (0.0, 1.0)}, kind, cand.model),
                                (row["seconds_per_update"] - cand.seconds - passes) / per,
                                (per / row["seconds_per_update"]) ** 2))
    out.update({k: overheads.line(v) for k, v in residuals.items() if k != "pass" and v})
    return out


def bench_config(path, seq, batch, updates=1, memory_gb=0.0):
    """The config of a bench's run of the config file at `path` (as `tools/bench/auto.py` runs
    it: float32, `updates` updates of `batch` sequences of `seq` tokens, no backups)."""
    from tfdist import config as config_lib
    from tfdist.plan.report import load_config
    c = load_config(path)
    c.model.block_size = seq
    c.train.update(batch_size=batch, grad_accum_steps=1, steps=max(updates, 2),
                   steps_per_epoch=max(updates, 2), warmup_steps=1, precision="float32",
                   memory_gb=memory_gb)
    c.backup.enabled = False
    return config_lib.validate(c)


def bench_candidates(case, machine, root):
    """(Candidate, bench row) of each measured row of an auto.json case, priced now."""
    from tfdist.strategies import get_class
    c = bench_config(os.path.join(root, case["config"]), case["seq"], case["batch"],
                     case["updates"])
    w = case["workers"]
    by_layout = {x.name: x for x in candidates(c, get_class("horovod"), w, w, machine)}
    for row in case["rows"]:
        if "seconds_per_update" in row and row["layout"] in by_layout:
            yield by_layout[row["layout"]], row


# ---------------------------------------------------------------------------------------------
# The candidates, priced.


@dataclasses.dataclass
class Candidate:
    layout: object  # tfdist.parallel.layout.Layout
    seconds: float = 0.0  # per update
    parts: dict = dataclasses.field(default_factory=dict)  # step_time's
    bytes: float = 0.0  # a process's, on this host
    memory: dict = dataclasses.field(default_factory=dict)
    fits: bool = True
    refusal: str = None  # why tfdist does not run it (None: it does)
    tokens_per_sec: float = 0.0
    model: object = None  # the planner's Model of the run's GPT
    subgroup: int = 0  # an offload's parameters per sub-group of the CPU step (0: the config's)

    @property
    def name(self):
        """The layout's one-line name (with a sub-group size other than the config's)."""
        return str(self.layout) + (f" subgroup=2^{self.subgroup.bit_length() - 1}"
                                   if self.subgroup else "")

    def overrides(self):
        """The config keys of this candidate (`Layout.config_overrides`, and the sub-group)."""
        out = self.layout.config_overrides()
        if self.subgroup:
            out["zero.offload_subgroup"] = self.subgroup
        return out

    def describe(self):
        return self.layout.describe() + (f" (sub-groups of 2^{self.subgroup.bit_length() - 1})"
                                          if self.subgroup else "")

    def row(self):
        return {"layout": self.name, "describe": self.describe(),
                "seconds_per_update": self.seconds, "tokens_per_sec": self.tokens_per_sec,
                "gib_per_process": self.bytes / 2 ** 30, "fits": self.fits,
                "refused": self.refusal, "parts_s": self.parts}


def process_bytes(c, model, layout, subgroup=0):
    """(bytes a process holds on this host, by part) under `layout`: Keras's float32 weights,
    gradients and Adam moments at either precision, activations at the run's (as `tfdist train`
    states them: `tfdist.train.expected_memory`); offloaded to disk, what the CPU step holds at
    once; to host memory, the store too (a CPU's device memory is the host's)."""
    states = memory_lib.memory(model, layout, memory_lib.Defaults(
        precision="float32", offload_subgroup=subgroup or c.zero.offload_subgroup))
    if c.train.precision != "float32":
        states["activations"] = memory_lib.memory(model, layout)["activations"]
    parts = {k: states[k] for k in ("weights", "gathered", "gradients", "optimizer",
                                    "activations") if k in states}
    whole = memory_lib.memory(model, dataclasses.replace(layout, zero=0, offload="none"),
                              memory_lib.Defaults(precision="float32"))["gradients"]
    if layout.zero in (1, 2):
        # tfdist's ZeRO-1/2 reduce-scatter the step's whole gradients from one flat buffer of
        # them, laid out in padded pieces (tfdist.parallel.zero.optimizer): three copies at once
        # (stage 2 shards only what outlives a step). With one, GPT-2 XL's ZeRO-1 on disk in
        # batches of 1 was priced at 18.9 GiB and ran out of memory in that concat; with none,
        # in batches of 2 at 19 GiB, and was killed at 24.2 GiB (bench_results/auto.json).
        parts["gradients"] = whole
        parts["flat buffer"] = 2 * whole
    held = sum(parts.values())
    if layout.offload != "none":
        held = max(held + states["host_gradients"], states["update_peak"]) + (
            states["offloaded"] if layout.offload == "host" else 0.0)
        parts["off the device"] = states["offloaded"]
    # Each process builds the whole GPT before it shards or offloads it: its weights and their
    # initial values at once. GPT-2 XL under ZeRO-3 on disk over 2 processes was priced at 6.9
    # GiB a process and was killed at 12.3 GiB (2 x its 6.2 GB of weights).
    if 2 * whole > held:
        parts["the build"] = held = 2 * whole
    return held, parts


def _options(c, m, cores_each, processes_here, plugin, grads):
    """The planner's Options for a process of this host: a core's fraction of peak, the cores'
    share, the all-reduce's rate (its copies are the cores' work: comm_cpu_bw), the offload's."""
    busy = processes_here * cores_each
    implementation = machine_lib.COLLECTIVE.get(plugin.name, machine_lib.RING)
    seconds = m.allreduce_seconds(implementation, grads)
    mixed = c.train.precision != "float32"
    return Options(precision="mixed" if mixed else "float32", efficiency=m.efficiency,
                   core_share=(1 / m.contention) if busy > 1 else 1.0,
                   comm_cpu_bw=grads / seconds, overlap=plugin.name in machine_lib.COLLECTIVE,
                   usable_memory=1.0, overheads=m.overheads or None, **m.offload), grads / seconds


def candidates(c, plugin, replicas, processes_here, m):
    """Every layout of the run's `replicas` replicas (one per process, or the strategy's), the
    same global batch per update, priced on machine `m`: [Candidate], fastest first among those
    that fit and run."""
    model, cluster, opts = setting(c, plugin, replicas, processes_here, m)
    batch = c.train.batch_size * c.train.grad_accum_steps  # sequences per update
    fixed = {"tp": 1, "pp": 1, "dp": replicas}
    lays = [*layouts(model, cluster, batch, fixed), *offloaded(model, cluster, batch)]
    out = []
    for lay in lays:
        if lay.recompute or lay.dp != replicas:
            continue  # (recomputation needs a split model)
        lay = dataclasses.replace(lay, seq=model.seq_len)
        for subgroup in _subgroups(c, lay):
            cand = price(c, model, cluster, opts, lay, subgroup)
            cand.refusal = cand.refusal or _refusal(c, plugin, cand.layout)
            out.append(cand)
    return sorted(out, key=_rank)


def _subgroups(c, lay):
    """The CPU step's sub-group sizes an offloaded layout is offered with: the config's, and where
    that is tfdist's default, 2^23 and 2^21 too (3 sub-groups in flight hold 144 bytes a
    parameter of one: 4.5 GiB at 2^25, for GPT-2 XL's 1.5 B; smaller ones fit more; their
    Python work per sub-group is not priced, so the largest that fits is taken)."""
    if lay.offload == "none" or c.zero.offload_subgroup != 1 << 25:
        return (0,)
    return (0, 1 << 23, 1 << 21)


def setting(c, plugin, replicas, processes_here, m):
    """(the planner's Model of config `c`'s GPT, the Cluster of its replicas, Options) on machine
    `m`: each process a device of its share of the cores."""
    model = model_from_config(c, "the config's GPT")
    cores_each = max(1, m.cores // max(processes_here, 1))
    per_core = m.peak / m.cores
    opts, bw = _options(c, m, cores_each, processes_here, plugin, model.params * 4)
    device = Device("cpu process", per_core * cores_each * m.bf16, m.ram / max(processes_here, 1),
                    None, bw, bw, processes_here, m.source, fp32_flops=per_core * cores_each)
    return model, Cluster(device, replicas), opts


def price(c, model, cluster, opts, lay, subgroup=0):
    """A Candidate of layout `lay` (an offload's sub-groups of `subgroup` parameters; 0: the
    config's): its step's seconds by part, tokens/s, a process's bytes."""
    cand = Candidate(lay, model=model, subgroup=subgroup)
    try:
        cand.parts = step_time(model, cluster, lay, opts)
    except ValueError:  # an offload without measured rates: not priced
        cand.refusal = "offload not priced (make bench-disk)"
        cand.parts = {"total": float("inf")}
    cand.seconds = cand.parts["total"]
    cand.tokens_per_sec = lay.batch * lay.accumulate * model.seq_len / cand.seconds
    cand.bytes, cand.memory = process_bytes(c, model, lay, subgroup)
    return cand


def _rank(cand):
    """Runnable and fitting first; then faster (to 3 figures: equal compute is equal); then
    fewer batches per update, less sharding, no offload."""
    lay = cand.layout
    return (cand.refusal is not None, not cand.fits, -float(f"{cand.tokens_per_sec:.3g}"),
            lay.accumulate, lay.zero, lay.offload != "none", -(cand.subgroup or math.inf))


def _refusal(c, plugin, layout):
    why = layout.refusal(c, plugin)
    return None if why is None else why.split(";")[0]


# ---------------------------------------------------------------------------------------------
# The decision.


@dataclasses.dataclass
class Decision:
    chosen: Candidate
    runners_up: list
    considered: list
    machine: Machine
    budget: float  # bytes per process
    replicas: int
    processes_here: int
    pinned: dict

    def why_not(self, cand):
        """A runner-up's loss against the chosen, in a few words."""
        a, b = self.chosen, cand
        if not b.fits:
            return f"needs {_gib(b.bytes)} a process > {_gib(self.budget)}"
        slower = b.seconds / a.seconds - 1
        parts = {k: b.parts.get(k, 0.0) - a.parts.get(k, 0.0)
                 for k in ("compute", "memory", "network", "bubble", "framework")}
        part = max(parts, key=parts.get)
        if abs(slower) < 5e-3:
            return "the same predicted speed; chosen holds " + (
                "fewer batches per update" if b.layout.accumulate > a.layout.accumulate
                else "less sharding" if (b.layout.zero, b.layout.offload) != (
                    a.layout.zero, a.layout.offload) else "larger sub-groups")
        return f"{slower:+.0%} time a step ({part} {parts[part]:+.3f} s)"

    def lines(self):
        c = self.chosen
        out = [f"layout=auto: {self.replicas} replica(s), {self.processes_here} process(es) on "
               f"this host of {self.machine.cores} cores, {_gib(self.budget)} a "
               f"process; rates: {self.machine.source}",
               f"layout=auto: chose {c.describe()} ({c.name}): predicted "
               f"{c.seconds:.3f} s an update, {c.tokens_per_sec:,.0f} tokens/s, "
               f"{_gib(c.bytes)} a process"]
        for i, r in enumerate(self.runners_up, 2):
            out.append(f"layout=auto: #{i} {r.describe()}: {r.seconds:.3f} s, "
                       f"{_gib(r.bytes)}: {self.why_not(r)}")
        if self.pinned:
            out.append("layout=auto: pinned by the config: "
                       + ", ".join(f"{k}={v}" for k, v in self.pinned.items()))
        return out

    def to_json(self):
        return {"chosen": self.chosen.row(), "runners_up": [r.row() for r in self.runners_up],
                "considered": [r.row() for r in self.considered],
                "overrides": self.chosen.overrides(),
                "machine": dataclasses.asdict(self.machine), "budget_bytes": self.budget,
                "replicas": self.replicas, "processes_here": self.processes_here,
                "pinned": self.pinned, "lines": self.lines()}


def pinned_keys(c):
    """The layout keys the config sets away from their defaults: auto keeps them."""
    return {k: c[k.split(".")[0]][k.split(".")[1]] for k, default in KEYS.items()
            if c[k.split(".")[0]][k.split(".")[1]] != default}


def choose(c, plugin, replicas, processes_here=1, machine=None, pinned=None):
    """The Decision for config `c` under strategy plugin class `plugin` with `replicas` replicas,
    `processes_here` of them on this host. UsageError (one line) when the strategy has nothing to
    choose, or nothing fits (saying what would)."""
    check(plugin)
    m = machine or measure()
    budget = c.train.memory_gb * 2 ** 30 if c.train.memory_gb else m.ram / max(processes_here, 1)
    pinned = pinned_keys(c) if pinned is None else pinned
    m = dataclasses.replace(m, ram=budget * max(processes_here, 1))
    every = candidates(c, plugin, replicas, processes_here, m)
    for cand in every:
        cand.fits = cand.bytes <= budget
    every.sort(key=_rank)
    runnable = [x for x in every if x.refusal is None]
    if len(runnable) <= 1 and not pinned:
        only = runnable[0].describe() if runnable else "none"
        raise UsageError(f"config.layout=auto under strategy {plugin.name} with {replicas} "
                         f"replica(s) and train.batch_size={c.train.batch_size} has nothing to "
                         f"choose (it runs one layout: {only}); drop config.layout=auto, or use "
                         f"horovod or multi_worker_mirrored (ZeRO, offload)")
    allowed = [x for x in runnable if all(_holds(x.layout, k, v) for k, v in pinned.items())]
    fitting = [x for x in allowed if x.fits]
    if not fitting:
        raise UsageError(_nothing_fits(c, budget, allowed, [x for x in runnable if x.fits],
                                       pinned))
    chosen = fitting[0]
    rest = [x for x in allowed if x is not chosen]
    return Decision(chosen, rest[:2], every, m, budget, replicas, processes_here, pinned)


def _gib(nbytes):
    return f"{nbytes / 2 ** 30:.3g} GiB"


def check(plugin):
    """UsageError (one line) when strategy plugin class `plugin` leaves auto nothing to choose
    (checked before the strategy is built)."""
    if plugin.name in NOTHING_TO_CHOOSE:
        raise UsageError(f"config.layout=auto under strategy {plugin.name}: it has nothing to "
                         f"choose ({NOTHING_TO_CHOOSE[plugin.name]}); name the layout, or use "
                         f"horovod or multi_worker_mirrored")


def _holds(layout, key, value):
    overrides = layout.config_overrides()
    return overrides.get(key, KEYS[key]) == value


def _nothing_fits(c, budget, allowed, fitting_unpinned, pinned):
    least = min(allowed, key=lambda x: x.bytes) if allowed else None
    if least:
        part, size = max(((k, v) for k, v in least.memory.items() if k != "off the device"),
                         key=lambda kv: kv[1])
        why = (" (each process builds the whole model first: its weights twice)"
               if part == "the build" else "")
        need = (f" (the least, {least.describe()}, needs {_gib(least.bytes)}; the most of it "
                f"{part}, {_gib(size)}{why})")
    else:
        need = ""
    if pinned and fitting_unpinned:
        other = fitting_unpinned[0]
        keys = " ".join(f"{k}={v}" for k, v in pinned.items())
        return (f"config.layout=auto with {keys} fixed: no layout fits in {_gib(budget)} a "
                f"process{need}; {other.describe()} would ({_gib(other.bytes)}): unset "
                f"{', '.join(pinned)}")
    return (f"config.layout=auto: no layout fits in {_gib(budget)} a process{need}; raise "
            f"train.memory_gb, lower train.batch_size, or run more workers")


def apply(c, decision):
    """Sets the chosen layout's keys in `c`, and multiplies the keys counted in batches by its
    batches per update (against the config's own: the same updates on the same tokens)."""
    lay = decision.chosen.layout
    before = c.train.grad_accum_steps
    for key, value in {**KEYS, **decision.chosen.overrides()}.items():
        section, name = key.split(".")
        c[section][name] = value
    k = lay.accumulate
    if k != before:
        for key in IN_BATCHES:
            section, name = key.split(".")
            c[section][name] = c[section][name] * k // before
    return c


def write(decision, workdir):
    from tfdist.data import store
    store.write_atomic(os.path.join(workdir, "layout.json"),
                       json.dumps(decision.to_json(), indent=1, default=str))


def earlier(workdir):
    """The decision an earlier start of this run wrote, or None."""
    try:
        with open(os.path.join(workdir, "layout.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

