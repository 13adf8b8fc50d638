"""ZeRO-Offload beyond memory, and its overhead.

    python tools/bench/offload.py --what=xl        # make bench-offload-xl (root: a cgroup; ~30 min)
    python tools/bench/offload.py --what=overhead  # make bench-offload

--what=xl: GPT-2 XL (1.56 B parameters; float32, --seq tokens, 1 sequence per step) trains
--steps steps as one Horovod rank with ZeRO-3 and disk offload, inside a memory cgroup of
--cap_gib GiB (cgroup v1, no swap); then the same run without offload, which the cgroup kills for
memory. Reported: each run's outcome (trained, or killed with the cgroup's OOM kills), the peak
RSS (the run's VmHWM), the cgroup's peak, the median step time, the bytes read and written per
update (the store's counters), and the planner's prediction of each (`tfdist.plan`: memory by
part, `offload_io` at the disk's measured rates, bench_results/disk.json). Writes
bench_results/offload-xl.json.

--what=overhead: gpt_mini (ZeRO-3, one Horovod rank, 4 sequences of 256 tokens) resident, with
disk offload, and with disk offload and prefetch off, interleaved for --rounds rounds: the step
time's ratios to the resident run of the same round. Writes bench_results/offload.json.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_WHAT = flags.DEFINE_enum("what", "overhead", ["xl", "overhead", "plan"], "Which bench (plan: "
                          "the planner's figures of offload-xl.json again, from its runs).")
_CAP = flags.DEFINE_integer("cap_gib", 20, "--what=xl: the memory cgroup's limit, GiB.")
_STEPS = flags.DEFINE_integer("steps", 5, "Training steps per run.")
_SEQ = flags.DEFINE_integer("seq", 256, "--what=xl: tokens per sequence (model.block_size).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "--what=overhead: rounds of the three runs.")
_WORK = flags.DEFINE_string("workdir", "/tmp/tfdist-bench-offload", "Runs' workdirs and stores.")
CGROUP = "/sys/fs/cgroup/memory"
RESULTS = os.path.join(ROOT, "bench_results")


def command(workdir, config, flags_):
    return [os.path.join(ROOT, ".venv", "bin", "horovodrun"), "-np", "1", "-H", "localhost:1",
            sys.executable, "-m", "tfdist", "train", f"--config={config}",
            f"--workdir={workdir}", "--overwrite", "--config.strategy.name=horovod",
            "--config.backup.enabled=False", "--config.train.log_every_steps=1",
            *[f"--config.{k}={v}" for k, v in flags_.items()]]


def in_cgroup(argv, cap_bytes, name):
    """`argv` in a memory cgroup of its own (swap included where the kernel counts it)."""
    script = (f'd={CGROUP}/{name}-$$ && mkdir $d && echo {cap_bytes} > $d/memory.limit_in_bytes '
              f'&& (echo {cap_bytes} > $d/memory.memsw.limit_in_bytes 2>/dev/null; true) && '
              f'echo $$ > $d/cgroup.procs && exec "$@"')
    return ["sh", "-c", script, "sh", *argv]


def cgroup_figures(name):
    """(OOM kills, peak bytes) of the run's cgroup, which is then removed."""
    import glob
    kills, peak = 0, 0
    for d in glob.glob(f"{CGROUP}/{name}-*"):
        with open(os.path.join(d, "memory.oom_control")) as f:
            kills += int(dict(line.split() for line in f).get("oom_kill", 0))
        with open(os.path.join(d, "memory.max_usage_in_bytes")) as f:
            peak = max(peak, int(f.read()))
        for _ in range(50):  # (its tasks gone: removable)
            try:
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.2)
    return kills, peak


def run(workdir, config, flags_, cap_bytes=0, name="tfdist-offload", timeout=3600):
    argv = command(workdir, config, flags_)
    if cap_bytes:
        argv = in_cgroup(argv, cap_bytes, name)
    start = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    row = {"exit": p.returncode, "wall_s": round(time.monotonic() - start, 1)}
    if cap_bytes:
        row["oom_kills"], row["cgroup_peak_bytes"] = cgroup_figures(name)
    peak = re.search(r"peak RSS ([\d,]+) MiB", out)
    row["peak_rss_bytes"] = int(peak.group(1).replace(",", "")) * 2**20 if peak else None
    io = re.search(r"offload: per update \(median of \d+\), ([\d.,]+) GiB read and ([\d.,]+) GiB "
                   r"written .*?the CPU step ([\d.,]+) s", out)
    if io:
        row["read_bytes"], row["written_bytes"] = (float(io.group(i).replace(",", "")) * 2**30
                                                   for i in (1, 2))
        row["cpu_step_s"] = float(io.group(3).replace(",", ""))
    expected = re.search(r"memory expected per process \(before TensorFlow's own\): (.*)", out)
    row["expected_line"] = expected.group(1) if expected else None
    row["trained"] = p.returncode == 0
    metrics = os.path.join(workdir, "metrics.json")
    if row["trained"] and os.path.exists(metrics):
        with open(metrics) as f:
            steps = json.load(f)["steps"]
        row["step_times_s"] = [round(s["step_time"], 3) for s in steps]
        row["losses"] = [round(s["loss"], 5) for s in steps]
        row["step_s"] = statistics.median(s["step_time"] for s in steps[1:])
    else:
        row["tail"] = out[-1500:]
    return row


def xl_flags(offload):
    return {"train.precision": "float32", "model.block_size": _SEQ.value,
            "train.batch_size": 1, "train.steps": _STEPS.value,
            "train.steps_per_epoch": _STEPS.value, "train.eval_steps": 1,
            "train.warmup_steps": 1, "zero.stage": 3, "zero.offload": offload,
            "zero.offload_dir": os.path.join(_WORK.value, "store")}


def planned_xl():
    """The planner's figures for the run (`tfdist.plan`): memory by part, bytes per update, and
    the step's seconds (`step_time`): the passes' compute (the planner's CPU model: a core's
    fraction of peak fitted on gpt_mini, both cores of the one process, ZeRO-3 recomputing each
    unit's forward in its backward) plus the weights' reads (on a CPU the cores that compute do
    the reads' work too), plus the CPU step (its reads, update and writes overlapped)."""
    import dataclasses

    from tfdist.config import gpt2_config
    from tfdist.plan import machine
    from tfdist.plan import model as plan
    c = gpt2_config(n_layer=48, n_head=25, n_embd=1600)
    c.model.block_size = _SEQ.value
    c.model.vocab_size = 50257
    sizes = plan.model_from_config(c, "gpt2-xl")
    layout = dataclasses.replace(plan.planned(1, 1, microbatch=1, zero=3, recompute=True),
                                 offload="disk")
    rates = machine.offload_rates(RESULTS)
    host = machine.host(RESULTS, plan.model_from_config(
        __import__("configs.gpt_mini", fromlist=["x"]).get_config(), "gpt_mini"))
    opts = plan.Options(precision="float32", efficiency=host.unloaded,
                        core_share=host.dev.per_node / host.contention, **rates)
    parts = plan.memory(sizes, dataclasses.replace(layout, recompute=False), opts)
    io = plan.offload_io(sizes, layout, opts)
    compute = plan.step_time(sizes, plan.Cluster(host.dev, 1), layout, opts)["compute"]
    step = plan.step_time(sizes, plan.Cluster(host.dev, 1), layout, opts)["total"]
    # a process's peak: the passes (the device's parts and the gradients gathering in host
    # memory) or the CPU step (its own peak, buffers included), whichever holds more; one host
    resident = max(parts["total"] + parts["host_gradients"], parts["update_peak"])
    return {"params": sizes.params, "memory": {k: round(v) for k, v in parts.items()},
            "resident_bytes": resident, "read_bytes": io["read"],
            "written_bytes": io["written"], "compute_s": compute, "update_s": io["update_s"],
            "passes_read_s": io["passes_read_s"], "step_s": step, "rates": rates,
            "efficiency": host.unloaded, "core_share": opts.core_share}


def xl():
    cap = _CAP.value * 2**30
    work = _WORK.value
    rows = {}
    for offload in ("disk", "none"):
        print(f"GPT-2 XL, {offload} offload, in a {_CAP.value} GiB cgroup ...", flush=True)
        rows[offload] = run(os.path.join(work, f"xl-{offload}"), "configs/gpt2_xl.py",
                            xl_flags(offload), cap_bytes=cap, name=f"tfdist-xl-{offload}")
        print({k: v for k, v in rows[offload].items() if k != "tail"}, flush=True)
    plan = planned_xl()
    result = {"model": "gpt2_xl (configs/gpt2_xl.py), float32", "batch": 1, "seq": _SEQ.value,
              "steps": _STEPS.value, "cap_gib": _CAP.value, "runs": rows, "planned": plan}
    compare(result)
    print(json.dumps(result, indent=1))
    with open(os.path.join(RESULTS, "offload-xl.json"), "w") as f:
        json.dump(result, f, indent=1)


def overhead():
    variants = {"resident": {"zero.offload": "none"},
                "disk": {"zero.offload": "disk"},
                "disk, prefetch off": {"zero.offload": "disk", "zero.offload_prefetch": False}}
    common = {"zero.stage": 3, "train.batch_size": 4, "train.steps": _STEPS.value * 2,
              "train.warmup_steps": 1,
              "train.steps_per_epoch": _STEPS.value * 2, "train.eval_steps": 1,
              "zero.offload_dir": os.path.join(_WORK.value, "store")}
    times = {k: [] for k in variants}
    for r in range(_ROUNDS.value):
        for name, extra in variants.items():
            row = run(os.path.join(_WORK.value, "mini"), "configs/gpt_mini.py",
                      {**common, **extra})
            if not row["trained"]:
                raise SystemExit(f"{name} failed: {row.get('tail')}")
            times[name].append(row["step_s"])
            print(f"round {r + 1}: {name}: {row['step_s']:.3f} s per step", flush=True)
    ratios = {k: [t / base for t, base in zip(v, times["resident"])] for k, v in times.items()}
    result = {"model": "gpt_mini (configs/gpt_mini.py), ZeRO-3, 1 Horovod rank, 4 x 256 tokens",
              "step_s": times, "ratio_to_resident": ratios,
              "median_ratio": {k: statistics.median(v) for k, v in ratios.items()}}
    print("\n| gpt_mini, ZeRO-3 | step time | ÷ resident (same round) |\n|---|---|---|")
    for k in variants:
        print(f"| {k} | {statistics.median(times[k]):.3f} s | "
              f"{result['median_ratio'][k]:.2f}× |")
    with open(os.path.join(RESULTS, "offload.json"), "w") as f:
        json.dump(result, f, indent=1)


def compare(result):
    """The planner's figures over the measured ones of the disk run, into `result`."""
    d, plan = result["runs"]["disk"], result["planned"]
    if d.get("read_bytes"):
        result["planned_over_measured"] = {
            "read": plan["read_bytes"] / d["read_bytes"],
            "written": plan["written_bytes"] / d["written_bytes"],
            "step": plan["step_s"] / d["step_s"] if plan["step_s"] else None,
            "cpu_step": plan["update_s"] / d["cpu_step_s"] if plan["update_s"] else None,
            "peak_rss": plan["resident_bytes"] / d["peak_rss_bytes"]}
    return result


def replan():
    path = os.path.join(RESULTS, "offload-xl.json")
    with open(path) as f:
        result = json.load(f)
    result["planned"] = planned_xl()
    compare(result)
    print(json.dumps(result["planned_over_measured"], indent=1))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main(argv):
    del argv
    os.makedirs(_WORK.value, exist_ok=True)
    {"xl": xl, "overhead": overhead, "plan": replan}[_WHAT.value]()


if __name__ == "__main__":
    app.run(main)
