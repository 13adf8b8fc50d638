"""This machine: the CPU as `make bench*` measured it (bench_results/*.json, committed), the
all-reduces and links they measured, and the host's model, from which tfdist.plan.benchmarks
predicts every committed benchmark's figures from its own inputs (`tfdist plan --measured`).

A CPU host's processes compute on the cores they share (docs/planner.md, "Against this machine"):
each run's own one-process step is its day's compute reference, and tells how much other work
held the cores (`Host.load`); two processes computing at once each run `Host.contention` slower
(fitted on tensor.json); a collective's copies and reductions take what allreduce*.json measured
for that implementation and link, on the same cores (no overlap hides them), and a shaped link's
wire time adds on top.
"""
import dataclasses
import json
import math
import os

from tfdist.errors import UsageError
from tfdist.plan.model import GB, Cluster, Device, Options, planned, step_time
from tfdist.plan.published import CPU, fit_efficiency

BENCH_HINT = {"bench.json": "make bench", "scaling.json": "make bench-scaling",
              "scaling-horovod.json": "make bench-scaling-horovod",
              "allreduce.json": "make bench-allreduce",
              "pipeline.json": "make bench-pipeline", "scaling-ps.json": "make bench-scaling-ps",
              "tensor.json": "make bench-model-parallel", "zero.json": "make bench-zero",
              "peer.json": "make bench-peer", "disk.json": "make bench-disk",
              "auto.json": "make bench-auto"}
FP32 = Options(precision="float32")
# Two one-process runs of the same day differ by up to this much (scaling.json's rounds, the
# references of one bench's runs): a reference that much slower is noise, not another thread.
# (On 2 cores, one thread more is what a slower reference implies at the least: the fit would
# jump from no load to 2 processes at 2/3 of a core for a run 1 % slower.)
NOISE = 0.05
RING = "tf ring (MWMS)"  # TF's collectives and its parameter server both move tensors over gRPC
# The allreduce*.json column that measured a bench's collective, by the bench's `strategy` label
# ("multi_worker_mirrored", "horovod", "horovod, compression fp16").
COLLECTIVE = {"multi_worker_mirrored": RING, "horovod": "horovod/gloo"}


def collective(label):
    kind, _, compression = label.partition(", compression ")
    return COLLECTIVE[kind] + (f" {compression}" if compression not in ("", "none") else "")


def read_bench(bench_dir, name):
    """A bench result, or None when it has not been run here (a target not run yet)."""
    path = os.path.join(bench_dir, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path} ({e}); "
                         f"re-run `{BENCH_HINT.get(name, 'the bench')}`") from None


def offload_rates(bench_dir):
    """The Options fields that price ZeRO-Offload here (`make bench-disk`: the disk's read and
    write bandwidth through the offload store, and the CPU AdamW's parameters per second with
    its state in memory and on the disk), or {} when it has not been run."""
    d = read_bench(bench_dir, "disk.json")
    if not d:
        return {}
    return {"disk_read_bw": d["read_GBps"] * GB, "disk_write_bw": d["write_GBps"] * GB,
            "cpu_adam_rate": d["adam_Mparams_per_s"] * 1e6,
            "cpu_adam_disk_rate": d.get("adam_disk_Mparams_per_s", 0.0) * 1e6}


def allreduce_bandwidth(bench_dir, implementation=RING):
    """Bus bandwidth (bytes/s) at the largest buffer `make bench-allreduce` measured, or None."""
    ar = read_bench(bench_dir, "allreduce.json")
    last = ((ar or {}).get("rows") or [{}])[-1]
    return last[implementation]["busbw_GBps"] * GB if implementation in last else None


def allreduce_time(ar, implementation, nbytes):
    """Seconds of a 2-process all-reduce of `nbytes` by `implementation` in an allreduce*.json:
    linear in the size between the two measured sizes around it (a collective takes a latency
    plus its bytes over a bandwidth), at the nearest measured bandwidth outside them; None if
    that implementation was not measured."""
    points = sorted((r["size_mb"] * 2 ** 20,
                     r["size_mb"] * 2 ** 20 / (r[implementation]["busbw_GBps"] * GB))
                    for r in (ar or {}).get("rows", []) if implementation in r)
    if not points:
        return None
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s0 <= nbytes <= s1:
            return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)
    size, t = points[0] if nbytes < points[0][0] else points[-1]
    return nbytes * t / size


def link_rate(link):
    """Bytes/s one way of a link as tools/cluster/netcluster.py names them (100mbit, 1gbit,
    10gbit)."""
    for unit, bits in (("gbit", 1e9), ("mbit", 1e6)):
        if link.endswith(unit):
            return float(link[:-len(unit)]) * bits / 8
    raise UsageError(f"unknown link rate {link!r} in bench_results")


def cpu_device(bench_dir, peak=None):
    """One core of this machine: its share of the matmul peak that `make bench` measured (or
    `peak`, FLOP/s on every core, measured another day), its share of the RAM, and the
    all-reduce bandwidth `make bench-allreduce` measured between two processes (over loopback,
    so 'inside a node')."""
    bench = read_bench(bench_dir, "bench.json")
    if not bench:
        raise UsageError(f"this CPU has not been measured: no "
                         f"{os.path.join(bench_dir, 'bench.json')}; "
                         f"run `make bench` first (or pick another --device)")
    cores = bench.get("cores") or os.cpu_count()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bw = allreduce_bandwidth(bench_dir) or 0.3 * GB  # 0.29-0.35 GB/s measured on this machine
    fp32 = (peak or bench["matmul_peak_flops"]) / cores
    bf16 = bf16_over_fp32(bench_dir)  # the bf16 peak, where `make bench-peer` measured it
    return Device(CPU, fp32 * (bf16 or 1.0), ram / cores, None, bw, bw, cores,
                  f"{bench_dir}/{'scaling' if peak else 'bench'}.json (fp32 2048^3 matmul peak / "
                  f"{cores} cores)"
                  + (f", peer.json (bf16 peak {bf16:.2f}x fp32's)" if bf16 else "")
                  + " and allreduce.json", fp32_flops=fp32)


def _peer_cells(bench_dir, config="gpt_mini.py"):
    peer = read_bench(bench_dir, "peer.json") or {}
    return {c["precision"]: c for c in peer.get("cells", []) if c["config"] == config}


def bf16_over_fp32(bench_dir):
    """TF's bf16 matmul peak over its fp32 one, measured in one run by `make bench-peer`; None
    when it has not run."""
    cells = _peer_cells(bench_dir)
    if "bfloat16" not in cells:
        return None
    peaks = cells["bfloat16"]["peaks"]
    return peaks["tfdist_bfloat16"] / peaks["tfdist_float32"]


def precision_efficiency(bench_dir, precision, fp32_efficiency):
    """The fraction of its precision's peak the step reaches: fp32's as fitted; bf16's in the
    same proportion to it as `make bench-peer` measured for tfdist's gpt_mini step (each against
    its own precision's peak, in one run). Without peer.json, fp32's."""
    cells = _peer_cells(bench_dir)
    if precision == "float32" or not {"float32", "bfloat16"} <= set(cells):
        return fp32_efficiency
    mfu = {p: c["rows"]["tfdist"]["mfu"] for p, c in cells.items()}
    return fp32_efficiency * mfu["bfloat16"] / mfu["float32"]


def fit_to_one_process(dev, model, bench):
    """The fraction of peak that reproduces a scaling bench's 1-process step time (fp32)."""
    per = bench["batch_per_worker"]
    return one_core(dev, model, per, per * model.seq_len / bench["tokens_per_sec_1"])


def one_core(dev, model, batch, seconds):
    """The fraction of peak at which one core takes `seconds` for a step of `batch` sequences."""
    return fit_efficiency(model, Cluster(dev, 1), planned(batch, 1, microbatch=batch), seconds,
                          FP32)


# ---------------------------------------------------------------------------------------------
# The host: what holds for every bench on this machine.


@dataclasses.dataclass
class Host:
    """This machine's cores (`dev`: one of them); an unloaded core's fraction of peak on gpt_mini
    (scaling.json's one-process step: the loopback day, whose load was the bench's own), its lowest
    round against the median (`spread`); how much slower a core computes beside another
    (`contention`)."""
    dev: Device
    unloaded: float
    spread: float
    contention: float

    def load(self, fraction):
        """Other runnable threads implied by a one-process reference at `fraction` of peak: none
        while it is within the unloaded reference's spread, or within NOISE of it; else L, from
        cores / (1 + L) of a core."""
        r = fraction / self.unloaded
        return 0.0 if r >= min(self.spread, 1 - NOISE) else self.dev.per_node / r - 1

    def share(self, processes, load):
        """A core's share for each of `processes` busy threads beside `load` others, shared
        fairly."""
        return min(1.0, self.dev.per_node / (processes + load))


def host(bench_dir, model):
    """The Host of the benches. `contention` is fitted on tensor.json (1 without it): its t = 2
    step is the unsplit model's work on two threads of one process, with no network and partial
    sums at 0.09 % of its op time: what it loses against half the one-thread step is two cores
    computing."""
    s = read_bench(bench_dir, "scaling.json")
    # The peak of the reference's own day where it was measured with it: the same machine type
    # has run at half and at twice bench.json's peak on other days (a fit at more than the peak
    # is capped, and every prediction would start from a step this CPU cannot take).
    dev = cpu_device(bench_dir, (s or {}).get("matmul_peak_flops"))
    unloaded = fit_to_one_process(dev, model, s) if s else 1.0
    rounds = [r["tokens_per_sec_1"] for r in (s or {}).get("rounds", [])]
    spread = min(rounds) / s["tokens_per_sec_1"] if rounds else 1.0
    t = read_bench(bench_dir, "tensor.json")
    if not t:
        return Host(dev, unloaded, spread, 1.0)
    batch, med = t["batch"], t["median_step_s"]
    f1 = one_core(dev, model, batch, med["unsplit (1 thread)"])
    inproc = Cluster(dev, 2, intra_bw=math.inf, inter_bw=math.inf)
    ideal = step_time(model, inproc, planned(batch, 1, tp=2, microbatch=batch),
                      dataclasses.replace(FP32, efficiency=f1))["total"]
    return Host(dev, unloaded, spread, med["t=2"] / ideal)
