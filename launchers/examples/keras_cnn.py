"""A user's own Keras program, unchanged under every tfdist strategy: only the strategy's name
differs. No `wrap_optimizer`, no `distribute()`, no `serve()`, no manual sharding: `compile`
inside `strategy.scope()` hands the model to tfdist, which all-reduces the gradients, splits the
plain datasets, runs the parameter server's coordinator and lets only the chief write files.

Three models (`--models`): a Sequential CNN with BatchNormalization and Dropout, a functional
model with 2 inputs and 2 outputs (two losses, metrics per output), and a subclassed model. Each
trains with `fit` (validation data and the standard Keras callbacks), then runs `evaluate`,
`predict` and `save`, and reloads the saved file on a single device.

    python launchers/examples/keras_cnn.py --strategy=single
    python launchers/examples/keras_cnn.py --strategy=mirrored --devices=2
    tfdist launch --workers 2 -- \\
        python launchers/examples/keras_cnn.py --strategy=multi_worker_mirrored
    tfdist launch --strategy=horovod --workers 2 -- \\
        python launchers/examples/keras_cnn.py --strategy=horovod
    tfdist launch --strategy=horovod --workers 2 -- \\
        python launchers/examples/keras_cnn.py --strategy=horovod --zero=3
    tfdist launch --strategy=parameter_server --workers 2 --ps 1 -- \\
        python launchers/examples/keras_cnn.py --strategy=parameter_server

Every process prints one `RESULT {json}` line per model (losses, evaluation, predictions'
checksum, the rows this process trained on in the last epoch, ...). Relative paths (`--out`) are
where the chief writes checkpoints, TensorBoard logs, the CSV log and the saved models.
"""
import hashlib
import json
import os
import sys

from absl import app, flags, logging

_STRATEGY = flags.DEFINE_string("strategy", "single", "A tfdist strategy name.")
_DEVICES = flags.DEFINE_integer("devices", 0, "Replicas of `mirrored` (on CPU: logical devices).")
_ZERO = flags.DEFINE_integer("zero", 0, "3: each weight stored on one replica only (ZeRO-3; "
                             "horovod, multi_worker_mirrored).")
_MEMORY_GB = flags.DEFINE_float("memory_gb", 0.0, "--strategy=auto: GiB a process may hold "
                                 "(0: this host's share); auto picks ZeRO-3 or offload to fit.")
_MODELS = flags.DEFINE_list("models", ["cnn"], "Any of cnn, functional, subclassed.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Epochs of 8 steps of 64 rows (the global batch).")
_MIN_DELTA = flags.DEFINE_float("min_delta", 0.0, "EarlyStopping's and ReduceLROnPlateau's "
                                "min_delta (huge: both act after the second epoch).")
_OUT = flags.DEFINE_string("out", "keras_cnn_out", "Directory the chief writes to.")

BATCH, STEPS = 64, 8


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist.parallel.zero
    import tfdist.strategies

    budget = {"memory_gb": _MEMORY_GB.value} if _MEMORY_GB.value else {}  # (strategy auto's)
    devices = {"devices": _DEVICES.value} if _STRATEGY.value != "auto" else {}
    strategy = tfdist.strategies.get(_STRATEGY.value, zero=_ZERO.value, **devices, **budget)

    @keras.saving.register_keras_serializable("tfdist_example")
    class Rows(keras.metrics.Metric):
        """How many rows this process has trained on (not averaged over processes)."""

        def __init__(self, name="rows", **kwargs):
            super().__init__(name=name, **kwargs)
            self.count = self.add_variable((), "zeros", name="count")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.count.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

        def result(self):
            return self.count

    @keras.saving.register_keras_serializable("tfdist_example")
    class Subclassed(keras.Model):
        def __init__(self, units=32, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.hidden = keras.layers.Dense(units, activation="tanh")
            self.out = keras.layers.Dense(10)

        def call(self, x):
            return self.out(self.hidden(keras.ops.reshape(x, (-1, 64))))

        def get_config(self):
            return {**super().get_config(), "units": self.units}

    class SaveAtEpochEnd(keras.callbacks.Callback):
        """A user's own callback that saves the model (tfdist: the chief writes)."""

        def __init__(self, path):
            super().__init__()
            self.path = path

        def on_epoch_end(self, epoch, logs=None):
            self.model.save(self.path)

    class TrainRows(keras.callbacks.Callback):
        """The `rows` metric after each training batch (validation resets it)."""

        def on_train_batch_end(self, batch, logs=None):
            variable = next(v for v in self.model.metrics_variables
                            if v.path.endswith("rows/count"))
            self.rows = float(variable.numpy())

    def cnn():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, padding="same"),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy", Rows()])
        return model

    def functional():
        image, extra = keras.Input((8, 8, 1), name="image"), keras.Input((4,), name="extra")
        h = keras.layers.Concatenate()([keras.layers.Flatten()(image), extra])
        h = keras.layers.Dense(32, activation="tanh")(h)
        model = keras.Model({"image": image, "extra": extra},
                            {"digit": keras.layers.Dense(10, name="digit")(h),
                             "size": keras.layers.Dense(1, name="size")(h)})
        model.compile(optimizer="sgd",  # a string: tfdist adapts the optimizer Keras makes of it
                      loss={"digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            "size": "mse"},
                      loss_weights={"digit": 1.0, "size": 0.5},
                      metrics={"digit": ["accuracy", Rows()], "size": ["mae"]})
        return model

    def subclassed():
        model = Subclassed()
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[Rows()])
        return model

    def data(model_name, rows, seed):
        rng = np.random.default_rng(seed)
        images = rng.normal(size=(rows, 8, 8, 1)).astype("float32")
        digits = (np.abs(images[:, :4, :4, 0].sum((1, 2))) * 2).astype("int64") % 10
        if model_name == "functional":
            extra = rng.normal(size=(rows, 4)).astype("float32")
            return ({"image": images, "extra": extra},
                    {"digit": digits, "size": images.mean((1, 2, 3))[:, None] + extra[:, :1]})
        return images, digits

    out = _OUT.value
    for name in _MODELS.value:
        keras.utils.set_random_seed(0)  # the same initial weights in every process
        with strategy.scope():
            model = {"cnn": cnn, "functional": functional, "subclassed": subclassed}[name]()
        x, y = data(name, BATCH * STEPS, seed=1)
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(
            BATCH, drop_remainder=True).repeat()
        val = tf.data.Dataset.from_tensor_slices(data(name, 2 * BATCH, seed=2)).batch(
            BATCH, drop_remainder=True)
        test_x, _ = data(name, 2 * BATCH, seed=3)
        test = tf.data.Dataset.from_tensor_slices(test_x).batch(BATCH, drop_remainder=True)
        callbacks = [
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=0,
                                          min_delta=_MIN_DELTA.value),
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0,
                                              min_delta=_MIN_DELTA.value),
            keras.callbacks.ModelCheckpoint(os.path.join(out, name, "epoch{epoch}.keras")),
            keras.callbacks.BackupAndRestore(os.path.join(out, name, "backup")),
            keras.callbacks.CSVLogger(os.path.join(out, name, "log.csv")),
            keras.callbacks.TensorBoard(os.path.join(out, name, "tensorboard")),
            SaveAtEpochEnd(os.path.join(out, name, "callback.keras")),
            TrainRows(),
        ]
        history = model.fit(train, epochs=_EPOCHS.value, steps_per_epoch=STEPS,
                            validation_data=val, callbacks=callbacks, verbose=2)
        evaluation = model.evaluate(val, return_dict=True, verbose=0)
        predicted = model.predict(test, verbose=0)
        path = os.path.join(out, name, "model.keras")
        model.save(path)
        result = {"model": name, "strategy": strategy.describe(), "chief": strategy.is_chief,
                  "worker": strategy.worker_index,
                  "rows_last_epoch": getattr(callbacks[-1], "rows", None),
                  "loss": history.history["loss"], "val_loss": history.history["val_loss"],
                  "epochs_run": len(history.history["loss"]), "evaluate": evaluation,
                  "history_keys": sorted(history.history),
                  "learning_rate": float(np.asarray(model.optimizer.learning_rate)),
                  "weights_sharded": tfdist.parallel.zero.of(model) is not None,  # (--zero=3)
                  "predict_sum": float(sum(np.abs(p).sum() for p in tf.nest.flatten(predicted))),
                  "weights_sha256": hashlib.sha256(b"".join(
                      np.asarray(w).tobytes() for w in model.weights)).hexdigest()}
        if strategy.is_chief:  # the saved file, reloaded on one device, predicts the same
            reloaded = keras.models.load_model(path)
            again = reloaded.predict(test_x, batch_size=BATCH, verbose=0)
            result["reload_max_diff"] = float(max(
                np.abs(a - b).max() for a, b in zip(tf.nest.flatten(predicted),
                                                    tf.nest.flatten(again))))
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main, sys.argv)
