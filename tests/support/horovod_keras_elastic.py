"""A Horovod elastic Keras program in the form of Horovod's docs/elastic.rst ("Elastic Keras"), on
Keras 3 and with a small model. Its import line alone decides which Horovod Keras API runs
(tests/test_horovod_keras_elastic.py swaps it).

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script D --network-interface lo \\
        --blacklist-cooldown-range 1 2 python tests/support/horovod_keras_elastic.py

Each epoch's end prints `EPOCH {json}` (epoch, size, loss) and the end `RESULT {json}` (the
epochs, the size, a digest of the final weights), with the rank's own prefix from horovodrun.
BATCH_SLEEP (seconds, default 0.1) slows each batch, so a test can act within an epoch; EPOCHS
(default 10) sets the length.
"""
import hashlib
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist.horovod.keras as hvd  # the Horovod Keras API

hvd.init()

EPOCHS = int(os.environ.get("EPOCHS", 10))
STEPS, BATCH = 24, 16  # steps of an epoch at size 1
SLEEP = float(os.environ.get("BATCH_SLEEP", 0.1))

rng = np.random.default_rng(0)  # the same data on every rank: y = x w + 0.5 (+ noise)
x = rng.normal(size=(4096, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.5 + 0.01 * rng.normal(size=(4096, 1))).astype("float32")


def dataset():  # this rank's shard: rank and size may change at every reset
    return tf.data.Dataset.from_tensor_slices((x[hvd.rank()::hvd.size()],
                                               y[hvd.rank()::hvd.size()])).repeat().batch(BATCH)


keras.utils.set_random_seed(1234)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(1)])
lr = 0.01
# Horovod: scale the learning rate by the number of workers, wrap the optimizer.
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=lr * hvd.size(), momentum=0.9))
model.compile(optimizer=opt, loss="mse")


def on_state_reset():  # Horovod: the learning rate follows the new number of workers
    model.optimizer.learning_rate.assign(lr * hvd.size())


state = hvd.elastic.KerasState(model, batch=0, epoch=0)
state.register_reset_callbacks([on_state_reset])


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(SLEEP)

    def on_epoch_end(self, epoch, logs=None):
        print("EPOCH " + json.dumps({"epoch": state.epoch, "size": hvd.size(),
                                     "loss": float(logs["loss"])}), flush=True)


callbacks = [hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.UpdateEpochStateCallback(state), Report()]


@hvd.elastic.run
def train(state):
    model.fit(dataset(), steps_per_epoch=STEPS // hvd.size(), epochs=EPOCHS - state.epoch,
              callbacks=callbacks, verbose=0)


train(state)
digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()
print("RESULT " + json.dumps({"epochs": state.epoch, "size": hvd.size(), "weights": digest[:16]}),
      flush=True)
