"""The cost of gradient accumulation under multi_worker_mirrored: an update of --accumulate
batches of B sequences against one batch of --accumulate x B, per token, in the same run.

    python tools/bench/accumulation.py                  # make bench-accumulation
    python tools/bench/accumulation.py --accumulate=8 --rounds=5

Both variants are `tfdist launch --workers 2` runs of gpt_mini (`--config`), one intra-op thread
per process, no backup, interleaved for --rounds rounds. Each runs 2 untimed updates (each
function traced), then --updates timed ones; a variant's time per token is its log's wall time
over the timed steps divided by their tokens (so the accumulating run's cheap batches, which
only add to the sums, and its updating ones, which also all-reduce, both count). The ratio
"accumulating / one batch" of each round compares two runs made minutes apart; the median over
the rounds is the figure.

Both all-reduce once per update. Accumulating adds k - 1 passes over the sums and runs k smaller
matmuls; its activations are k times smaller (the point of it), which on this CPU's caches can
make it cheaper per token. Measured here (3 rounds, gpt_mini, k = 4): 0.97 (0.91-1.04): the same
cost within the machine's noise.

Prints a table and writes bench_results/accumulation-mwms.json.
"""
import os
import statistics
import sys
import tempfile

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.bench import common  # noqa: E402

_K = flags.DEFINE_integer("accumulate", 4, "Batches per update of the accumulating variant.")
_MICRO = flags.DEFINE_integer("micro", 4, "Sequences per process and batch when accumulating.")
_UPDATES = flags.DEFINE_integer("updates", 6, "Timed updates per run.")
UNTIMED = 2  # updates before the timed ones


def per_token(steps, first_timed, batch, seq_len):
    """Seconds per token over the logged steps after `first_timed` (wall time between the last
    untimed step's end and the last step's)."""
    start = next(r for r in steps if r["step"] == first_timed)
    end = steps[-1]
    tokens = (end["step"] - start["step"]) * batch * seq_len
    return (end["time"] - start["time"]) / tokens


def one(variant, k, workers, seq_len):
    """Seconds per token of one run: "accumulating" (k batches of micro x workers sequences per
    update) or "one batch" (k x micro x workers sequences, one batch per update)."""
    micro = _MICRO.value * workers
    batch, accumulate = (micro, k) if variant == "accumulating" else (k * micro, 1)
    steps = (UNTIMED + _UPDATES.value) * accumulate
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-accumulation-") as workdir:
        flags_ = common.train_flags(workdir, steps, batch, common.INTER.value, extra=[
            f"--config.train.grad_accum_steps={accumulate}"])
        cmd = common.harness.launch_argv(flags_, workers=workers, max_restarts=0)
        p = common.run_on_hosts(cmd, workers)
        if p.returncode:
            sys.exit(f"bench: the {variant} run failed (exit {p.returncode}):\n"
                     f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        log = common.harness.metrics(workdir)["steps"]
    return per_token(log, UNTIMED * accumulate, batch, seq_len)


def main(argv):
    del argv
    k, workers = _K.value, common.WORKERS.value
    seq_len = common.config().model.block_size
    peak = common.matmul_peak() / 1e9
    rows = []
    for r in range(common.ROUNDS.value):
        a = one("accumulating", k, workers, seq_len)
        b = one("one batch", k, workers, seq_len)
        rows.append({"round": r + 1, "accumulating_us_per_token": a * 1e6,
                     "one_batch_us_per_token": b * 1e6, "ratio": a / b})
        print(f"round {r + 1}: accumulating {a * 1e6:8.2f} us/token, one batch {b * 1e6:8.2f} "
              f"us/token, ratio {a / b:.3f}", flush=True)
    ratio = statistics.median(x["ratio"] for x in rows)
    print(f"\n{'variant':<34} {'us/token (median)':>18}")
    print(f"{f'{k} x {_MICRO.value} seq/process, accumulated':<34} "
          f"{statistics.median(x['accumulating_us_per_token'] for x in rows):>18.2f}")
    print(f"{f'1 x {k * _MICRO.value} seq/process':<34} "
          f"{statistics.median(x['one_batch_us_per_token'] for x in rows):>18.2f}")
    print(f"accumulating / one batch, per token: {ratio:.3f} (median of {len(rows)} rounds; "
          f"{min(x['ratio'] for x in rows):.3f}-{max(x['ratio'] for x in rows):.3f})")
    common.write_json({"strategy": "multi_worker_mirrored", "workers": workers,
                       "config": common.harness.relative(common.config_filename()),
                       "accumulate": k, "micro_per_process": _MICRO.value,
                       "seq_len": seq_len, "timed_updates": _UPDATES.value,
                       "matmul_peak_gflops": peak, "rounds": rows, "ratio": ratio},
                      os.path.join(ROOT, "bench_results", "accumulation-mwms.json"))


if __name__ == "__main__":
    app.run(main)
