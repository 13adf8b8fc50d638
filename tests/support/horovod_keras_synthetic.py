r"""A Horovod Keras synthetic benchmark in the form of Horovod's examples/tensorflow2/
tensorflow2_keras_synthetic_benchmark.py, on Keras 3 and with a small model. Its import line alone
decides which Horovod Keras API runs (tests/test_horovod_keras.py swaps it).

    horovodrun -np 2 -H localhost:2 --gloo \
        python tests/support/horovod_keras_synthetic.py --fp16-allreduce

Each rank's last line is `RESULT {json}`: the epoch losses, images/s, and a digest of the final
weights.
"""
import argparse
import hashlib
import json
from timeit import default_timer as timer

import keras
import numpy as np
import tensorflow as tf

import tfdist.horovod.keras as hvd  # the Horovod Keras API

parser = argparse.ArgumentParser(description="Keras synthetic benchmark")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--num-batches-per-iter", type=int, default=5)
parser.add_argument("--num-iters", type=int, default=4)
args = parser.parse_args()

hvd.init()
keras.utils.set_random_seed(hvd.rank())  # each rank its own data and initial weights

model = keras.Sequential([
    keras.Input((32, 32, 3)),
    keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
    keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
    keras.layers.GlobalAveragePooling2D(),
    keras.layers.Dense(100),
])
opt = keras.optimizers.SGD(0.05)

data = tf.random.uniform([args.batch_size, 32, 32, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=99, dtype=tf.int64)
dataset = tf.data.Dataset.from_tensor_slices((data, target)).cache().repeat().batch(args.batch_size)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
opt = hvd.DistributedOptimizer(opt, compression=compression)
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=opt)

callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd.callbacks.MetricAverageCallback()]


class TimingCallback(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.img_secs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = timer()

    def on_epoch_end(self, epoch, logs=None):
        img_sec = args.batch_size * args.num_batches_per_iter / (timer() - self.start)
        print(f"Iter #{epoch}: {img_sec:.1f} img/sec per CPU")
        if epoch > 0:  # the first includes tracing
            self.img_secs.append(img_sec)


timing = TimingCallback()
if hvd.rank() == 0:
    callbacks.append(timing)

history = model.fit(dataset, steps_per_epoch=args.num_batches_per_iter, callbacks=callbacks,
                    epochs=args.num_iters, verbose=0)
digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights()))
img_sec = float(np.mean(timing.img_secs)) if hvd.rank() == 0 else None
print("RESULT " + json.dumps({"rank": hvd.rank(), "loss": history.history["loss"],
                              "img_sec": img_sec, "weights": digest.hexdigest()}), flush=True)
