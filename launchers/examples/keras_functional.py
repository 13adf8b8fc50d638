"""Your own Keras model under a tfdist strategy: a small functional regression model, plain
`model.fit`, nothing GPT-specific. tfdist supplies the strategy, which also corrects Keras 3 under
MultiWorkerMirrored (keras-team/keras#20585) and is Keras 3's Horovod integration, and the launcher.

    tfdist launch --workers 2 -- python launchers/examples/keras_functional.py --out=/tmp/mw.json
    horovodrun -np 2 -H localhost:2 --gloo \\
        python launchers/examples/keras_functional.py --strategy=horovod
    python launchers/examples/keras_functional.py --strategy=single --out=/tmp/single.json

All runs see the same global batches, so they print the same losses. --out writes the per-epoch
losses and the final weights' checksum as JSON.
"""
import json
import sys

from absl import app, flags, logging

_STRATEGY = flags.DEFINE_string("strategy", "multi_worker_mirrored", "A tfdist strategy name.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Epochs of 10 steps.")
_BATCH = flags.DEFINE_integer("global_batch", 32, "Global batch, split across all replicas.")
_OUT = flags.DEFINE_string("out", None, "Write losses and a weight checksum here (JSON).")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist.strategies

    strategy = tfdist.strategies.get(_STRATEGY.value)  # reads TF_CONFIG for multi_worker_mirrored
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 16)).astype("float32")
    y = (np.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3]).astype("float32")

    def dataset_fn(ctx):  # this input pipeline's rows of every global batch
        rows = _BATCH.value // ctx.num_input_pipelines
        first = ctx.input_pipeline_id * rows
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(_BATCH.value, drop_remainder=True)
        return ds.map(lambda a, b: (a[first:first + rows], b[first:first + rows])).repeat()

    # The distribution-specific lines: scope, wrap_optimizer, distribute and callbacks.
    with strategy.scope():
        inputs = keras.Input((16,))
        h = keras.layers.Dense(64, activation="relu")(inputs)
        h = keras.layers.Concatenate()([h, inputs])
        outputs = keras.layers.Dense(1)(h)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=strategy.wrap_optimizer(keras.optimizers.Adam(1e-2)), loss="mse")

    history = model.fit(strategy.distribute(dataset_fn), epochs=_EPOCHS.value, steps_per_epoch=10,
                        callbacks=strategy.callbacks(), verbose=2 if strategy.is_chief else 0)
    weights = [np.asarray(w) for w in model.weights]
    result = {"strategy": strategy.describe(), "worker": strategy.worker_index,
              "loss": [float(v) for v in history.history["loss"]],
              "checksum": float(sum(np.abs(w).sum() for w in weights))}
    print("RESULT " + json.dumps(result), flush=True)
    if _OUT.value:
        path = _OUT.value if strategy.is_chief else f"{_OUT.value}.worker{strategy.worker_index}"
        with open(path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    app.run(main, sys.argv)
