"""ZeRO stages 1-3, each without offload, with host and with disk offload, trained for a few steps
in one process per rank (horovodrun -np 2, or tfdist launch under multi_worker_mirrored): the
program of tests/test_offload.py's equality test. Each rank prints one `RESULT {json}` line:
{"<stage>-<kind>": {"loss": [per-step losses], "weights": sha256 of the whole weights,
"weights_diff": their largest difference from the same stage's without offload, ...}}.

    horovodrun -np 2 python tests/support/offload_probe.py --strategy=horovod --dir=/tmp/o
"""
import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="horovod")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist.strategies
    from tfdist import config
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer
    from tfdist.parallel import zero
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep

    strategy = tfdist.strategies.get(args.strategy)
    rank = strategy.worker_index
    t = config.default_config().train
    t.learning_rate, t.warmup_steps, t.steps = 1e-2, 2, args.steps
    rows = np.random.default_rng(rank).integers(0, 256, (4, 33)).astype("int32")
    data = tf.data.Dataset.from_tensors((rows[:, :-1], rows[:, 1:])).repeat()
    out = {}
    for stage in (int(s) for s in args.stages.split(",")):
        for kind in ("none", "host", "disk"):
            keras.utils.set_random_seed(7)
            offload = None
            if kind != "none":
                where = os.path.join(args.dir, f"{stage}-{kind}-rank-{rank}")
                offload = zero.offload.Offload(kind, where if kind == "disk" else None,
                                               subgroup=5000)
            with strategy.scope():
                model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
                model.build()
                model.compile(optimizer=make_optimizer(t, t.steps), loss=loss_fn())
                TrainStep(model, strategy, Layout(dp=2, zero=stage), clipnorm=1.0,
                          offload=offload).install()
            history = model.fit(data, epochs=args.steps, steps_per_epoch=1, verbose=0)
            whole = np.concatenate([w.ravel() for w in zero.of(model).full_values()])
            if kind == "none":
                resident = whole
            out[f"{stage}-{kind}"] = {"loss": history.history["loss"],
                                      "weights": hashlib.sha256(whole.tobytes()).hexdigest(),
                                      "weights_diff": float(np.max(np.abs(whole - resident))),
                                      "stored": offload.stored_bytes if offload else 0,
                                      "offloaded_dir_files": len(os.listdir(where))
                                      if kind == "disk" else 0}
            if offload is not None:
                offload.close()
    print("RESULT " + json.dumps({"rank": rank, **out}), flush=True)


if __name__ == "__main__":
    main()
