"""A user's own Keras program on Ray, written the way Ray Train's docs write one
(a trainer with a `train_loop_per_worker`), the same under every strategy: the loop takes its
strategy from tfdist (`tfdist.strategies.get(...)`), and the trainer too
(`tfdist.launch.ray_train.trainer(strategy, ...)`, Ray Train V2's `DataParallelTrainer` with the
backend the strategy's plugin names). Those are the two tfdist lines; no line compares a
strategy's name.

* `multi_worker_mirrored`: each worker gets a `TF_CONFIG` of worker tasks only, which is what it
  reads (worker 0 is the chief); `zero=3` stores each weight on one worker.
* `horovod`: Ray Train V2 has no Horovod trainer, so the workers meet through tfdist's backend
  (`tfdist.launch.ray_horovod.HorovodGlooConfig`): Horovod's Gloo rendezvous, as `horovodrun`
  starts it.
* Keras's `BackupAndRestore` writes to a directory every node sees. When a worker dies, Ray
  (`FailureConfig(max_failures=...)`) starts the group again and the backup resumes it at the
  epoch after the last one backed up.

    python launchers/ray/keras_on_ray.py --workers=2 --strategy=multi_worker_mirrored
    python launchers/ray/keras_on_ray.py --workers=2 --strategy=multi_worker_mirrored --zero=3
    python launchers/ray/keras_on_ray.py --workers=2 --strategy=horovod
    python launchers/ray/keras_on_ray.py --address=HEAD:6379 --workers=4 ...   # a Ray cluster
    python launchers/ray/keras_on_ray.py --no_ray --strategy=single  # the same loop, no Ray

Rank 0 writes each epoch's loss to `--out` (a JSON list, rewritten at every epoch end, so a run
restarted from its backup keeps the epochs it does not run again; a path every node sees: Train
V2's `fit().metrics` is None when the workers report metrics without a checkpoint), and the
epochs it ran, across restarts, to `<out>.epochs`.
`--fail_once_after_epoch=N`: worker 1 exits at the end of epoch N (after its backup) in the
first attempt only, as a lost worker would. `--no_backup` leaves BackupAndRestore out.
"""
import argparse
import json
import os

BATCH, STEPS, EPOCHS = 64, 8, 3  # the global batch, steps per epoch


def train_loop_per_worker(config):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist.strategies
    strategy = tfdist.strategies.get(config["strategy"], zero=config["zero"])  # the tfdist line

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 32)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(32, 10)), axis=1)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="tanh"),
                                  keras.layers.Dense(64, activation="tanh"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rank = 0
    callbacks = [] if config["no_backup"] else [
        keras.callbacks.BackupAndRestore(config["backup_dir"])]
    if config["ray"]:
        import ray.train
        rank = ray.train.get_context().get_world_rank()
        callbacks.append(keras.callbacks.LambdaCallback(  # progress to Ray, every epoch
            on_epoch_end=lambda epoch, logs: ray.train.report({"epoch": epoch + 1, **logs})))
    callbacks.append(keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: record(config, rank, epoch, logs)))
    model.fit(data, epochs=EPOCHS, callbacks=callbacks, verbose=0)


def record(config, rank, epoch, logs):
    """Rank 0: this epoch's loss into --out. Then --fail_once_after_epoch's exit (worker 1)."""
    if rank == 0:
        losses = json.load(open(config["out"])) if os.path.exists(config["out"]) else []
        with open(config["out"], "w") as f:
            json.dump(losses[:epoch] + [float(logs["loss"])], f)
        with open(config["out"] + ".epochs", "a") as f:  # the epochs run, across restarts
            f.write(f"{epoch + 1}\n")
    failed = config["out"] + ".failed"
    if rank == 1 and epoch + 1 == config["fail_once_after_epoch"] and not os.path.exists(failed):
        open(failed, "w").close()
        print(f"keras_on_ray: worker 1 exits after epoch {epoch + 1}", flush=True)
        os._exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="multi_worker_mirrored")
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--address", default=None, help="a Ray cluster's HOST:PORT (default: a Ray "
                    "started here)")
    ap.add_argument("--out", default="keras_on_ray_losses.json")
    ap.add_argument("--fail_once_after_epoch", type=int, default=0)
    ap.add_argument("--no_ray", action="store_true", help="run the loop here, without Ray")
    ap.add_argument("--no_backup", action="store_true", help="leave BackupAndRestore out")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    config = {"strategy": args.strategy, "zero": args.zero, "ray": not args.no_ray, "out": out,
              "backup_dir": out + ".backup", "fail_once_after_epoch": args.fail_once_after_epoch,
              "no_backup": args.no_backup}
    if args.no_ray:
        train_loop_per_worker(config)
    else:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig

        from tfdist.launch.ray_train import trainer
        ray.init(address=args.address)
        trainer(args.strategy, train_loop_per_worker, train_loop_config=config,  # the tfdist line
                scaling_config=ScalingConfig(num_workers=args.workers),
                run_config=RunConfig(storage_path=os.path.dirname(out),
                                     failure_config=FailureConfig(max_failures=1))).fit()
    print("RESULT " + json.dumps({"losses": json.load(open(out)),
                                  "workers": 1 if args.no_ray else args.workers,
                                  "restarted": os.path.exists(out + ".failed"),
                                  "epochs_run": [int(e) for e in open(out + ".epochs")]}),
          flush=True)


if __name__ == "__main__":
    main()
