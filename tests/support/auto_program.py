"""A user's Keras program for `tfdist.strategies.get("auto")` (tests/test_auto_keras.py): a plain
CNN or keras-hub's GPT-2, each wide enough that its weights, gradients and Adam's slots outweigh
one step's activations (so that the budgets the tests give fall well between the layouts' needs),
trained for 2 epochs of 4 steps on fixed random data.

    python tests/support/auto_program.py --model=cnn --strategy=auto
    tfdist launch --workers 2 -- python tests/support/auto_program.py --model=gpt2 \\
        --strategy=auto --memory_gb=0.06

Prints `RESULT {"loss": [...], "worker": i}`.
"""
import json
import sys

from absl import app, flags, logging

_STRATEGY = flags.DEFINE_string("strategy", "auto", "A tfdist strategy name, or auto.")
_ZERO = flags.DEFINE_integer("zero", 0, "3: ZeRO-3 named by hand.")
_MEMORY_GB = flags.DEFINE_float("memory_gb", 0.0, "strategy auto's budget (GiB a process).")
_MODEL = flags.DEFINE_enum("model", "cnn", ["cnn", "gpt2"], "What to train.")

BATCH, STEPS, EPOCHS = 16, 4, 2


def build(name):
    import keras
    if name == "gpt2":
        import keras_hub
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=256, num_layers=2, num_heads=4, hidden_dim=256,
            intermediate_dim=1024, max_sequence_length=32, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    else:
        model = keras.Sequential([
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
            *[keras.layers.Dense(1024, activation="relu") for _ in range(4)],
            keras.layers.Dropout(0.1),
            keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(name):
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(1)
    n = BATCH * STEPS
    if name == "gpt2":
        t = rng.integers(0, 256, size=(n, 33)).astype("int32")
        x = {"token_ids": t[:, :-1], "padding_mask": np.ones((n, 32), bool)}
        y = t[:, 1:]
    else:
        x = rng.normal(size=(n, 16, 16, 3)).astype("float32")
        y = rng.integers(0, 10, size=(n,)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True).repeat()


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import keras

    import tfdist.strategies

    budget = {"memory_gb": _MEMORY_GB.value} if _MEMORY_GB.value else {}
    strategy = tfdist.strategies.get(_STRATEGY.value, zero=_ZERO.value, **budget)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build(_MODEL.value)
    history = model.fit(data(_MODEL.value), epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0)
    print("RESULT " + json.dumps({"loss": history.history["loss"],
                                  "worker": strategy.worker_index}), flush=True)


if __name__ == "__main__":
    app.run(main, sys.argv)
