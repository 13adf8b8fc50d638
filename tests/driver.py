"""Test driver: runs `tfdist.train.train` in its own process, optionally dying on purpose.

    python tests/driver.py WORKDIR '{"train.steps": 20, ...}' [--kill-at-step K] [--kill-in-save N]

Config overrides are a JSON dict of dotted keys applied to configs/gpt_nano.py. It prints one
`DRIVER_RESULT {...}` JSON line at the end and appends one line per executed step to
WORKDIR/executed_steps.txt (so tests can count the steps that really ran across restarts).
--kill-at-step K: SIGKILL this process right after step K (after that step's backup, if any).
--kill-in-save N: SIGKILL inside the N-th backup save, after the checkpoint data files were
written but before the checkpoint index was updated.
"""
import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("overrides", nargs="?", default="{}")
    ap.add_argument("--config", default="gpt_nano")
    ap.add_argument("--kill-at-step", type=int, default=0)
    ap.add_argument("--kill-in-save", type=int, default=0)
    ap.add_argument("--skip-keras-fix", type=int, default=0,
                    help="1: keep Keras's _maybe_symbolic_build; 2: keep its reduce_per_replica")
    args = ap.parse_args()

    import importlib
    import keras
    import tensorflow as tf
    from tfdist import config as config_lib
    from tfdist.train import train

    if args.skip_keras_fix:  # show that each multi-worker correction is needed
        from keras.src.backend.tensorflow import trainer as tf_trainer
        from tfdist.strategies import keras_fixes
        originals = (tf_trainer.TensorFlowTrainer._maybe_symbolic_build, tf_trainer.reduce_per_replica)
        upstream_apply = keras_fixes.apply

        def partial_apply():
            upstream_apply()
            if args.skip_keras_fix == 1:
                tf_trainer.TensorFlowTrainer._maybe_symbolic_build = originals[0]
            else:
                tf_trainer.reduce_per_replica = originals[1]
        keras_fixes.apply = partial_apply

    c = importlib.import_module(args.config).get_config()
    for key, value in json.loads(args.overrides).items():
        section, _, name = key.rpartition(".")
        (c[section] if section else c)[name] = value
    config_lib.validate(c)
    os.makedirs(args.workdir, exist_ok=True)
    steps_file = open(os.path.join(args.workdir, "executed_steps.txt"), "a")

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.n = 0

        def on_train_batch_end(self, batch, logs=None):
            self.n += 1
            steps_file.write(f"{os.getpid()} {logs['loss']!r}\n")
            steps_file.flush()
            if args.kill_at_step and self._global_step() == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)

        def _global_step(self):
            return sum(1 for _ in open(steps_file.name))  # valid because each test uses a fresh dir

    if args.kill_in_save:
        original, count = tf.train.CheckpointManager.save, [0]

        def dying_save(self, checkpoint_number=None, **kw):
            count[0] += 1
            if count[0] == args.kill_in_save:
                self._checkpoint.write(os.path.join(self.directory, f"ckpt-{checkpoint_number}"))
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, checkpoint_number=checkpoint_number, **kw)

        tf.train.CheckpointManager.save = dying_save

    result = train(c, args.workdir, verbose=0, extra_callbacks=[Record()])
    print("DRIVER_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
