"""A user's Keras program for the islands' equality test (tests/test_islands.py): a small MLP
with plain SGD, its data through `strategy.distribute` (each replica its rows of every global
batch of 16), under multi_worker_mirrored; `--islands=N` trains it as N local-SGD islands that
sync after every update with an outer step of lr 1 and no momentum (`--outer_momentum`: with
it), in float32. Prints one
`RESULT {json}` line per process: its per-batch logged losses and final weights."""
import argparse
import json

import keras
import numpy as np
import tensorflow as tf

import tfdist.strategies

ap = argparse.ArgumentParser()
ap.add_argument("--islands", type=int, default=1)
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--outer_momentum", type=float, default=0.0)
args = ap.parse_args()

GLOBAL_BATCH = 16
options = dict(islands=args.islands, sync_every=1, outer_lr=1.0, outer_momentum=args.outer_momentum,
               exchange="float32") if args.islands > 1 else {}
strategy = tfdist.strategies.get("multi_worker_mirrored", **options)
rng = np.random.default_rng(0)
x = rng.normal(size=(GLOBAL_BATCH * args.steps, 8)).astype(np.float32)
y = np.tanh(x @ rng.normal(size=(8, 1))).astype(np.float32)


def dataset_fn(context):
    """Per replica: its rows of every global batch (as many replicas as the context says)."""
    per = GLOBAL_BATCH // context.num_replicas_in_sync
    first = context.input_pipeline_id * per

    def rows(step):
        start = step * GLOBAL_BATCH + first
        return x[start:start + per], y[start:start + per]

    return tf.data.Dataset.from_tensor_slices(
        ([rows(s)[0] for s in range(args.steps)], [rows(s)[1] for s in range(args.steps)]))


keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
losses = []
record = keras.callbacks.LambdaCallback(
    on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
model.fit(strategy.distribute(dataset_fn), epochs=1, steps_per_epoch=args.steps, verbose=0,
          callbacks=[record])
print("RESULT " + json.dumps({"losses": losses,
                              "weights": [w.tolist() for w in model.get_weights()]}), flush=True)
