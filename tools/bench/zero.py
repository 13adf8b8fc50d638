"""ZeRO with 2 replicas of gpt_mini, plain data parallel against ZeRO-1, ZeRO-2 and ZeRO-3 (its
gathered weights gathered again for the backward pass, tfdist's default, and kept instead).

    python tools/bench/zero.py                                   # Horovod (make bench-zero)
    python tools/bench/zero.py --strategy=multi_worker_mirrored  # TF's collectives (also there)

Each variant runs as 2 real processes (`horovodrun -np 2`, Gloo on 127.0.0.1; or `tfdist launch
--workers 2`, TF's gRPC collectives), in turn, for --rounds rounds. Each builds gpt_mini (byte
vocabulary, ~10.8 M parameters) with tfdist's training step (`tfdist.step.TrainStep`: AdamW,
global clipping, the layout's ZeRO stage), runs a traced training step on a batch of --batch
sequences per replica, then --steps timed steps. Per variant:

* the median step time, and its ratio to plain data parallel's of the same round;
* the optimizer's bytes on each rank (its variables: AdamW's moments, or the rank's shard), and
  the weight bytes it stores (ZeRO-3: its shard, counted from its variables);
* TF's CPU allocator peak over the timed steps, and the process's peak RSS (VmHWM), rank 0;
* the bytes sent per step: the loopback interface's transmitted bytes (/proc/net/dev, both ranks'
  traffic, halved) over the timed steps, against the ZeRO paper's volume (2(N-1)/N of the
  gradient bytes for an all-reduce, and for a reduce-scatter plus an all-gather alike; ZeRO-3:
  3(N-1)/N, the forward's gather, the backward's, and the reduce-scatter).

Prints a table and writes bench_results/zero.json (zero-mwms.json).

With --cap_mib=M each rank runs in a memory cgroup of its own (cgroup v1, limit M MiB, no swap
beyond it), on --model=wide (8 layers 768 wide, 64 tokens: 57 M parameters, whose weights,
gradients and moments dominate its memory), for --stages: which variants train under the cap
and which are killed for memory. It writes bench_results/zero-cap.json. Gloo's all-reduce is not a
plain ring, and TCP (and gRPC) add headers, so the measured bytes are compared as ratios to plain
data parallel's.
"""
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.bench.loopback import loopback_tx  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per run (after one traced step).")
_BATCH = flags.DEFINE_integer("batch", 4, "Sequences of 256 tokens per rank and step.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds of the variants.")
_WORKER = flags.DEFINE_integer("worker", -1, "Internal: run as a rank with this ZeRO stage.")
_CAP = flags.DEFINE_integer("cap_mib", 0, "A memory cap per rank, MiB (0: none).")
_MODEL = flags.DEFINE_enum("model", "mini", ["mini", "wide"], "gpt_mini, or a model whose "
                           "weights dominate its memory (57 M parameters, 64 tokens).")
_STAGES = flags.DEFINE_list("stages", ["0", "1", "2", "3", "4"], "The variants (4: ZeRO-3 kept).")
CGROUP = "/sys/fs/cgroup/memory"
_STRATEGY = flags.DEFINE_enum("strategy", "horovod", ["horovod", "multi_worker_mirrored"],
                              "The data-parallel strategy of the 2 processes.")

KEPT = 4  # (the variant's number: ZeRO-3 without the regather)
SIZES = dict(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.0)
WIDE = dict(vocab_size=256, block_size=64, n_layer=8, n_head=12, n_embd=768, dropout=0.0)


def worker(stage):
    options = {}
    if stage == KEPT:  # ZeRO-3, the forward's gathered weights kept for the backward pass
        options = {"regather": False}
        stage = 3
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    from tfdist import strategies
    from tfdist.config import default_config
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer
    from tfdist.parallel import zero
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep
    strategy = strategies.get(_STRATEGY.value)
    keras.utils.set_random_seed(0)
    with strategy.scope():  # as `tfdist train` builds it: tfdist's training step (tfdist.step)
        sizes = WIDE if _MODEL.value == "wide" else SIZES
        model = GPT(**sizes)
        model.build()
        t = default_config().train
        model.compile(optimizer=make_optimizer(t, 1000), loss=loss_fn())
        model.train_step = TrainStep(model, strategy,
                                     Layout(dp=strategy.num_replicas, zero=stage),
                                     clipnorm=t.grad_clip, zero_options=options)
        optimizer = model.optimizer
    rank = strategy.worker_index
    rng = np.random.default_rng(rank)
    tokens = rng.integers(0, 256, size=(_BATCH.value, sizes["block_size"] + 1)).astype("int32")
    x, y = tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:])
    run = strategy.tf_strategy.run  # (Horovod: TF's default strategy; MWMS: one replica each)
    step = tf.function(lambda: run(model.train_step, args=((x, y),))["loss"])
    step().numpy()
    strategy.barrier()  # both traced: time together
    tf.config.experimental.reset_memory_stats("CPU:0")
    tx = loopback_tx()
    times = []
    for _ in range(_STEPS.value):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    strategy.barrier()
    tx = loopback_tx() - tx
    optimizer_bytes = sum(v.numpy().nbytes for v in optimizer.variables)
    sharded = zero.of(model)
    params = sharded if sharded and sharded.stage == 3 else None  # (the weights sharded)
    weight_bytes = 4 * (params.held_parameters() if params else
                        sum(int(np.prod(v.shape)) for v in model.trainable_variables))
    every = [json.loads(x) for x in exchange(strategy, json.dumps([optimizer_bytes, weight_bytes]))]
    if rank == 0:
        with open("/proc/self/status") as f:
            rss = int(f.read().split("VmHWM:")[1].split()[0]) * 1024
        grad_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        print("RESULT " + json.dumps({
            "step_s": statistics.median(times), "optimizer_bytes": [e[0] for e in every],
            "weight_bytes": [e[1] for e in every],
            "largest_unit_bytes": 4 * params.largest_unit if params else 0,
            "tf_peak_bytes": int(tf.config.experimental.get_memory_info("CPU:0")["peak"]),
            "peak_rss_bytes": rss, "sent_per_rank_step": tx / 2 / _STEPS.value,
            "gradient_bytes": grad_bytes}), flush=True)


def exchange(strategy, text):
    """Every process's `text`, in rank order: each writes a file, all meet, each reads them."""
    d = os.environ["TFDIST_BENCH_DIR"]
    with open(os.path.join(d, f"{strategy.worker_index}.txt"), "w") as f:
        f.write(text)
    strategy.barrier()
    return [open(os.path.join(d, f"{r}.txt")).read() for r in range(strategy.num_workers)]


def capped(argv, cap_mib, name):
    """`argv` run in a memory cgroup of its own per process, `cap_mib` MiB, swap included."""
    limit = cap_mib * 2**20
    script = (f'd={CGROUP}/{name}-$$ && mkdir $d && echo {limit} > $d/memory.limit_in_bytes && '
              f'(echo {limit} > $d/memory.memsw.limit_in_bytes 2>/dev/null; true) && '
              f'echo $$ > $d/cgroup.procs && exec "$@"')
    return ["/bin/sh", "-c", script, "sh", *argv]


def cgroups_of(name):
    import glob
    return glob.glob(f"{CGROUP}/{name}-*")


def measure(stage):
    import tempfile

    from tfdist.strategies.horovod import horovodrun_argv
    me = [sys.executable, os.path.abspath(__file__), f"--worker={stage}", f"--steps={_STEPS.value}",
          f"--batch={_BATCH.value}", f"--strategy={_STRATEGY.value}", f"--model={_MODEL.value}"]
    name = f"tfdist-bench-{os.getpid()}"
    if _CAP.value:
        me = capped(me, _CAP.value, name)
    cmd = horovodrun_argv(2, me) if _STRATEGY.value == "horovod" else [
        sys.executable, "-m", "tfdist", "launch", "--workers=2", "--max_restarts=0", "--", *me]
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                           env={**os.environ, "TFDIST_BENCH_DIR": d})
    lines = [x.split("RESULT ", 1)[1] for x in p.stdout.splitlines() if "RESULT " in x]
    if _CAP.value:  # which rank was killed for memory; the cgroups removed (their tasks ended)
        kills = 0
        for d in cgroups_of(name):
            with open(os.path.join(d, "memory.oom_control")) as f:
                kills += int(dict(line.split() for line in f).get("oom_kill", 0))
            with open(os.path.join(d, "memory.max_usage_in_bytes")) as f:
                peak = int(f.read())
            os.rmdir(d)
        return {"trained": p.returncode == 0 and bool(lines), "exit": p.returncode,
                "oom_kills": kills, "cgroup_peak_bytes": peak,
                **(json.loads(lines[-1]) if lines else {})}
    if p.returncode or not lines:
        raise SystemExit(f"stage {stage} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n"
                         f"{p.stderr[-2000:]}")
    return json.loads(lines[-1])


def main(argv):
    del argv
    if _WORKER.value >= 0:
        return worker(_WORKER.value)
    if _CAP.value:
        return main_capped()
    names = {0: "plain data parallel", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3",
             KEPT: "ZeRO-3, kept"}
    runs = {s: [] for s in names}
    for _ in range(_ROUNDS.value):
        for s in names:
            runs[s].append(measure(s))
            print(f"{names[s]:20} {runs[s][-1]['step_s']:.3f} s/step", flush=True)
    n = 2
    rows = []
    for s, name in names.items():
        r = {k: statistics.median(x[k] for x in runs[s])
             for k in ("step_s", "tf_peak_bytes", "peak_rss_bytes", "sent_per_rank_step")}
        r.update(variant=name, stage=min(s, 3), optimizer_bytes=runs[s][0]["optimizer_bytes"],
                 weight_bytes=runs[s][0]["weight_bytes"],
                 gradient_bytes=runs[s][0]["gradient_bytes"],
                 largest_unit_bytes=runs[s][0]["largest_unit_bytes"])
        r["paper_bytes_per_rank_step"] = (3 if s >= 3 else 2) * (n - 1) / n * r["gradient_bytes"]
        rows.append(r)
    base = rows[0]
    print(f"\n{'variant':20} {'s/step':>7} {'x plain':>7} {'weights MiB/rank':>17} "
          f"{'optimizer MiB/rank':>19} "
          f"{'TF peak MiB':>11} {'RSS MiB':>8} {'sent MiB/step':>13} {'x plain':>7} "
          f"{'paper MiB':>9}")
    for r in rows:
        r["time_vs_plain"] = r["step_s"] / base["step_s"]
        r["sent_vs_plain"] = r["sent_per_rank_step"] / base["sent_per_rank_step"]
        r["optimizer_vs_plain"] = max(r["optimizer_bytes"]) / max(base["optimizer_bytes"])
        print(f"{r['variant']:20} {r['step_s']:7.3f} {r['time_vs_plain']:7.2f} "
              f"{' / '.join(f'{b / 2**20:.1f}' for b in r['weight_bytes']):>17} "
              f"{' / '.join(f'{b / 2**20:.1f}' for b in r['optimizer_bytes']):>19} "
              f"{r['tf_peak_bytes'] / 2**20:11.1f} {r['peak_rss_bytes'] / 2**20:8.1f} "
              f"{r['sent_per_rank_step'] / 2**20:13.2f} {r['sent_vs_plain']:7.2f} "
              f"{r['paper_bytes_per_rank_step'] / 2**20:9.2f}")
    from tfdist.data.store import write_atomic
    mwms = _STRATEGY.value == "multi_worker_mirrored"
    path = os.path.join(ROOT, "bench_results", "zero-mwms.json" if mwms else "zero.json")
    write_atomic(path, json.dumps({
        "model": "gpt_mini", "strategy": _STRATEGY.value, "ranks": n,
        "batch_per_rank": _BATCH.value, "steps": _STEPS.value, "rounds": _ROUNDS.value,
        "rows": rows, "runs": runs,
        "command": "python tools/bench/zero.py" + (" --strategy=multi_worker_mirrored" * mwms)},
        indent=1))
    print(f"wrote {os.path.normpath(path)}")


def main_capped():
    names = {0: "plain data parallel", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3", KEPT: "ZeRO-3, kept"}
    rows = []
    for s in map(int, _STAGES.value):
        r = measure(s)
        rows.append({"variant": names[s], "stage": min(s, 3), **r})
        print(f"{names[s]:20} cap {_CAP.value} MiB/rank: "
              + ("trained" if r["trained"] else f"failed (exit {r['exit']}, {r['oom_kills']} "
                 f"rank(s) killed for memory)")
              + f"; cgroup peak {r['cgroup_peak_bytes'] / 2**20:,.0f} MiB", flush=True)
    from tfdist.data.store import write_atomic
    path = os.path.join(ROOT, "bench_results", "zero-cap.json")
    write_atomic(path, json.dumps({
        "model": _MODEL.value, "sizes": WIDE if _MODEL.value == "wide" else SIZES,
        "strategy": _STRATEGY.value, "ranks": 2, "batch_per_rank": _BATCH.value,
        "steps": _STEPS.value, "cap_mib_per_rank": _CAP.value, "rows": rows,
        "command": f"python tools/bench/zero.py --model={_MODEL.value} --cap_mib={_CAP.value} "
                   f"--batch={_BATCH.value} --steps={_STEPS.value} "
                   f"--stages={','.join(_STAGES.value)}"},
        indent=1))
    print(f"wrote {os.path.normpath(path)}")


if __name__ == "__main__":
    app.run(main)
