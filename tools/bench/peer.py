"""Benchmark: tfdist's training step against its peers on this machine (`make bench-peer`):
a plain PyTorch eager GPT of the same shape (`tools/bench/torch_gpt.py`, in its own
`.venv-peer`) and plain Keras 3 `fit` of the same GPT, in fp32 and bf16, interleaved in one run.

    make bench-peer                                           # gpt_demo and gpt_mini, fp32 and bf16
    python tools/bench/peer.py --shapes=configs/gpt_demo.py --precisions=float32 --rounds=2

Each variant is its own process, started once per cell (shape x precision) and idle on its
standard input while the others run; the driver asks each in turn for --steps steps, round after
round, the order rotated each round, so that the noisy machine's drift falls on every variant
alike. A step's time runs from one batch's start to the next's: callbacks, logging and input
included.

* `tfdist`: `tfdist train` itself (`tfdist.train.train`): its strategy (`single`), data pipeline,
  training step, log (metrics.json, TensorBoard) and progress, with backups off;
* `keras`: the same GPT class trained by plain Keras 3 `model.fit` on batches held in memory,
  with Keras's own AdamW and global clipnorm;
* `torch`: `tools/bench/torch_gpt.py` (AdamW, clipping, `torch.autocast` for bf16), its batches read
  with `np.memmap` from the same tokens, as nanoGPT does;
* `tfdist+jit` (--jit): as `tfdist` with `jit_compile=True`.

The matmul peaks (2048^3, fp32 and bf16, TF's and torch's) are measured in the same run, before
and after each cell, best of both; so are the step's own dense-layer matmuls (`linear_products`:
forward and backward, one after another) in the cell's precision, TF's against torch's. MFU =
tokens/s * training FLOPs per token / the TF peak of the cell's precision. It prints a table and
writes bench_results/peer.json.
"""
import json
import os
import select
import subprocess
import sys
import tempfile

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import ROOT, ROUNDS, STEPS, WARMUP, cli, write_json  # noqa: E402
from tools.bench.peer_worker import load_config  # noqa: E402

_SHAPES = flags.DEFINE_list("shapes", ["configs/gpt_demo.py", "configs/gpt_mini.py"],
                            "Configs whose model and batch are benchmarked.")
_PRECISIONS = flags.DEFINE_list("precisions", ["float32", "bfloat16"], "float32, bfloat16.")
_JIT = flags.DEFINE_bool("jit", False, "Also time tfdist with jit_compile=True.")
_PEER_PYTHON = flags.DEFINE_string("peer_python", os.path.join(ROOT, ".venv-peer", "bin", "python"),
                                   "The Python that has torch (make bench-peer makes it).")
_REPLY_TIMEOUT = 1800  # s: the longest a worker may take to answer (a cell's warm-up included)


def linear_products(c):
    """The matmuls of one training step's dense layers (the attention's own products aside):
    each layer's forward x @ W, and its backward dY @ W^T and X^T @ dY, as [m, k, n, ta, tb]."""
    N, C = c.train.batch_size * c.model.block_size, c.model.n_embd
    layer = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]  # qkv, attention out, MLP in, MLP out
    out = []
    for k, n in layer * c.model.n_layer + [(C, c.model.vocab_size)]:  # (the tied head)
        out += [[N, k, n, 0, 0], [N, n, k, 0, 1], [k, N, n, 1, 0]]
    return out


# --- the driver ---------------------------------------------------------------------------------

class Worker:
    """One variant's process, spoken to a JSON line at a time (its standard output is its own
    log file; the answers come on a pipe)."""

    def __init__(self, name, argv, first, log_dir):
        self.name = name
        read, write = os.pipe()
        self.log = open(os.path.join(log_dir, name + ".log"), "w")
        self.proc = subprocess.Popen(argv + [str(write)] if name != "torch" else argv,
                                     stdin=subprocess.PIPE, stdout=self.log if name != "torch"
                                     else subprocess.PIPE, stderr=self.log, text=True,
                                     pass_fds=(write,), cwd=ROOT, start_new_session=True)
        os.close(write)
        self.replies = self.proc.stdout if name == "torch" else os.fdopen(read, "r")
        if name == "torch":
            os.close(read)
        self.ask(first)

    def ask(self, message):
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.replies], [], [], _REPLY_TIMEOUT)
        line = self.replies.readline() if ready else ""
        if not line:
            self.close()
            sys.exit(f"bench_peer: {self.name} gave no answer to {message} (its log: "
                     f"{self.log.name}):\n" + open(self.log.name).read()[-3000:])
        return json.loads(line)

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def peer_shape(c):
    m, t = c.model, c.train
    return dict(vocab_size=m.vocab_size, block_size=m.block_size, n_layer=m.n_layer,
                n_head=m.n_head, n_embd=m.n_embd, batch_size=t.batch_size,
                learning_rate=t.learning_rate, weight_decay=t.weight_decay, beta1=t.beta1,
                beta2=t.beta2, grad_clip=t.grad_clip)


def export_tokens(c, path, limit=1 << 24):
    """The train split's first `limit` tokens as nanoGPT's train.bin (raw uint16)."""
    import numpy as np

    from tfdist.data import open_store
    store = open_store(c.data)
    split = store.split("train")
    n = min(limit, split.num_tokens)
    ids = split.windows([0], n)[0].numpy() if n <= split.shard_tokens else np.concatenate(
        [split.windows([s], min(split.shard_tokens, n - s))[0].numpy()
         for s in range(0, n, split.shard_tokens)])
    ids.astype(np.uint16).tofile(path)
    return store.vocab_size


def run_cell(shape_path, precision, log_dir):
    from tfdist.models.arithmetic import Transformer
    c = load_config(shape_path)
    data = os.path.join(log_dir, "train.bin")
    vocab = export_tokens(c, data)
    c.model.vocab_size = c.model.vocab_size or vocab
    names = ["tfdist", "keras", "torch"] + (["tfdist+jit"] if _JIT.value else [])
    me = [sys.executable, os.path.join(ROOT, "tools", "bench", "peer_worker.py"), shape_path,
          precision]
    workers = {}
    try:
        for name in names:
            argv = ([_PEER_PYTHON.value, os.path.join(ROOT, "tools", "bench", "torch_gpt.py")]
                    if name == "torch" else me + [name])
            # (each answers once it has built its model and run the warm-up steps)
            workers[name] = Worker(name, argv, {"shape": peer_shape(c), "precision": precision,
                                                "data": data, "warmup": WARMUP.value}, log_dir)
            print(f"  {name}: ready", flush=True)
        peaks, linear = {}, {}
        products = linear_products(c)

        def measure_peaks():
            for dtype in ("float32", "bfloat16"):
                for who in ("tfdist", "torch"):
                    f = workers[who].ask({"peak": dtype})["flops"]
                    peaks[(who, dtype)] = max(peaks.get((who, dtype), 0), f)
            for who in ("tfdist", "torch"):  # the model's own products, in the cell's precision
                s = workers[who].ask({"products": products, "dtype": precision})["seconds"]
                linear[who] = min(linear.get(who, float("inf")), s)
        measure_peaks()
        times = {name: [] for name in names}
        for r in range(ROUNDS.value):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                got = workers[name].ask({"steps": STEPS.value})["times"]
                times[name] += got
                print(f"  round {r + 1}: {name:10s} {sorted(got)[len(got) // 2]:.3f} s/step",
                      flush=True)
        measure_peaks()
    finally:
        for w in workers.values():
            w.close()
    arch = Transformer(n_layer=c.model.n_layer, n_embd=c.model.n_embd, n_head=c.model.n_head,
                       vocab_size=c.model.vocab_size, seq_len=c.model.block_size)
    fpt = arch.flops_per_token()
    tokens = c.train.batch_size * c.model.block_size
    peak = peaks[("tfdist", precision)]
    rows = {}
    for name, ts in times.items():
        step = sorted(ts)[len(ts) // 2]
        rows[name] = {"step_time_s": step, "tokens_per_sec": tokens / step,
                      "mfu": tokens / step * fpt / peak, "times": ts}
    torch_tps, keras_tps = rows["torch"]["tokens_per_sec"], rows["keras"]["tokens_per_sec"]
    for row in rows.values():
        row["vs_torch"] = row["tokens_per_sec"] / torch_tps
    return {"config": os.path.basename(shape_path), "precision": precision,
            "params": arch.params(), "batch": c.train.batch_size, "context": c.model.block_size,
            "flops_per_token": fpt,
            "peaks": {f"{who}_{dtype}": f for (who, dtype), f in peaks.items()},
            "linear_matmuls_s": linear,
            "tfdist_overhead_vs_keras": 1 - rows["tfdist"]["tokens_per_sec"] / keras_tps,
            "rows": rows}


def drive():
    if not os.path.exists(_PEER_PYTHON.value) or subprocess.run(
            [_PEER_PYTHON.value, "-c", "import torch"], capture_output=True,
            timeout=120).returncode != 0:
        print(f"bench_peer: error: the peer needs torch (the `hf` extra: torch==2.13.0), which "
              f"{_PEER_PYTHON.value} does not have; `make bench-peer` makes the peer's "
              f"environment, or pass --peer_python=<a Python with torch>", file=sys.stderr)
        sys.exit(2)
    cells = []
    with tempfile.TemporaryDirectory(prefix="tfdist-peer-") as tmp:
        for shape in _SHAPES.value:
            for precision in _PRECISIONS.value:
                print(f"{shape} {precision}:", flush=True)
                log_dir = os.path.join(tmp, os.path.basename(shape))
                os.makedirs(log_dir, exist_ok=True)
                cells.append(run_cell(shape, precision, log_dir))
    print(f"\n{'shape':12s} {'precision':9s} {'variant':11s} {'s/step':>7s} {'tokens/s':>9s} "
          f"{'MFU':>6s} {'vs torch':>8s}")
    for cell in cells:
        for name, r in cell["rows"].items():
            print(f"{cell['config']:12s} {cell['precision']:9s} {name:11s} {r['step_time_s']:7.3f} "
                  f"{r['tokens_per_sec']:9.0f} {100 * r['mfu']:5.1f}% {r['vs_torch']:8.3f}")
        print(f"{'':12s} {'':9s} tfdist over plain Keras fit: "
              f"{100 * cell['tfdist_overhead_vs_keras']:+.1f}% of the step's throughput; peaks "
              + ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in sorted(cell["peaks"].items()))
              + " GFLOP/s")
        lin = cell["linear_matmuls_s"]
        print(f"{'':12s} {'':9s} the step's dense-layer matmuls alone: TF {lin['tfdist']:.3f} s, "
              f"torch {lin['torch']:.3f} s (torch {lin['tfdist'] / lin['torch']:.2f}x TF's speed)")
    write_json({"cores": os.cpu_count(), "steps": STEPS.value, "rounds": ROUNDS.value,
                "cells": cells}, "bench_results/peer.json")


def main(argv):
    del argv
    drive()


if __name__ == "__main__":
    cli.run(main, sys.argv)
