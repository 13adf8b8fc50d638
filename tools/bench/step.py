"""Benchmark: tokens/s and MFU of a GPT training step, tfdist against plain Keras 3 `fit` (`make
bench`).

    python tools/bench/step.py                  # gpt_mini, batch 16 x 256, both cores
    python tools/bench/step.py --steps=4 --rounds=2 --config=configs/gpt_nano.py   # quick look

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
import os
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import (  # noqa: E402
    ROUNDS,
    STEPS,
    WARMUP,
    cli,
    config,
    config_filename,
    matmul_peak,
    write_json,
)

_JIT = flags.DEFINE_bool("jit", True, "Also time jit_compile=True.")


def main(argv):
    del argv
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist import config as config_lib
    from tfdist import strategies
    from tfdist.data import Windows, open_store
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep

    c = config_lib.validate(config())
    t, m = c.train, c.model
    strategy = strategies.get("single")
    data = open_store(c.data)
    if not m.vocab_size:
        m.vocab_size = data.vocab_size
    windows = Windows(data.split("train"), m.block_size, t.batch_size, seed=c.seed)
    tokens_per_step = t.batch_size * m.block_size
    total = WARMUP.value + STEPS.value * ROUNDS.value

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

    # tfdist: strategy plugin, pipeline, training step, tfdist's per-step log
    from tfdist.callbacks import TrainingLog

    def tfdist_variant(jit):  # as `tfdist train` builds it: tfdist's training step (tfdist.step)
        with strategy.scope():
            model = build()
            model.compile(optimizer=make_optimizer(t, total), loss=loss_fn(), jit_compile=jit)
            model.train_step = TrainStep(
                model, strategy, Layout(batch=t.batch_size, jit_compile=jit),
                clipnorm=t.grad_clip)
        timer = Timer()
        log = TrainingLog("/tmp/tfdist-bench", tokens_per_step=tokens_per_step, is_chief=False)

        def run(steps):
            strategy.fit(model, lambda start: windows.dataset_fn(start, steps),
                         epochs=1, steps_per_epoch=steps, callbacks=[log, timer], verbose=0)
        return run, timer, model

    # plain Keras 3: same model class, same optimizer settings, no tfdist machinery
    def keras_variant():
        model = build()
        keras_opt = make_optimizer(t, total)
        keras_opt.global_clipnorm = t.grad_clip or None  # (tfdist's step clips; Keras's own here)
        model.compile(optimizer=keras_opt, loss=loss_fn())
        xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in windows.dataset_fn(0, total)(None)])
        timer = Timer()
        pos = [0]  # the next step's batch, across runs

        def run(steps):
            i = pos[0]
            x, y = np.concatenate(xs[i:i + steps]), np.concatenate(ys[i:i + steps])
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(t.batch_size)
            model.fit(ds, epochs=1, steps_per_epoch=steps, callbacks=[timer], verbose=0,
                      shuffle=False)
            pos[0] += steps
        return run, timer, model

    variants["tfdist"] = tfdist_variant(False)
    variants["keras"] = keras_variant()
    if _JIT.value:
        variants["tfdist+jit"] = tfdist_variant(True)

    peak = matmul_peak()
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s (fp32)", flush=True)
    for run, timer, _ in variants.values():  # warm-up: tracing, first steps
        run(WARMUP.value)
        timer.times.clear()
    for r in range(ROUNDS.value):
        for name, (run, timer, _) in variants.items():
            run(STEPS.value)
            print(f"round {r + 1}: {name:11s} {np.median(timer.times[-STEPS.value:]):.3f} s/step",
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
    result = {"config": os.path.basename(config_filename()), "params": model.num_params(),
              "batch": t.batch_size, "context": m.block_size, "flops_per_token": fpt,
              "matmul_peak_flops": peak, "cores": os.cpu_count(),
              "threads": "TF default (all cores)",
              "tfdist_overhead_vs_keras": 1 - rows[0]["tokens_per_sec"] / keras_tps, "rows": rows}

    print(f"\n{result['config']}: {result['params']:,} params, batch {t.batch_size} x "
          f"{m.block_size}, peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'variant':12s} {'s/step':>8s} {'tokens/s':>10s} {'MFU':>7s} {'vs tfdist':>10s}")
    for r in rows:
        print(f"{r['variant']:12s} {r['step_time_s']:8.3f} {r['tokens_per_sec']:10.0f} "
              f"{100 * r['mfu']:6.1f}% {r['relative_to_tfdist']:10.3f}")
    print(f"tfdist overhead vs plain Keras fit: {100 * result['tfdist_overhead_vs_keras']:+.1f}% "
          f"of throughput")
    write_json(result, "bench_results/bench.json")




if __name__ == "__main__":
    cli.run(main, sys.argv)
