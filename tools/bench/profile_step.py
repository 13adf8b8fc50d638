"""Where a training step's time goes: one `tfdist train` run profiles a step
(`train.profile_step`), and tfdist's XSpace reader sums its ops by phase (forward, backward,
update) and by op type.

    python tools/bench/profile_step.py --config=configs/gpt_mini.py
    python tools/bench/profile_step.py --config=configs/gpt_demo.py -- \\
        --config.train.precision=mixed_bfloat16

Flags after `--` go to `tfdist train`. It prints a table and writes JSON (--out, default
bench_results/profile-<config>[-<precision>].json).
"""
import os
import subprocess
import sys
import tempfile

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import cli, config_filename, write_json  # noqa: E402
from tools.faults import harness  # noqa: E402

_AT = flags.DEFINE_integer("at_step", 8, "The step profiled (after tracing and warm-up).")


def main(argv):
    from tfdist.runtime import profiling
    extra = argv[1:]
    with tempfile.TemporaryDirectory(prefix="tfdist-profile-") as workdir:
        cmd = harness.tfdist_argv(
            "train", f"--config={config_filename()}", f"--workdir={workdir}", "--overwrite",
            f"--config.train.steps={_AT.value + 1}",
            f"--config.train.steps_per_epoch={_AT.value + 1}",
            f"--config.train.profile_step={_AT.value}", "--config.train.warmup_steps=1",
            "--config.train.eval_steps=1", "--config.backup.enabled=false", *extra)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode:
            sys.exit(f"profile_step: tfdist train failed (exit {p.returncode}):\n"
                     f"{p.stderr[-3000:]}")
        events = profiling.read(os.path.join(workdir, "profile", "worker-0"))
        step_time = harness.metrics(workdir)["steps"][_AT.value - 1]["step_time"]
    r = profiling.where_time_goes(events, top=25)
    r.update(config=os.path.basename(config_filename()), flags=extra, step_time_s=step_time)
    print(f"{r['config']} {' '.join(extra)}: step {step_time * 1e3:.1f} ms (profiled), ops span "
          f"{r['span_us'] / 1e3:.1f} ms, ops sum {r['op_us'] / 1e3:.1f} ms")
    for name, p in sorted(r["phases"].items()):
        print(f"  {name:9s} {p['ops']:6d} ops  sum {p['op_us'] / 1e3:8.1f} ms  span "
              f"{p['span_us'] / 1e3:8.1f} ms")
    print(f"  {'op type':32s} {'ops':>5s} {'sum ms':>9s} {'share':>6s}")
    for t in r["types"]:
        print(f"  {t['type']:32s} {t['ops']:5d} {t['op_us'] / 1e3:9.1f} {100 * t['share']:5.1f}%")
    precision = next((f.split("=")[1] for f in extra if "precision=" in f), "")
    write_json(r, os.path.join("bench_results", f"profile-{r['config'].removesuffix('.py')}"
                               + (f"-{precision}" if precision else "") + ".json"))


if __name__ == "__main__":
    cli.run(main, sys.argv)
