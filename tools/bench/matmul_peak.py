"""This machine's fp32 matmul rate now, beside the one `make bench` committed: `make test` prints
it before and after the suite, so that a slow day shows next to the suite's time.

    python tools/bench/matmul_peak.py --when=before
    fp32 matmul peak before the suite: 198.3 GFLOP/s (0.97x bench_results/bench.json's 205.3)

The same measure as `make bench` (`measure`, which the benchmarks use: the best of 10 products of
2048 x 2048 matrices, TensorFlow's default threads: every core).
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

WHEN = flags.DEFINE_string("when", "", "Said in the line: before or after what (e.g. the suite).")


def measure(n=2048, repeats=10, dtype=None):
    """FLOP/s of the best of `repeats` n^3 `tf.matmul`s (fp32 unless `dtype`), TF's default
    threads."""
    import time

    import tensorflow as tf
    a = tf.random.normal((n, n), dtype=dtype or tf.float32)
    b = tf.random.normal((n, n), dtype=dtype or tf.float32)
    f = tf.function(lambda: tf.matmul(a, b))
    f().numpy()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f().numpy()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def measure_products(shapes, dtype=None, repeats=5):
    """Seconds of the best of `repeats` runs of the products `shapes` ([m, k, n, transpose_a,
    transpose_b] each: an (m x k) times (k x n) product whose operands are stored transposed as
    said), one after another in one `tf.function`, TF's default threads."""
    import time

    import tensorflow as tf
    dtype = dtype or tf.float32
    operands = [(tf.random.normal((k, m) if ta else (m, k), dtype=dtype),
                 tf.random.normal((n, k) if tb else (k, n), dtype=dtype))
                for m, k, n, ta, tb in shapes]

    @tf.function
    def run(operands):  # (arguments, not captured constants, which Grappler would fold)
        # (returned: an op that feeds only a control input would be pruned)
        corners = [tf.constant(0, dtype)]
        for (a, b), (_, _, _, ta, tb) in zip(operands, shapes):
            with tf.control_dependencies(corners[-1:]):  # one at a time, as torch runs them
                corners.append(tf.matmul(a, b, transpose_a=bool(ta), transpose_b=bool(tb))[0, 0])
        return tf.stack(corners)
    run(operands).numpy()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run(operands).numpy()
        best = min(best, time.perf_counter() - t)
    return best


def committed():
    """bench_results/bench.json's peak in FLOP/s, or None."""
    try:
        with open(os.path.join(ROOT, "bench_results", "bench.json")) as f:
            return json.load(f)["matmul_peak_flops"]
    except (OSError, ValueError, KeyError):
        return None


def main(argv):
    from tfdist.runtime.console import quiet_tensorflow_import
    quiet_tensorflow_import()
    peak, then = measure(), committed()
    against = f" ({peak / then:.2f}x bench_results/bench.json's {then / 1e9:.1f})" if then else ""
    when = f" {WHEN.value} the suite" if WHEN.value else ""
    print(f"fp32 matmul peak{when}: {peak / 1e9:.1f} GFLOP/s{against}", flush=True)


if __name__ == "__main__":
    app.run(main)
