"""A user's keras-hub GPT-2 causal LM (tied input and output embedding) under a tfdist strategy,
with its weights sharded (`--zero=3`): `fit` with Keras's `BackupAndRestore`, `model.save` in the
middle of training, the saved file reloaded by plain Keras, and reloaded under the strategy to
train on. `--model=shared` trains a small functional model that calls one layer twice instead.

    python launchers/examples/keras_hub_gpt2.py --strategy=single
    tfdist launch --strategy=horovod --workers 2 -- \\
        python launchers/examples/keras_hub_gpt2.py --strategy=horovod --zero=3
    tfdist launch --workers 2 -- \\
        python launchers/examples/keras_hub_gpt2.py --strategy=multi_worker_mirrored --zero=3
    tfdist launch --strategy=horovod --workers 2 -- python launchers/examples/keras_hub_gpt2.py \\
        --strategy=horovod --zero=3 --offload=disk --offload_dir=/tmp/offload

keras-hub is an extra: `make test` installs it beside tfdist's pins with `pip install --no-deps
keras-hub regex` (its metadata asks for tensorflow-text, whose wheel needs the full `tensorflow`
package; only keras-hub's tokenizers use it).

The run: `--epochs` epochs of 8 steps of 16 sequences; at the end of epoch `--save_at`, the model
is saved (`<out>/saved.keras`). After `fit`, the chief reloads that file with
`keras.models.load_model` alone (its warnings and optimizer variables: `<out>/reloaded.npz`), and
every process loads it under the strategy and trains the remaining epochs: the continued run.
Every process prints `RESULT {json}`: the per-epoch losses of `fit` (from the restored epoch on,
after a restart), the continued run's, and the largest difference between the two runs' final
weights. `--kill_at=S` ends worker `--kill_worker` at global step S (once: `--marker`), for a
restart to resume from the backup (`--backup`).
"""
import json
import os
import sys
import warnings

from absl import app, flags, logging

_STRATEGY = flags.DEFINE_string("strategy", "single", "A tfdist strategy name.")
_ZERO = flags.DEFINE_integer("zero", 0, "3: each weight stored on one process only (ZeRO-3).")
_OFFLOAD = flags.DEFINE_enum("offload", "none", ["none", "host", "disk"],
                             "With --zero=3: where each process keeps its master weights and "
                             "optimizer state (ZeRO-Offload).")
_OFFLOAD_DIR = flags.DEFINE_string("offload_dir", "", "--offload=disk: the directory of its "
                                   "files (default: the system's temporary directory).")
_MEMORY_GB = flags.DEFINE_float("memory_gb", 0.0, "--strategy=auto: GiB a process may hold "
                                 "(0: this host's share); auto picks ZeRO-3 or offload to fit.")
_MODEL = flags.DEFINE_enum("model", "gpt2", ["gpt2", "shared"], "What to train.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Epochs of 8 steps.")
_SAVE_AT = flags.DEFINE_integer("save_at", 2, "The epoch after which the model is saved (0: not "
                                "saved; keras-hub's causal LM does not restore its optimizer from "
                                "a file even on one device: its compile() is its own).")
_OUT = flags.DEFINE_string("out", "keras_hub_gpt2_out", "Where the chief writes.")
_BACKUP = flags.DEFINE_string("backup", "", "BackupAndRestore's directory (none: no backup).")
_BACKUP_FREQ = flags.DEFINE_string("backup_freq", "epoch", "BackupAndRestore's save_freq: "
                                   "'epoch' or a number of batches.")
_KILL_AT = flags.DEFINE_integer("kill_at", 0, "Global step at which to end a worker (0: never).")
_KILL_WORKER = flags.DEFINE_integer("kill_worker", 1, "The worker --kill_at ends.")
_MARKER = flags.DEFINE_string("marker", "", "A file written at the kill: a restart runs on.")

BATCH, STEPS, SEQ, VOCAB = 16, 8, 32, 256


def build(name):
    import keras
    if name == "gpt2":
        import keras_hub
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=64,
            intermediate_dim=256, max_sequence_length=64, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    else:
        tokens = keras.Input((SEQ,), dtype="int32", name="token_ids")
        h = keras.layers.Embedding(VOCAB, 32)(tokens)
        shared = keras.layers.Dense(32, activation="tanh", name="shared")
        h = shared(shared(h))  # one layer, called twice
        model = keras.Model(tokens, keras.layers.Dense(VOCAB)(h))
    model.compile(optimizer=keras.optimizers.AdamW(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(name):
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(1)
    start = rng.integers(0, VOCAB, size=(BATCH * STEPS, 1))
    t = ((start + np.arange(SEQ + 1) * rng.integers(1, 4, size=(BATCH * STEPS, 1))) % VOCAB)
    t = np.where(rng.random(t.shape) < 0.2, rng.integers(0, VOCAB, size=t.shape), t)
    x = t[:, :-1].astype("int32")
    if name == "gpt2":
        x = {"token_ids": x, "padding_mask": np.ones_like(x, bool)}
    return tf.data.Dataset.from_tensor_slices((x, t[:, 1:].astype("int32"))).batch(
        BATCH, drop_remainder=True).repeat()


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import keras
    import numpy as np

    import tfdist.strategies

    budget = {"memory_gb": _MEMORY_GB.value} if _MEMORY_GB.value else {}  # (strategy auto's)
    strategy = tfdist.strategies.get(_STRATEGY.value, zero=_ZERO.value, offload=_OFFLOAD.value,
                                     offload_dir=_OFFLOAD_DIR.value, **budget)
    out, name = _OUT.value, _MODEL.value
    saved = os.path.join(out, "saved.keras")
    os.makedirs(out, exist_ok=True)

    class SaveAt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch + 1 == _SAVE_AT.value:
                self.model.save(saved)  # (tfdist: the chief writes)

    class KillAt(keras.callbacks.Callback):
        step = 0

        def on_train_batch_end(self, batch, logs=None):
            self.step = self.model.optimizer.iterations.numpy()
            if (self.step == _KILL_AT.value and strategy.worker_index == _KILL_WORKER.value
                    and not os.path.exists(_MARKER.value)):
                open(_MARKER.value, "w").close()
                print(f"killing worker {strategy.worker_index} at step {self.step}", flush=True)
                os._exit(3)

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build(name)
    callbacks = [SaveAt(), KillAt()]
    if _BACKUP.value:
        freq = _BACKUP_FREQ.value
        callbacks.append(keras.callbacks.BackupAndRestore(
            _BACKUP.value, save_freq=freq if freq == "epoch" else int(freq)))
    history = model.fit(data(name), epochs=_EPOCHS.value, steps_per_epoch=STEPS,
                        callbacks=callbacks, verbose=2)
    result = {"model": name, "worker": strategy.worker_index, "chief": strategy.is_chief,
              "loss": history.history["loss"], "epochs": history.epoch}
    if not _SAVE_AT.value:
        print("RESULT " + json.dumps(result), flush=True)
        return
    if strategy.is_chief:  # the file, as plain Keras reads it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reloaded = keras.models.load_model(saved)
        result["reload_warnings"] = [str(w.message) for w in caught]
        np.savez(os.path.join(out, "reloaded.npz"),
                 **{v.path: v.numpy() for v in reloaded.optimizer.variables})
    with strategy.scope():
        again = keras.models.load_model(saved)
    continued = again.fit(data(name), initial_epoch=_SAVE_AT.value, epochs=_EPOCHS.value,
                          steps_per_epoch=STEPS, verbose=2)
    result["continued_loss"] = continued.history["loss"]
    result["continued_max_diff"] = float(max(
        np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(model.weights, again.weights)))
    if strategy.is_chief:
        np.savez(os.path.join(out, "weights.npz"), *[np.asarray(w) for w in model.weights])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main, sys.argv)
