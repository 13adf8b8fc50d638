"""Keras's model-parallel API on TensorFlow (`tfdist.parallel.mesh`): keras-hub's Llama sharded by
`LlamaBackbone.get_layout_map` on a (1, 2) mesh, against one device and against ZeRO-3 on 2
replicas.

    python tools/bench/mesh.py --rounds=2   # make bench-mesh; writes bench_results/mesh.json

The model: keras-hub's LlamaCausalLM, random weights, --layers blocks of width --width (GQA: 8
query heads over 4 key/value heads), vocabulary 8192, --batch sequences of --seq tokens a step,
AdamW. Variants, each its own process(es), in turn for --rounds rounds:

* `one device`: the model on one process without a distribution (tfdist's `single` strategy);
* `mesh (1, 2), 1 process`: a (1, 2) mesh over 2 logical CPU devices of one process;
* `mesh (1, 2), 2 processes`: the same mesh over 2 processes of one device each (`tfdist launch
  --workers 2`): its collectives cross the loopback interface, where they are counted;
* `ZeRO-3, 2 replicas`: the model under `tfdist.strategies.get("horovod", zero=3)` on 2 Horovod
  ranks (`tfdist launch --strategy=horovod`), each half of the same global batch;
* `mesh (1, 2), Megatron's map, 2 processes`: the 2-process mesh with Megatron-LM's layout of the
  same model (`megatron_map`) instead of keras-hub's.

Per variant: the median step time (a callback's wall time per batch, after --warmup steps), its
ratio to one device's of the same round, each process's peak RSS (VmHWM), and the bytes a
process sends per step (loopback's transmitted bytes over the timed steps, both processes'
traffic, halved; TCP and gRPC headers included). Beside the mesh's bytes: the Megatron count, two
all-reduces of the activations per block in the forward pass (and two in the backward): an
all-reduce of n bytes over 2 devices sends n per device in a ring, so 4 x blocks x (batch x seq x
width x 4 bytes) a step. keras-hub's map is not Megatron's (it shards q/k/v by their input rows
and every kernel over the batch axis too), so the measured figure is said against that count,
not expected to equal it.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.bench import common  # noqa: E402  (--steps, --rounds, --warmup, --out)
from tools.bench.loopback import loopback_tx  # noqa: E402

_WIDTH = flags.DEFINE_integer("width", 512, "The model's width (hidden_dim).")
_LAYERS = flags.DEFINE_integer("layers", 4, "Transformer blocks.")
_SEQ = flags.DEFINE_integer("seq", 128, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step (global).")
_STEPS, _WARMUP, _ROUNDS = common.STEPS, common.WARMUP, common.ROUNDS
_WORKER = flags.DEFINE_string("worker", "", "internal: one variant's process (one, mesh, zero3).")

VOCAB = 8192
VARIANTS = {  # name -> (worker kind, launcher flags or None: one process)
    "one device": ("one", None),
    "mesh (1, 2), 1 process": ("mesh", None),
    "mesh (1, 2), 2 processes": ("mesh", ["--workers=2"]),
    "ZeRO-3, 2 replicas": ("zero3", ["--strategy=horovod", "--workers=2"]),
    "mesh (1, 2), Megatron's map, 2 processes": ("megatron", ["--workers=2"]),
}


def megatron_map(device_mesh):
    """Megatron-LM's layout of keras-hub's Llama (the bench's own, beside keras-hub's map):
    q/k/v and the MLP's gate and up kernels by heads or columns, the attention's and the MLP's
    output kernels by rows, embeddings whole: two all-reduces a block each way."""
    import keras
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map["transformer_layer.*self_attention.*(query|key|value).kernel"] = (None, "model",
                                                                                None)
    layout_map["transformer_layer.*attention_output.kernel"] = ("model", None, None)
    layout_map["transformer_layer.*feedforward_(intermediate|gate)_dense.kernel"] = (None, "model")
    layout_map["transformer_layer.*feedforward_output_dense.kernel"] = ("model", None)
    return layout_map


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(kind):
    """One process of a variant: trains, prints one JSON line."""
    import numpy as np
    workers = (len(json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
                   .get("worker", [])) or int(os.environ.get("HOROVOD_SIZE", 0)))
    on_mesh = kind in ("mesh", "megatron")
    if on_mesh:
        from tfdist.parallel import mesh
        mesh.enable(cpu_devices=2 // max(workers, 1))
    import keras
    import keras_hub
    if on_mesh:
        device_mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"),
                                                    keras.distribution.list_devices())
        layout_map = (megatron_map(device_mesh) if kind == "megatron" else
                      keras_hub.models.LlamaBackbone.get_layout_map(device_mesh))
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"))
    import tfdist.strategies
    strategy = (tfdist.strategies.get("horovod", zero=3) if kind == "zero3"
                else tfdist.strategies.get("single") if kind == "one" else None)
    rank = int(os.environ.get("DTENSOR_CLIENT_ID") or os.environ.get("HOROVOD_RANK") or 0)
    steps = _WARMUP.value + _STEPS.value
    tokens = np.random.default_rng(0).integers(0, VOCAB, (_BATCH.value * steps, _SEQ.value + 1))
    x = {"token_ids": tokens[:, :-1].astype("int32"),
         "padding_mask": np.ones((len(tokens), _SEQ.value), "int32")}
    y = tokens[:, 1:].astype("int32")
    import tensorflow as tf
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(_BATCH.value, drop_remainder=True)

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.tx = [], None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == _WARMUP.value:
                self.tx = loopback_tx()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # (the step's result is here)
            if batch >= _WARMUP.value:
                self.times.append(time.perf_counter() - self.start)

    def build_and_fit():
        keras.utils.set_random_seed(1)
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCAB, num_layers=_LAYERS.value, num_query_heads=8,
            num_key_value_heads=4, hidden_dim=_WIDTH.value, intermediate_dim=_WIDTH.value * 11 // 4,
            max_sequence_length=_SEQ.value)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        clock = Clock()
        model.fit(data, epochs=1, verbose=0, callbacks=[clock])
        return model, clock

    if strategy is not None:
        with strategy.scope():
            model, clock = build_and_fit()
    else:
        model, clock = build_and_fit()
    sent = (loopback_tx() - clock.tx) / 2 / _STEPS.value if workers else 0.0
    print("RESULT " + json.dumps({"rank": rank, "step_s": statistics.median(clock.times),
                                  "peak_rss_bytes": peak_rss(), "sent_per_step": sent,
                                  "parameters": int(model.count_params())}), flush=True)


def run_variant(name):
    kind, launch = VARIANTS[name]
    argv = [sys.executable, os.path.abspath(__file__), f"--worker={kind}",
            *(f"--{f.name}={f.value}" for f in (_WIDTH, _LAYERS, _SEQ, _BATCH, _STEPS, _WARMUP))]
    if launch:
        argv = [sys.executable, "-m", "tfdist", "launch", *launch, "--max_restarts=0",
                "--"] + argv
    p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in p.stdout.splitlines()
               if "RESULT " in line]
    if p.returncode or not results:
        raise SystemExit(f"{name} failed ({p.returncode}):\n{p.stdout[-2000:]}\n"
                         f"{p.stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"])


def main(argv):
    del argv
    if _WORKER.value:
        return worker(_WORKER.value)
    runs = {name: [] for name in VARIANTS}
    for r in range(_ROUNDS.value):
        for name in VARIANTS:
            runs[name].append(run_variant(name))
            print(f"round {r + 1}: {name}: {runs[name][-1][0]['step_s']:.3f} s/step", flush=True)
    activation = _BATCH.value * _SEQ.value * _WIDTH.value * 4
    megatron = 4 * _LAYERS.value * activation  # 2 all-reduces a block, forward and backward
    rows = []
    for name, rounds in runs.items():
        ratios = [rs[0]["step_s"] / one[0]["step_s"] for rs, one in zip(rounds,
                                                                          runs["one device"])]
        sent = statistics.median(max(x["sent_per_step"] for x in rs) for rs in rounds)
        rows.append({"variant": name, "processes": len(rounds[0]),
                     "step_s": statistics.median(rs[0]["step_s"] for rs in rounds),
                     "ratio_to_one_device": statistics.median(ratios),
                     "peak_rss_mib": [round(x["peak_rss_bytes"] / 2**20) for x in rounds[-1]],
                     "sent_mb_per_step": sent / 1e6,
                     "sent_to_megatron": sent / megatron if name.startswith("mesh") and sent
                     else None})
    print(f"\nkeras-hub Llama, {runs['one device'][0][0]['parameters'] / 1e6:.1f} M parameters, "
          f"{_LAYERS.value} blocks of {_WIDTH.value}, {_BATCH.value} x {_SEQ.value} tokens a "
          f"step; Megatron count {megatron / 1e6:.2f} MB a step")
    print(f"{'variant':<42} {'s/step':>7} {'x one':>6} {'peak RSS MiB':>16} {'MB sent':>8} "
          f"{'x Megatron':>10}")
    for r in rows:
        mega = f"{r['sent_to_megatron']:.2f}" if r["sent_to_megatron"] else "-"
        print(f"{r['variant']:<42} {r['step_s']:7.3f} {r['ratio_to_one_device']:6.2f} "
              f"{str(r['peak_rss_mib']):>16} {r['sent_mb_per_step']:8.2f} {mega:>10}")
    result = {"model": {"layers": _LAYERS.value, "width": _WIDTH.value, "seq": _SEQ.value,
                        "batch": _BATCH.value, "vocab": VOCAB,
                        "parameters": runs["one device"][0][0]["parameters"]},
              "megatron_bytes_per_step": megatron, "rows": rows, "runs": runs,
              "date": time.strftime("%Y-%m-%d")}
    common.write_json(result, os.path.join(ROOT, "bench_results", "mesh.json"))


if __name__ == "__main__":
    app.run(main)
