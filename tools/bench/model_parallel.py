"""Benchmarks of tfdist's model parallelism on this machine's logical CPU devices.

    python tools/bench/model_parallel.py --schedules   # 1F1B vs GPipe: peak memory at M = 4..32
    python tools/bench/model_parallel.py --tensor      # t = 2 tensor parallel vs the unsplit model
    python tools/bench/model_parallel.py --sequence    # activation bytes per shard, t = 2, with
                                                       # and without sequence parallelism

--schedules: gpt_mini (6 blocks, width 384, context 256) in K = 2 pipeline stages, microbatches of
--microbatch_size sequences, so that the batch is M of them and the activations GPipe keeps grow
with M. Each (schedule, M) runs in a fresh process: a training step (tfdist's training step in a
tf.function: `compute_gradients` and the update) traced and run once, then TF's CPU allocator's peak
over the next step (`tf.config.experimental.get_memory_info`, which on logical CPU devices is the
whole process's; reset after the first step), and the process's peak RSS (VmHWM, which also holds
TF's runtime and the traced graphs: M microbatches make a larger graph). Beside them: the estimate
of `Pipeline.memory_estimate`, summed over the stages. Writes bench_results/schedules.json.

--tensor: gpt_mini, batch --batch of 256 tokens, in three variants, each in its own process and
alternating for --rounds rounds: the unsplit GPT with 2 intra-op threads (the same threads as the
split model), the unsplit GPT with 1 thread, and t = 2 tensor parallel on 2 logical CPU devices
(1 intra-op thread each, 2 inter-op threads). Per variant: the median step time, the speedup of
t = 2 over each unsplit variant, and the share of the step spent summing partial outputs: the op
time in AddN and in copies between the devices, from a profiled step (tf.profiler's trace), beyond
the unsplit model's own AddN share (its gradient sums). `tfdist plan`'s prediction for this machine
(tfdist.plan, with the machine's measured matmul rate) stands beside it, with the error. Writes
bench_results/tensor.json.

--sequence: the activation bytes each of t = 2 shards keeps for the backward pass, with and
without sequence parallelism (Korthikanti et al. 2022), against the paper's formula
(`tfdist.models.arithmetic.Transformer.activation_bytes_per_layer`, eq. 2 and 4, at 4-byte values).
The logical CPU devices share one allocator, so TF's peak cannot tell the shards apart; the bytes
are counted from the traced step instead: every tensor a forward op computes from the batch
(reachable from the token ids) that an op of the backward pass (`tf.gradients`) reads, summed by
the device of the op that made it. One layer's bytes are the difference between a model of 2 and
of 1 layers (gpt_mini's width, context 256, dropout 0.1, --batch sequences), so the embedding and
the head drop out. Writes bench_results/sequence.json.
"""
import json
import os
import statistics
import subprocess
import sys

from absl import app, flags

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_SCHEDULES = flags.DEFINE_bool("schedules", False, "1F1B vs GPipe peak memory.")
_TENSOR = flags.DEFINE_bool("tensor", False, "t = 2 tensor parallel vs unsplit speed.")
_SEQUENCE = flags.DEFINE_bool("sequence", False, "Activation bytes per shard at t = 2, with "
                              "and without sequence parallelism.")
_MICROBATCHES = flags.DEFINE_list("microbatches", ["4", "8", "16", "32"], "--schedules: M values.")
_MB_SIZE = flags.DEFINE_integer("microbatch_size", 2, "--schedules: sequences per microbatch.")
_BATCH = flags.DEFINE_integer("batch", 8, "--tensor: sequences per step.")
_STEPS = flags.DEFINE_integer("steps", 6, "--tensor: timed steps per run (after 2 warm-up steps).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "--tensor: rounds of the three variants.")
_WORKER = flags.DEFINE_string("worker", "", "internal: run one measurement (JSON) and print it.")

SIZES = dict(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.0)


def worker(spec):
    """One measurement in this (fresh) process; prints `RESULT {...}`."""
    if "layers" in spec:
        return kept_worker(spec)
    import time

    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(spec["intra"])
    tf.config.threading.set_inter_op_parallelism_threads(spec["inter"])
    from tfdist.parallel.layout import Layout, configure_logical_cpus
    configure_logical_cpus(spec["stages"] * spec["tensor"])
    import keras

    from tfdist import strategies
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.models.pipeline import Pipeline
    from tfdist.step import TrainStep
    keras.utils.set_random_seed(0)
    model = Pipeline(GPT(**SIZES), stages=spec["stages"], microbatches=spec["microbatches"],
                     tensor_parallel=spec["tensor"], schedule=spec["schedule"])
    model.build()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=loss_fn())
    model.train_step = TrainStep(  # tfdist's step (tfdist.step), as `tfdist train` sets it
        model, strategies.get("single"), Layout(pp=spec["stages"], tp=spec["tensor"],
                                                microbatches=spec["microbatches"],
                                                schedule=spec["schedule"]))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(spec["batch"], SIZES["block_size"] + 1)).astype("int32")
    x, y = tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:])
    step = tf.function(lambda: model.train_step((x, y)))
    step()["loss"].numpy()  # traced, and run once: the peak below is a steady step's
    tf.config.experimental.reset_memory_stats("CPU:0")
    times = []
    for _ in range(spec["steps"] + 1):
        start = time.perf_counter()
        step()["loss"].numpy()
        times.append(time.perf_counter() - start)
    out = {"step_s": statistics.median(times[1:]) if spec["steps"] else None}
    if spec.get("profile"):
        out["sum_share"] = sum_share(step)
    out["tf_peak_bytes"] = int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    with open("/proc/self/status") as f:
        out["peak_rss_bytes"] = int(f.read().split("VmHWM:")[1].split()[0]) * 1024
    out["estimated_bytes"] = sum(r["total_bytes"] for r in model.memory_estimate(spec["batch"]))
    print("RESULT " + json.dumps(out), flush=True)


def kept_worker(spec):
    """--sequence: the bytes of the activations kept for the backward pass, by device."""
    import collections

    import tensorflow as tf

    from tfdist.parallel.layout import configure_logical_cpus
    configure_logical_cpus(2)
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.models.pipeline import Pipeline
    sizes = {**SIZES, "n_layer": spec["layers"], "dropout": 0.1}
    model = Pipeline(GPT(**sizes), stages=1, tensor_parallel=2, sequence_parallel=spec["sp"])
    model.build()
    model.compile(optimizer="sgd", loss=loss_fn())
    tokens = tf.zeros((spec["batch"], SIZES["block_size"]), tf.int32)
    graph = tf.function(model.compute_gradients).get_concrete_function(tokens, tokens).graph
    backward = lambda op: op.name.split("/")[0].startswith("gradients")  # noqa: E731
    ids = next(op for op in graph.get_operations() if op.type == "Placeholder")
    forward = set()  # the forward ops computed from the batch's token ids
    todo = [ids]
    while todo:
        op = todo.pop()
        if op.name not in forward and not backward(op):
            forward.add(op.name)
            todo += [c for out in op.outputs for c in out.consumers()]
    kept = {t.name: t for op in graph.get_operations() if backward(op) for t in op.inputs
            if t.op.name in forward}
    per_device = collections.Counter()
    for t in kept.values():
        device = tf.DeviceSpec.from_string(t.op.device)
        per_device[f"CPU:{device.device_index}" if t.op.device else "unplaced"] += \
            t.shape.num_elements() * t.dtype.size
    arch = model.gpt.arch_sizes
    tokens_n = spec["batch"] * SIZES["block_size"]
    print("RESULT " + json.dumps({"bytes": per_device, "formula_per_layer": {
        "sp": arch.activation_bytes_per_layer(tokens_n, "float32", tp=2, sp=True),
        "tp": arch.activation_bytes_per_layer(tokens_n, "float32", tp=2, sp=False)}}), flush=True)


def sum_share(step):
    """Shares of one profiled step's op time (summed over the compute threads of every device):
    AddN, the op that sums partial outputs (the forward sums of the row-parallel layers, which
    Grappler merges with the residual add, and the backward sums of the gradients that flow into a
    replicated input from every shard), and _Send/_Recv, the copies between devices. The unsplit
    model has AddN ops too (gradient sums); its share is the reference."""
    import glob
    import tempfile

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        step()["loss"].numpy()
        tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        with open(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0],
                  "rb") as f:
            space.ParseFromString(f.read())
    total = summed = copied = 0
    for plane in space.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name  # "<op name>:<op type>"
                op_type = name.rsplit(":", 1)[-1]
                if ":" not in name or op_type == "Process":  # a function call, not an op
                    continue
                total += event.duration_ps
                summed += event.duration_ps if op_type == "AddN" else 0
                copied += event.duration_ps if op_type in ("_Send", "_Recv") else 0
    return {"addn": summed / total, "send_recv": copied / total}


def measure(spec):
    p = subprocess.run([sys.executable, __file__, "--worker=" + json.dumps(spec)],
                       capture_output=True, text=True, timeout=1200, cwd=ROOT)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not lines:
        raise SystemExit(f"measurement {spec} failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def write(name, obj):
    from tfdist.data.store import write_atomic
    path = os.path.join(ROOT, "bench_results", name)
    write_atomic(path, json.dumps(obj, indent=1))
    print(f"wrote {os.path.normpath(path)}")


def schedules_main():
    rows = []
    for m in map(int, _MICROBATCHES.value):
        for schedule in ("gpipe", "1f1b"):
            r = measure({"stages": 2, "tensor": 1, "microbatches": m, "schedule": schedule,
                         "batch": m * _MB_SIZE.value, "steps": 0, "intra": 2, "inter": 2})
            rows.append({"schedule": schedule, "M": m, **r})
            print(f"{schedule:6} M={m:3}: TF peak {r['tf_peak_bytes'] / 2**20:8.1f} MiB, "
                  f"peak RSS {r['peak_rss_bytes'] / 2**20:8.1f} MiB, "
                  f"estimate {r['estimated_bytes'] / 2**20:8.1f} MiB", flush=True)
    base = {s: next(r for r in rows if r["schedule"] == s)["tf_peak_bytes"]
            for s in ("gpipe", "1f1b")}
    print(f"\n{'schedule':8} {'M':>3} {'TF peak MiB':>12} {'vs M=4':>7} {'RSS MiB':>9} "
          f"{'estimate MiB':>13}")
    for r in rows:
        r["vs_first_M"] = r["tf_peak_bytes"] / base[r["schedule"]]
        print(f"{r['schedule']:8} {r['M']:3} {r['tf_peak_bytes'] / 2**20:12.1f} "
              f"{r['vs_first_M']:7.2f} {r['peak_rss_bytes'] / 2**20:9.1f} "
              f"{r['estimated_bytes'] / 2**20:13.1f}")
    worst = max(r["vs_first_M"] for r in rows if r["schedule"] == "1f1b")
    print(f"1F1B: the largest peak is {worst:.3f} x its M={_MICROBATCHES.value[0]} peak "
          f"(target: within 1.10)")
    write("schedules.json", {"model": "gpt_mini", "stages": 2, "microbatch_size": _MB_SIZE.value,
                             "rows": rows, "one_f_one_b_worst_ratio": worst,
                             "command": "python tools/bench/model_parallel.py --schedules"})


def tensor_main():
    variants = {
        "unsplit (2 threads)": {"stages": 1, "tensor": 1, "intra": 2, "inter": 2},
        "unsplit (1 thread)": {"stages": 1, "tensor": 1, "intra": 1, "inter": 1},
        "t=2": {"stages": 1, "tensor": 2, "intra": 1, "inter": 2},
    }
    times = {name: [] for name in variants}
    share = {}
    for _ in range(_ROUNDS.value):
        for name, v in variants.items():
            r = measure({**v, "microbatches": 1, "schedule": "gpipe", "batch": _BATCH.value,
                         "steps": _STEPS.value, "profile": name != "unsplit (2 threads)"})
            times[name].append(r["step_s"])
            if "sum_share" in r:
                share.setdefault(name, []).append(r["sum_share"])
            print(f"{name:20} {r['step_s']:.3f} s/step", flush=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    predicted = planner_prediction(med["unsplit (1 thread)"])
    rows = []
    print(f"\n{'variant':20} {'step s':>8} {'t=2 speedup':>12}")
    for name, s in med.items():
        rows.append({"variant": name, "step_s": s, "t2_speedup_over_this": s / med["t=2"]})
        print(f"{name:20} {s:8.3f} {s / med['t=2']:12.2f}")
    measured = med["unsplit (1 thread)"] / med["t=2"]
    shares = {name: {k: statistics.median(x[k] for x in xs) for k in ("addn", "send_recv")}
              for name, xs in share.items()}
    for name, sh in shares.items():
        print(f"{name:20} op time in AddN {sh['addn']:.2%}, in _Send/_Recv {sh['send_recv']:.2%}")
    extra = (shares["t=2"]["addn"] + shares["t=2"]["send_recv"]
             - shares["unsplit (1 thread)"]["addn"])
    print(f"share of the t=2 step summing partial outputs (AddN and copies beyond the unsplit "
          f"model's AddN): {extra:.2%}")
    print(f"planner's predicted speedup of t=2 over one device: {predicted['speedup']:.2f}; "
          f"measured {measured:.2f} (error {predicted['speedup'] / measured - 1:+.1%})")
    write("tensor.json", {"model": "gpt_mini", "batch": _BATCH.value, "rounds": _ROUNDS.value,
                          "median_step_s": med, "all_step_s": times, "rows": rows,
                          "op_time_shares": shares, "sum_share_beyond_unsplit": extra,
                          "planner": predicted,
                          "measured_speedup_over_1_thread": measured,
                          "planner_error": predicted["speedup"] / measured - 1,
                          "command": "python tools/bench/model_parallel.py --tensor"})


def sequence_main():
    """--sequence (the module doc): one layer's kept bytes on each shard, counted, and the
    paper's per-rank figure."""
    counted = {}
    formula = None
    for sp in (False, True):
        r = {n: measure({"layers": n, "sp": sp, "batch": _BATCH.value}) for n in (1, 2)}
        devices = sorted(set(r[1]["bytes"]) | set(r[2]["bytes"]))
        counted[sp] = {d: r[2]["bytes"].get(d, 0) - r[1]["bytes"].get(d, 0) for d in devices}
        formula = r[1]["formula_per_layer"]
    rows = []
    print(f"\none layer of gpt_mini's width, {_BATCH.value} x 256 tokens, float32, t = 2")
    print(f"{'variant':22} {'shard 0 MiB':>12} {'shard 1 MiB':>12} {'largest':>8} "
          f"{'paper MiB':>10} {'largest/paper':>14}")
    for sp, name in ((False, "tensor parallel"), (True, "+ sequence parallel")):
        shards = [counted[sp].get(f"CPU:{i}", 0) for i in range(2)]
        paper = formula["sp" if sp else "tp"]
        rows.append({"variant": name, "sequence_parallel": sp, "shard_bytes": shards,
                     "largest_shard_bytes": max(shards), "paper_bytes_per_rank": paper,
                     "largest_over_paper": max(shards) / paper,
                     "unplaced_bytes": counted[sp].get("unplaced", 0)})
        print(f"{name:22} {shards[0] / 2**20:12.2f} {shards[1] / 2**20:12.2f} "
              f"{max(shards) / 2**20:8.2f} {paper / 2**20:10.2f} {max(shards) / paper:14.2f}")
    cut = rows[1]["largest_shard_bytes"] / rows[0]["largest_shard_bytes"]
    paper_cut = rows[1]["paper_bytes_per_rank"] / rows[0]["paper_bytes_per_rank"]
    print(f"sequence parallelism: the largest shard keeps {cut:.2f} x as much (paper: "
          f"{paper_cut:.2f} x)")
    write("sequence.json", {"model": "gpt_mini width, 1 layer (2 minus 1)", "batch": _BATCH.value,
                            "t": 2, "dropout": 0.1, "precision": "float32", "rows": rows,
                            "largest_shard_ratio": cut, "paper_ratio": paper_cut,
                            "command": "python tools/bench/model_parallel.py --sequence"})


def planner_prediction(one_thread_s):
    """`tfdist plan`'s step time for t = 2 on two of this machine's cores (the per-core matmul
    peak of bench_results/bench.json), with the fraction of peak fitted to the unsplit model's
    measured one-thread step, as `tfdist plan --measured` fits it; the two devices are in one
    process, so the partial outputs are summed in memory (no network)."""
    import dataclasses
    import math

    from tfdist import plan
    from tfdist.config import default_config
    c = default_config()
    c.model.update(**SIZES)
    model = plan.model_from_config(c, "gpt_mini")
    dev = plan.cpu_device(os.path.join(ROOT, "bench_results"))
    opts = plan.Options(precision="float32")
    batch = _BATCH.value
    f = plan.fit_efficiency(model, plan.Cluster(dev, 1), plan.planned(batch, 1, microbatch=batch),
                            one_thread_s, opts)
    inproc = plan.Cluster(dev, 2, intra_bw=math.inf, inter_bw=math.inf)
    t2 = plan.step_time(model, inproc, plan.planned(batch, 1, tp=2, microbatch=batch),
                        dataclasses.replace(opts, efficiency=f))["total"]
    return {"fitted_efficiency": f, "predicted_step_s": t2, "speedup": one_thread_s / t2}


def main(argv):
    del argv
    if _WORKER.value:
        return worker(json.loads(_WORKER.value))
    if _SCHEDULES.value:
        schedules_main()
    if _TENSOR.value:
        tensor_main()
    if _SEQUENCE.value:
        sequence_main()
    if not (_SCHEDULES.value or _TENSOR.value or _SEQUENCE.value):
        raise app.UsageError("give --schedules, --tensor and/or --sequence")


if __name__ == "__main__":
    app.run(main)
