"""Benchmark: tokens/s and MFU of a GPT training step, tfdist vs plain Keras 3 `fit`.

    python tools/bench.py                       # gpt_mini, batch 16 x 256, both cores
    python tools/bench.py --steps=4 --rounds=2 --config=configs/gpt_nano.py   # quick look

What it measures, all in one process so that the noisy machine affects every variant alike:
* the matmul peak of this machine (FLOP/s, fp32 2048^3 `tf.matmul`, best of several);
* steady-state training steps (a callback around each batch, after warm-up) of
  - `tfdist`: the `single` strategy plugin, tfdist's data pipeline, callbacks and optimizer;
  - `keras`: the same GPT class trained by plain Keras 3 `model.fit` on an in-memory dataset;
  - `tfdist+jit`: as `tfdist` with `jit_compile=True` (XLA);
  the variants are interleaved round by round and compared as ratios;
* MFU = tokens/s * (6 N + 12 L C T) / peak (nanoGPT's formula; N without position embeddings).
It prints a table and writes JSON (--out).
"""
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist import cli  # noqa: E402

_CONFIG = cli.define_config_flag(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "gpt_mini.py"),
    "Model/training config to benchmark.")
_STEPS = flags.DEFINE_integer("steps", 6, "Timed steps per variant per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps per variant before the rounds.")
_JIT = flags.DEFINE_bool("jit", True, "Also time jit_compile=True.")
_OUT = flags.DEFINE_string("out", "bench_results/bench.json", "Where to write the JSON results.")


def matmul_peak(n=2048, repeats=10):
    import tensorflow as tf
    a = tf.random.normal((n, n))
    b = tf.random.normal((n, n))
    f = tf.function(lambda: tf.matmul(a, b))
    f().numpy()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f().numpy()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def main(argv):
    del argv
    import keras
    import numpy as np
    import tensorflow as tf
    from tfdist import config as config_lib
    from tfdist import strategies
    from tfdist.data import Windows, load_corpus
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer

    c = config_lib.validate(_CONFIG.value)
    t, m = c.train, c.model
    strategy = strategies.get("single")
    corpus = load_corpus(c.data)
    windows = Windows(corpus.train, m.block_size, t.batch_size, seed=c.seed)
    tokens_per_step = t.batch_size * m.block_size
    total = _WARMUP.value + _STEPS.value * _ROUNDS.value

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self._t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._t)

    def build():
        keras.utils.set_random_seed(c.seed)
        model = GPT.from_model_config(m)
        model.build()
        return model

    variants = {}

    # tfdist: strategy plugin, pipeline, optimizer fixes, tfdist's per-step log
    from tfdist.callbacks import TrainingLog

    def tfdist_variant(jit):
        with strategy.scope():
            model = build()
            opt = strategy.wrap_optimizer(make_optimizer(t, total))
            model.compile(optimizer=opt, loss=loss_fn(), jit_compile=jit)
        timer = Timer()
        log = TrainingLog("/tmp/tfdist-bench", tokens_per_step=tokens_per_step, is_chief=False)

        def run(steps):
            strategy.fit(model, lambda start: windows.dataset_fn(start, steps),
                         epochs=1, steps_per_epoch=steps, callbacks=[log, timer], verbose=0)
        return run, timer, model

    # plain Keras 3: same model class, same optimizer settings, no tfdist machinery
    def keras_variant():
        model = build()
        model.compile(optimizer=make_optimizer(t, total), loss=loss_fn())
        xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in windows.dataset_fn(0, total)(None)])
        timer = Timer()

        def run(steps, _pos=[0]):
            i = _pos[0]
            x, y = np.concatenate(xs[i:i + steps]), np.concatenate(ys[i:i + steps])
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(t.batch_size)
            model.fit(ds, epochs=1, steps_per_epoch=steps, callbacks=[timer], verbose=0,
                      shuffle=False)
            _pos[0] += steps
        return run, timer, model

    variants["tfdist"] = tfdist_variant(False)
    variants["keras"] = keras_variant()
    if _JIT.value:
        variants["tfdist+jit"] = tfdist_variant(True)

    peak = matmul_peak()
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s (fp32)", flush=True)
    for name, (run, timer, _) in variants.items():  # warm-up: tracing, first steps
        run(_WARMUP.value)
        timer.times.clear()
    for r in range(_ROUNDS.value):
        for name, (run, timer, _) in variants.items():
            run(_STEPS.value)
            print(f"round {r + 1}: {name:11s} {np.median(timer.times[-_STEPS.value:]):.3f} s/step",
                  flush=True)

    model = variants["tfdist"][2]
    fpt = model.flops_per_token()
    rows = []
    base = None
    for name, (_, timer, _) in variants.items():
        step = float(np.median(timer.times))
        tps = tokens_per_step / step
        base = base or tps
        rows.append({"variant": name, "step_time_s": step, "tokens_per_sec": tps,
                     "mfu": tps * fpt / peak, "relative_to_tfdist": tps / base})
    keras_tps = next(r["tokens_per_sec"] for r in rows if r["variant"] == "keras")
    result = {"config": os.path.basename(config_flags_filename()), "params": model.num_params(),
              "batch": t.batch_size, "context": m.block_size, "flops_per_token": fpt,
              "matmul_peak_flops": peak, "threads": "TF default (both cores)",
              "tfdist_overhead_vs_keras": 1 - rows[0]["tokens_per_sec"] / keras_tps, "rows": rows}

    print(f"\n{result['config']}: {result['params']:,} params, batch {t.batch_size} x {m.block_size}"
          f", peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'variant':12s} {'s/step':>8s} {'tokens/s':>10s} {'MFU':>7s} {'vs tfdist':>10s}")
    for r in rows:
        print(f"{r['variant']:12s} {r['step_time_s']:8.3f} {r['tokens_per_sec']:10.0f} "
              f"{100 * r['mfu']:6.1f}% {r['relative_to_tfdist']:10.3f}")
    print(f"tfdist overhead vs plain Keras fit: {100 * result['tfdist_overhead_vs_keras']:+.1f}% "
          f"of throughput")
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {_OUT.value}")


def config_flags_filename():
    from ml_collections import config_flags
    return config_flags.get_config_filename(flags.FLAGS["config"])


if __name__ == "__main__":
    cli.run(main, sys.argv)
