"""Benchmark: what compression and islands cost in quality (`make bench-dp-quality`).

    python tools/bench/dp_quality.py                    # gpt_mini, 2 and 4 workers, 150 steps
    python tools/bench/dp_quality.py --worker_counts=2 --train_steps=300

gpt_mini on the stdlib corpus (the config's), `tfdist launch` on this machine, the same global
batch and steps (so the same tokens) for every run of a worker count:

* `synchronous`: plain data parallelism (multi_worker_mirrored's all-reduce);
* `powersgd`: `dp.compression=powersgd`, rank 4 (after its 10 plain updates);
* `islands`: `tfdist launch --islands=2`, two islands of workers / 2, a sync every 50 updates
  (DiLoCo's outer Nesterov SGD, lr 0.7, momentum 0.9; int8 deltas).

Each row: the validation loss after the run (the config's eval_steps batches; islands: island
0's, after the last sync), and its ratio to the synchronous run's. Writes
bench_results/dp-quality.json and the loss curves (training loss, smoothed; validation loss at
each epoch's end) to bench_results/dp-quality.png.
"""
import os
import sys
import tempfile

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import config, config_filename, host, write_json  # noqa: E402
from tools.faults import harness  # noqa: E402

_WORKERS = flags.DEFINE_list("worker_counts", ["2", "4"], "Worker counts.")
_STEPS = flags.DEFINE_integer("train_steps", 150, "Steps of every run (each an update).")
_EVERY = flags.DEFINE_integer("islands_h", 50, "The islands' sync_every.")
_RANK = flags.DEFINE_integer("powersgd_rank", 4, "PowerSGD's rank.")

RUNS = {
    "synchronous": (1, []),
    "powersgd": (1, ["--config.dp.compression=powersgd"]),
    "islands": (2, ["--config.dp.islands=2", "--config.dp.exchange=int8"]),
}


def one_run(name, workers, workdir):
    """(final validation loss, [(step, loss)], [(step, val loss)]) of one run."""
    islands, extra = RUNS[name]
    c = config()
    steps = _STEPS.value
    flags_ = [f"--config={config_filename()}", f"--workdir={workdir}", "--overwrite",
              f"--config.train.steps={steps}", f"--config.train.steps_per_epoch={steps // 3}",
              f"--config.train.batch_size={c.train.batch_size * workers}",
              "--config.backup.enabled=false", f"--config.dp.sync_every={_EVERY.value}",
              f"--config.dp.powersgd_rank={_RANK.value}", *extra]
    cmd = harness.launch_argv(flags_, workers=workers, max_restarts=0,
                              extra=[f"--islands={islands}"])
    p = harness.run_group(cmd, timeout=7200)
    if p.returncode:
        sys.exit(f"bench: {name} on {workers} workers failed (exit {p.returncode}):\n"
                 f"{p.stdout[-3000:]}\n{p.stderr[-2000:]}")
    m = harness.metrics(os.path.join(workdir, "island-0") if islands > 1 else workdir)
    train = [(r["step"], r["loss"]) for r in m["steps"]]
    evals = [(r["step"], r["loss"]) for r in m["evals"]]
    return evals[-1][1], train, evals


def main(argv):
    del argv
    if _STEPS.value % 3 or _STEPS.value % _EVERY.value:
        sys.exit(f"bench: --train_steps must be a multiple of 3 (epochs) and of --islands_h "
                 f"({_EVERY.value}): the islands' last sync is the last step")
    tmp = tempfile.mkdtemp(prefix="tfdist-dp-quality-")
    rows, curves = [], {}
    for workers in (int(w) for w in _WORKERS.value):
        base = None
        for name in RUNS:
            val, train, evals = one_run(name, workers, os.path.join(tmp, f"{name}-{workers}"))
            base = base or val
            rows.append({"run": name, "workers": workers, "steps": _STEPS.value,
                         "tokens": _STEPS.value * config().train.batch_size * workers
                         * config().model.block_size,
                         "val_loss": val, "val_over_synchronous": val / base})
            curves[f"{name}, {workers} workers"] = (train, evals)
            print(f"{name:12s} {workers} workers: validation loss {val:.4f} "
                  f"({val / base:.3f}x synchronous)", flush=True)
    print(f"\n{os.path.basename(config_filename())}, {_STEPS.value} steps; islands: 2, "
          f"H = {_EVERY.value}; PowerSGD rank {_RANK.value}")
    print(f"{'run':12s} {'workers':>7s} {'val loss':>9s} {'x sync':>7s}")
    for r in rows:
        print(f"{r['run']:12s} {r['workers']:7d} {r['val_loss']:9.4f} "
              f"{r['val_over_synchronous']:7.3f}")
    result = {"config": os.path.basename(config_filename()), "steps": _STEPS.value,
              "sync_every": _EVERY.value, "islands": 2, "powersgd_rank": _RANK.value,
              "rows": rows, "curves": {k: {"train": t, "val": v} for k, (t, v) in curves.items()},
              "host": host()}
    result = merged("bench_results/dp-quality.json", result)
    plot({k: (c["train"], c["val"]) for k, c in result["curves"].items()},
         "bench_results/dp-quality.png")
    write_json(result, "bench_results/dp-quality.json")


def merged(path, result):
    """`result` with the rows (and curves, where kept) of the other worker counts that `path`
    (an earlier run with the same config, steps, H and rank) holds: `--worker_counts=4` adds
    to the 2-worker figures."""
    import json
    try:
        with open(os.path.join(harness.ROOT, path)) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return result
    if any(old.get(k) != result[k] for k in ("config", "steps", "sync_every", "powersgd_rank")):
        return result
    ran = {r["workers"] for r in result["rows"]}
    kept = [r for r in old["rows"] if r["workers"] not in ran]
    curves = {k: c for k, c in old.get("curves", {}).items()
              if int(k.split(", ")[1].split()[0]) not in ran}
    return {**result, "rows": sorted(kept + result["rows"], key=lambda r: r["workers"]),
            "curves": {**curves, **result["curves"]}}


def plot(curves, path):
    """The training loss (a moving mean of 10 steps) and the validation points of each run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (train, evals) in curves.items():
        steps = [s for s, _ in train]
        losses = [v for _, v in train]
        smooth = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1])
                  for i in range(len(losses))]
        line, = ax.plot(steps, smooth, label=label, linewidth=1)
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o", color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token; dots: validation)")
    ax.set_title("gpt_mini: synchronous, PowerSGD rank 4, islands (DiLoCo)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(harness.ROOT, path), dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
