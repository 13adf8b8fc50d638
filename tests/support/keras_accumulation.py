"""A user's Keras program whose optimizer accumulates gradients with Keras's own
`gradient_accumulation_steps`, under a tfdist strategy: under `mirrored`, `multi_worker_mirrored`
and `parameter_server`, where Keras's cannot run (keras-team/keras#20582), tfdist's step does it.

    python tests/support/keras_accumulation.py STRATEGY K BATCH UPDATES OUT.npz [DEVICES]

Trains a small MLP on fixed rows, in order: UPDATES epochs of K batches of BATCH rows, so that an
update's rows are those of one batch of K x BATCH rows, and each epoch's logged loss is its
update's. The chief writes OUT.npz: the final weights (w0, w1, ...), the epochs' losses and the
optimizer's update count. (Under `tfdist launch` the strategy's processes come from TF_CONFIG.)
"""
import sys

import numpy as np


def main():
    name, k, batch, updates, out = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    devices = int(sys.argv[6]) if len(sys.argv) > 6 else None
    import keras
    import tensorflow as tf

    import tfdist.strategies
    strategy = tfdist.strategies.get(name, **({"devices": devices} if devices else {}))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(
            0.01, gradient_accumulation_steps=k if k > 1 else None), loss="mse")
    rows = np.random.default_rng(0).normal(size=(k * batch * updates, 8)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((rows, rows.sum(1, keepdims=True))).batch(batch)
    history = model.fit(data.repeat(), epochs=updates, steps_per_epoch=k, verbose=0,
                        shuffle=False)
    if strategy.is_chief:
        np.savez(out, *[w.numpy() for w in model.weights], losses=history.history["loss"],
                 updates=int(model.optimizer.iterations.numpy()))
    print("RESULT", name, strategy.num_replicas, history.history["loss"][-1], flush=True)


if __name__ == "__main__":
    main()
