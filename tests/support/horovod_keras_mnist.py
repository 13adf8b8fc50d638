r"""A Horovod Keras MNIST program in the form of Horovod's examples/tensorflow2/
tensorflow2_keras_mnist.py, on Keras 3. Its import line alone decides which Horovod Keras API
runs (tests/test_horovod_keras.py swaps it): `tfdist.horovod.keras` or Horovod's own.

    horovodrun -np 2 -H localhost:2 --gloo \
        python tests/support/horovod_keras_mnist.py mnist.npz OUTDIR

The images come from a local .npz (x_train, y_train) instead of the download. Each rank shuffles
its own stream, as in Horovod's example. The last line of each rank is `RESULT {json}`: the
epoch losses and a digest of the final weights.
"""
import hashlib
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist.horovod.keras as hvd  # the Horovod Keras API


def train(npz, out, epochs=4):
    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # ranks start apart: the broadcast must align them

    with np.load(npz) as f:
        images, labels = f["x_train"], f["y_train"]
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(labels, tf.int64)))
    dataset = dataset.repeat().shuffle(1000, seed=hvd.rank()).batch(32)

    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(8, [3, 3], activation="relu"),
        keras.layers.Conv2D(16, [3, 3], activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Dropout(0.25),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(10, activation="softmax"),
    ])

    # Horovod: scale the learning rate by the number of ranks, and wrap the optimizer.
    scaled_lr = 0.001 * hvd.size()
    opt = keras.optimizers.Adam(scaled_lr)
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    ]
    # Horovod: checkpoints on rank 0 only.
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(out, "checkpoint-{epoch}.keras")))

    history = model.fit(dataset, steps_per_epoch=60 // hvd.size(), callbacks=callbacks,
                        epochs=epochs, verbose=1 if hvd.rank() == 0 else 0)
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights()))
    print("RESULT " + json.dumps({"rank": hvd.rank(), "loss": history.history["loss"],
                                  "lr": history.history["lr"], "weights": digest.hexdigest()}),
          flush=True)


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2])
