"""Does `--config.layout=auto` pick well on this machine? For each model and worker count: the
layouts the planner calls runnable and fitting (tfdist.plan.auto's candidates, one per ZeRO stage
and offload, at the largest batch per step that fits), each run for a few steps, and the run with
`--config.layout=auto`; auto's tokens/s against the best measured layout's, and each layout's
predicted step time against its measured one.

    python tools/bench/auto.py                       # gpt_nano, gpt_mini, gpt2 (124M), 1 and 2
    python tools/bench/auto.py --models=gpt2_xl      # GPT-2 XL under 20 GiB (the host's cap)

Every run is `tfdist launch --strategy=horovod --workers=W` (one rank per process, Gloo on
127.0.0.1; W = 1 too, so that ZeRO and offload are candidates), float32, the same global batch per
update, the config's learning-rate schedule. A run's speed is its tokens over its step times after
the first 2 updates (tracing, the offload's first reads). The memory cap is a budget the planner
fits in (`train.memory_gb`, the host's cap over its processes); it is not enforced on the runs
(tools/bench/zero.py --cap_mib and tools/bench/offload.py enforce theirs with cgroups). Prints the
table, writes bench_results/auto.json.
"""
import json
import os
import shutil
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.faults import harness  # noqa: E402

_MODELS = flags.DEFINE_list("models", ["gpt_nano", "gpt_mini", "gpt2"],
                            "Any of gpt_nano, gpt_mini, gpt2, gpt2_xl.")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "Worker counts.")
_OUT = flags.DEFINE_string("out", None, "Default bench_results/auto.json (merged by case).")
_REUSE = flags.DEFINE_bool("reuse", False, "Keep the rows of the same layouts measured by an "
                           "earlier run of a case (its JSON), run only the others.")
_CAP_GIB = flags.DEFINE_float("cap_gib", 20.0, "The host's memory cap for gpt2_xl (GiB).")

# per model: config, sequences per update, tokens per sequence, updates run, the host's cap
CASES = {
    "gpt_nano": ("configs/gpt_nano.py", 16, 64, 12, 0.0),
    "gpt_mini": ("configs/gpt_mini.py", 16, 256, 6, 0.0),
    "gpt2": ("configs/gpt2.py", 8, 256, 4, 0.0),
    "gpt2_xl": ("configs/gpt2_xl.py", 2, 256, 3, None),  # None: --cap_gib
}
WARM = 2  # updates not timed


def base_flags(name, workdir, k):
    """The run's flags: `k` batches per update (its steps, epoch and warmup in batches)."""
    config, batch, seq, updates, _ = CASES[name]
    return [f"--config={os.path.join(ROOT, config)}", f"--workdir={workdir}", "--overwrite",
            f"--config.model.block_size={seq}", f"--config.train.batch_size={batch // k}",
            f"--config.train.grad_accum_steps={k}", f"--config.train.steps={updates * k}",
            f"--config.train.steps_per_epoch={updates * k}", f"--config.train.warmup_steps={k}",
            f"--config.train.eval_steps={k}", "--config.train.precision=float32",
            "--config.backup.enabled=false"]


def run(name, workers, workdir, k, extra):
    cmd = harness.launch_argv([*base_flags(name, workdir, k), *extra], strategy="horovod",
                              workers=workers, max_restarts=0)
    start = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * 3600, cwd=ROOT)
    out = {"wall_s": time.time() - start, "exit": p.returncode}
    if p.returncode:
        out["tail"] = (p.stdout + p.stderr)[-1500:]
        shutil.rmtree(workdir, ignore_errors=True)
        return out
    steps = harness.metrics(workdir)["steps"][WARM * k:]
    tokens = sum(s["tokens_per_sec"] * s["step_time"] for s in steps)
    seconds = sum(s["step_time"] for s in steps)
    out.update(tokens_per_sec=tokens / seconds, seconds_per_update=seconds / len(steps) * k)
    out["chosen"] = [line for line in p.stdout.splitlines() if "layout=auto:" in line]
    shutil.rmtree(workdir, ignore_errors=True)  # (its model and offload store: GBs for GPT-2 XL)
    return out


def plan(name, workers, cap):
    """tfdist.plan.auto's decision for the case, as `tfdist train` makes it."""
    from tfdist.plan import auto
    from tfdist.strategies import get_class
    config, batch, seq, updates, _ = CASES[name]
    c = auto.bench_config(os.path.join(ROOT, config), seq, batch, updates,
                          memory_gb=cap / workers if cap else 0.0)
    return auto.choose(c, get_class("horovod"), workers, workers, pinned={})


def distinct(decision):
    """One runnable, fitting candidate per (ZeRO stage, offload): the one with the largest batch
    per step (then the largest sub-groups: the order auto ranks them in)."""
    out = {}
    for cand in decision.considered:  # (ranked)
        lay = cand.layout
        if cand.refusal is None and cand.fits:
            key = (lay.zero, lay.offload)
            if key not in out or lay.accumulate < out[key].layout.accumulate:
                out[key] = cand
    return list(out.values())


def flags_of(cand):
    return [f"--config.zero.stage={cand.layout.zero}",
            f"--config.zero.offload={cand.layout.offload}"] + (
        [f"--config.zero.offload_subgroup={cand.subgroup}"] if cand.subgroup else [])


def case(name, workers, base, done):
    """One model at one number of ranks (`done`: {layout name: row} measured before, reused)."""
    cap = CASES[name][4] if CASES[name][4] is not None else _CAP_GIB.value
    config, batch, seq, updates, _ = CASES[name]
    from tfdist.errors import UsageError
    try:
        d = plan(name, workers, cap)
    except UsageError as e:  # nothing fits: auto must say so in one line, exit 2
        extra = ["--config.layout=auto", f"--config.train.memory_gb={cap / workers}"]
        a = run(name, workers, os.path.join(base, f"{name}-{workers}-auto"), 1, extra)
        print(f"  {name} x{workers}: nothing fits: {e}; auto exit {a['exit']}", flush=True)
        return {"model": name, "workers": workers, "cap_gib": cap, "refused": str(e),
                "config": config, "batch": batch, "seq": seq, "updates": updates, "rows": [],
                "auto": a}
    rows = []
    for cand in distinct(d):
        lay = cand.layout
        k = lay.accumulate
        if cand.name in done:  # (--reuse: measured in an earlier run of this case)
            r = dict(done[cand.name])
        else:
            r = run(name, workers, os.path.join(base, f"{name}-{workers}-{lay.zero}-"
                                                      f"{lay.offload}"), k, flags_of(cand))
        r.update(layout=cand.name, describe=cand.describe(), predicted_s=cand.seconds,
                 predicted_tokens_per_sec=cand.tokens_per_sec, gib_per_process=cand.bytes / 2**30)
        if "seconds_per_update" in r:
            r["ratio"] = cand.seconds / r["seconds_per_update"]
        rows.append(r)
        print(f"  {name} x{workers} {cand.describe():<50} predicted {cand.seconds:8.3f} s  "
              f"measured {r.get('seconds_per_update', float('nan')):8.3f} s  "
              f"{r.get('tokens_per_sec', 0):10,.0f} tok/s", flush=True)
    extra = ["--config.layout=auto"] + ([f"--config.train.memory_gb={cap / workers}"]
                                         if cap else [])
    a = run(name, workers, os.path.join(base, f"{name}-{workers}-auto"), 1, extra)
    ran = [r for r in rows if "tokens_per_sec" in r]
    best = max(ran, key=lambda r: r["tokens_per_sec"]) if ran else None
    out = {"model": name, "workers": workers, "cap_gib": cap, "chosen": d.chosen.name,
           "config": config, "batch": batch, "seq": seq, "updates": updates, "rows": rows,
           "auto": a}
    if best and "tokens_per_sec" in a:
        out.update(best=best["layout"], auto_over_best=a["tokens_per_sec"] / best["tokens_per_sec"])
    print(f"  {name} x{workers}: auto chose {d.chosen.describe()}: "
          f"{a.get('tokens_per_sec', 0):,.0f} tok/s; best measured {best and best['describe']} "
          f"{best and best['tokens_per_sec']:,.0f}; auto/best "
          f"{out.get('auto_over_best', float('nan')):.3f}", flush=True)
    return out


def main(argv):
    del argv
    from tfdist.runtime.host import this_cpu
    cpu, cores = this_cpu()
    path = _OUT.value or os.path.join(ROOT, "bench_results", "auto.json")
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {"cases": []}
    base = os.path.join("/tmp", "tfdist-bench-auto")
    for name in _MODELS.value:
        for w in _WORKERS.value:
            before = next((x for x in result["cases"]
                           if (x["model"], x["workers"]) == (name, int(w))), {})
            done = {r["layout"]: r for r in before.get("rows", [])
                    if "tokens_per_sec" in r} if _REUSE.value else {}
            c = case(name, int(w), base, done)
            result["cases"] = [x for x in result["cases"]
                               if (x["model"], x["workers"]) != (name, int(w))] + [c]
            result.update(host={"cpu": cpu, "cores": cores},
                          command="python tools/bench/auto.py --models=" + ",".join(_MODELS.value))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    print(f"\n{'model':<10} {'W':>2} {'layout':<48} {'pred s':>8} {'meas s':>8} {'ratio':>6}")
    for c in result["cases"]:
        for r in c["rows"]:
            print(f"{c['model']:<10} {c['workers']:>2} {r['describe']:<48} "
                  f"{r['predicted_s']:8.3f} {r.get('seconds_per_update', float('nan')):8.3f} "
                  f"{r.get('ratio', float('nan')):6.2f}")
        print(f"{c['model']:<10} {c['workers']:>2} auto -> {c.get('chosen', 'refused'):<40} "
              f"auto/best {c.get('auto_over_best', float('nan')):.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main, sys.argv)
