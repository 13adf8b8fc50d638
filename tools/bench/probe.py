"""Benchmark: the step probe of `tfdist train --probe` (tfdist/plan/probe.py) against the runs
it speaks for. For each config: the probe's float32 / XLA / bfloat16 step times (one process,
a few seconds each), then the same model trained by `tfdist train` in each of the three settings
for 45 steps (the median step of the last 40); the ratios to float32 compared.

    python tools/bench/probe.py                                 # gpt_demo and gpt_mini
    python tools/bench/probe.py --configs=gpt_demo --timed_steps=20   # quicker look

Prints a table and writes bench_results/probe.json. The probe is within its bound when each of
its ratios is within 15 % of the runs' (issue 63).
"""
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.bench.common import write_json  # noqa: E402
from tools.faults import harness  # noqa: E402

_CONFIGS = flags.DEFINE_list("configs", ["gpt_demo", "gpt_mini"], "configs/<name>.py to probe.")
_STEPS = flags.DEFINE_integer("timed_steps", 40, "Timed steps of each run (after 5 untimed).")
BOUND = 0.15


def run_steps(name, variant, overrides, workdir, data_dir):
    """Median step time of `tfdist train` of configs/<name>.py under `overrides`."""
    steps = 5 + _STEPS.value
    extra = [f"--config.{k}={str(v).lower()}" for k, v in overrides.items()]
    cmd = harness.tfdist_argv(
        "train", f"--config=configs/{name}.py", f"--workdir={workdir}", "--overwrite",
        f"--config.data.data_dir={data_dir}", f"--config.train.steps={steps}",
        f"--config.train.steps_per_epoch={steps}", "--config.train.warmup_steps=1",
        "--config.train.eval_steps=1", "--config.backup.enabled=false", *extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if p.returncode:
        sys.exit(f"bench_probe: {name} {variant} failed:\n{p.stderr[-2000:]}")
    rows = harness.metrics(workdir)["steps"]
    return statistics.median(r["step_time"] for r in rows[5:])


def main(argv):
    del argv
    from tfdist.plan import probe
    from tfdist.plan.report import load_config
    from tfdist.runtime import cpu as cpu_lib
    cases = []
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-probe-") as tmp:
        data_dir = os.path.join(tmp, "data")
        for name in _CONFIGS.value:
            c = load_config(os.path.join(ROOT, "configs", f"{name}.py"))
            probed = probe.measure_steps(c, cache=os.path.join(tmp, "cache"))["seconds"]
            variants = [v for v in probe.VARIANTS if probed.get(v)]
            runs = {v: run_steps(name, v, probe.VARIANTS[v], os.path.join(tmp, f"{name}-{v}"),
                                 data_dir) for v in variants}
            rows = []
            for v in variants:
                ratio_probe = probed["float32"] / probed[v]
                ratio_runs = runs["float32"] / runs[v]
                rows.append({"variant": v, "probe_step_s": probed[v], "run_step_s": runs[v],
                             "probe_speedup": ratio_probe, "run_speedup": ratio_runs,
                             "error": ratio_probe / ratio_runs - 1})
            cases.append({"config": name, "batch": c.train.batch_size, "rows": rows})
    print(f"| config | variant | probe step | run step (median of {_STEPS.value}) | "
          f"probe x fp32 | runs x fp32 | error |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        for r in case["rows"]:
            print(f"| {case['config']} | {r['variant']} | {r['probe_step_s']:.3f} s | "
                  f"{r['run_step_s']:.3f} s | {r['probe_speedup']:.2f} | {r['run_speedup']:.2f} "
                  f"| {r['error']:+.1%} |")
    worst = max(abs(r["error"]) for case in cases for r in case["rows"])
    print(f"worst error {worst:.1%} (bound {BOUND:.0%})")
    result = {"what": "the step probe (tfdist train --probe) against 3 runs of each config",
              "timed_steps": _STEPS.value, "bound": BOUND, "worst_error": worst,
              "bf16_blocked": cpu_lib.bf16_blocked(), "cases": cases}
    write_json(result, os.path.join(ROOT, "bench_results", "probe.json"))


if __name__ == "__main__":
    app.run(main)
