"""One TF variant of `tools/bench/peer.py`, in its own process:

    python tools/bench/peer_worker.py CONFIG PRECISION VARIANT REPLY_FD

VARIANT is `tfdist` (`tfdist train` itself, backups off), `tfdist+jit` (the same with
`jit_compile=True`) or `keras` (the same GPT under plain Keras 3 `fit`, batches held in memory,
Keras's own AdamW and global clipnorm). PRECISION is float32 or bfloat16 (`mixed_bfloat16`).

It reads requests from its standard input, a JSON object a line, and answers each on the file
descriptor REPLY_FD (its standard output is the run's own log): the first line is the driver's
`{"warmup": N, ...}`, answered `{"ready": true}` once N steps have run; then `{"steps": n}` is
answered with the n steps' times (`{"times": [...]}`: from one batch's start to the next's, so
callbacks, logging and input count), `{"peak": "float32"}` with this process's matmul FLOP/s,
and `{"products": [[m, k, n, ta, tb], ...], "dtype": "float32"}` with the seconds those products
take (tools/bench/matmul_peak.py's `measure_products`).
At the end of its input it exits. Training pauses between batches while it waits.
"""
import importlib.util
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

POLICY = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


def load_config(path):
    """`get_config()` of a config file (relative to the repository)."""
    spec = importlib.util.spec_from_file_location("bench_config", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def serve(shape, precision, variant, reply_fd):
    import keras
    import tensorflow as tf

    from tools.bench.matmul_peak import measure, measure_products

    reply = os.fdopen(reply_fd, "w")
    first = json.loads(sys.stdin.readline())

    def say(obj):
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    class Controller(keras.callbacks.Callback):
        """Runs the steps the driver asks for, between batches, and answers with their times."""

        def __init__(self, warmup):
            super().__init__()
            self.begins = []
            self.wanted = warmup
            self.warm = False

        def on_train_batch_begin(self, batch, logs=None):
            self.begins.append(time.perf_counter())
            if len(self.begins) <= self.wanted:
                return
            say({"times": [b - a for a, b in zip(self.begins, self.begins[1:])]}
                if self.warm else {"ready": True})
            self.warm = True
            while True:  # the next request; a peak is answered here
                line = sys.stdin.readline()
                if not line:
                    os._exit(0)
                msg = json.loads(line)
                if "peak" in msg:
                    say({"flops": measure(dtype=getattr(tf, msg["peak"]))})
                    continue
                if "products" in msg:
                    say({"seconds": measure_products(msg["products"], getattr(tf, msg["dtype"]))})
                    continue
                self.wanted = msg["steps"]
                self.begins = [time.perf_counter()]
                return

    controller = Controller(first["warmup"])
    c = load_config(shape)
    c.train.update(steps=100_000, steps_per_epoch=100_000, warmup_steps=10)
    c.backup.enabled = False
    c.train.precision = POLICY[precision]
    if variant.startswith("tfdist"):
        from tfdist.train import train
        c.train.jit_compile = variant == "tfdist+jit"
        with tempfile.TemporaryDirectory(prefix="tfdist-peer-run-") as workdir:
            train(c, workdir, overwrite=True, extra_callbacks=[controller])
        return
    # plain Keras: the same GPT, Keras's own step and clipping, batches held in memory
    import numpy as np

    from tfdist.data import Windows, open_store
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer
    data = open_store(c.data)
    c.model.vocab_size = c.model.vocab_size or data.vocab_size
    keras.mixed_precision.set_dtype_policy(c.train.precision)
    keras.utils.set_random_seed(c.seed)
    model = GPT.from_model_config(c.model)
    optimizer = make_optimizer(c.train, c.train.steps, cls=keras.optimizers.AdamW)  # Keras's own
    optimizer.global_clipnorm = c.train.grad_clip or None
    model.compile(optimizer=optimizer, loss=loss_fn())
    windows = Windows(data.split("train"), c.model.block_size, c.train.batch_size, seed=c.seed)
    x, y = (np.concatenate(a) for a in zip(*[(x.numpy(), y.numpy()) for x, y in
                                            windows.dataset_fn(0, 64)(None)]))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(c.train.batch_size).repeat()
    model.fit(ds.prefetch(2), epochs=1, steps_per_epoch=c.train.steps, callbacks=[controller],
              verbose=0)


if __name__ == "__main__":
    shape_, precision_, variant_, fd = sys.argv[1:5]
    serve(shape_, precision_, variant_, int(fd))
