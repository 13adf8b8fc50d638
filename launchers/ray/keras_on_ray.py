"""A user's own Keras program on Ray, written the way Ray Train's docs write one
(`TensorflowTrainer(train_loop_per_worker=...)`), whose loop takes its strategy from tfdist: the
one distribution-specific line is `tfdist.strategies.get(...)`. Ray gives each worker a
`TF_CONFIG` of worker tasks only, which is what `multi_worker_mirrored` reads (worker 0 is the
chief); `zero=3` stores each weight on one worker.

    python launchers/ray/keras_on_ray.py --workers=2 --strategy=multi_worker_mirrored
    python launchers/ray/keras_on_ray.py --workers=2 --strategy=multi_worker_mirrored --zero=3
    python launchers/ray/keras_on_ray.py --address=HEAD:6379 --workers=4 ...   # a Ray cluster
    python launchers/ray/keras_on_ray.py --no_ray --strategy=single  # the same loop, no Ray

Rank 0 writes the per-epoch losses to `--out` (a JSON list; a path every node sees: Train V2's
`fit().metrics` is None when the workers report metrics without a checkpoint).
"""
import argparse
import json

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
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="tanh"),
                                  keras.layers.Dense(64, activation="tanh"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = []
    if config["ray"]:
        import ray.train
        callbacks.append(keras.callbacks.LambdaCallback(  # progress to Ray, every epoch
            on_epoch_end=lambda epoch, logs: ray.train.report({"epoch": epoch + 1, **logs})))
    losses = model.fit(data, epochs=EPOCHS, callbacks=callbacks, verbose=0).history["loss"]
    rank = ray.train.get_context().get_world_rank() if config["ray"] else 0
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump([float(v) for v in losses], f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="multi_worker_mirrored")
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--address", default=None, help="a Ray cluster's HOST:PORT (default: a Ray "
                    "started here)")
    ap.add_argument("--out", default="keras_on_ray_losses.json")
    ap.add_argument("--no_ray", action="store_true", help="run the loop here, without Ray")
    args = ap.parse_args()
    import os
    config = {"strategy": args.strategy, "zero": args.zero, "ray": not args.no_ray,
              "out": os.path.abspath(args.out)}
    if args.no_ray:
        train_loop_per_worker(config)
    else:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.tensorflow import TensorflowTrainer
        ray.init(address=args.address)
        TensorflowTrainer(train_loop_per_worker, train_loop_config=config,
                          scaling_config=ScalingConfig(num_workers=args.workers),
                          run_config=RunConfig(storage_path=os.path.dirname(config["out"]))).fit()
    print("RESULT " + json.dumps({"losses": json.load(open(config["out"])),
                                  "workers": 1 if args.no_ray else args.workers}), flush=True)


if __name__ == "__main__":
    main()
