"""Benchmark: tokens/s and MFU of a GPT training step, tfdist vs plain Keras 3 `fit`; and the
scaling of multi-worker training.

    python tools/bench.py                       # gpt_mini, batch 16 x 256, both cores
    python tools/bench.py --steps=4 --rounds=2 --config=configs/gpt_nano.py   # quick look
    python tools/bench.py --scaling             # 2 workers x 1 thread vs 1 x 1 thread, gpt_mini
    python tools/bench.py --scaling --ps        # parameter server: 2 workers + 1 ps vs 1 + 1
    python tools/bench.py --pipeline            # 2 stages x M microbatches vs unsplit, gpt_mini
    python tools/bench.py --scaling --horovod   # Horovod: 2 ranks x 1 thread vs 1 x 1 thread
    python tools/bench.py --scaling --horovod --compression=fp16    # the same, gradients in fp16

What it measures, all in one process so that the noisy machine affects every variant alike:
* the matmul peak of this machine (FLOP/s, fp32 2048^3 `tf.matmul`, best of several);
* steady-state training steps (a callback around each batch, after warm-up) of
  - `tfdist`: the `single` strategy plugin, tfdist's data pipeline, callbacks and optimizer;
  - `keras`: the same GPT class trained by plain Keras 3 `model.fit` on an in-memory dataset;
  - `tfdist+jit`: as `tfdist` with `jit_compile=True` (XLA);
  the variants are interleaved round by round and compared as ratios;
* MFU = tokens/s * (6 N + 12 L C T) / peak (nanoGPT's formula; N without position embeddings).
It prints a table and writes JSON (--out).

--scaling runs real `tfdist train` processes instead. A single-process run (1 intra-op thread,
--inter_op_threads inter-op threads) and a `tfdist launch --workers=2` MultiWorkerMirrored run
(the same threads per worker, the same batch per worker, so twice the global batch) alternate for
--rounds rounds. Each run's steady tokens/s is
the median over its steps after --warmup; scaling efficiency = tokens/s(2 workers) /
(2 * tokens/s(1 worker)), per round and as the median of the rounds. Writes
bench_results/scaling.json unless --out says otherwise.

--pipeline runs `tfdist train` with the model in K=2 stages on 2 logical CPU devices and M in
--microbatches, against the unsplit model on one device: each process has 1 intra-op thread
(so one compute thread per device), the pipelined runs 2 inter-op threads so that the stages'
ops can run at once. Per M: step time, speedup over unsplit, the GPipe ideal KM/(M+K-1), the
fraction of it reached, and the measured bubble 1 - speedup/K; plus each stage's estimated peak
memory. Writes bench_results/pipeline.json.

--scaling --horovod does the same with `tfdist launch --strategy=horovod` (horovodrun, Gloo) for
the 2 ranks, and --compression=fp16 sends their gradients as float16. Writes
bench_results/scaling-horovod[-fp16].json.

--overlap measures the overlap of the gradient all-reduce with the backward pass
(tfdist/buckets.py): the 2-process efficiency of multi_worker_mirrored and horovod with
strategy.overlap=off and with buckets of each --buckets size (MiB), against one process, all
interleaved round by round (1 intra-op and --inter_op_threads inter-op thread per process, the
same batch per process); with --link on the test cluster's shaped links. The last round's runs
profile their last step: each strategy's trace (both processes, overlapped and not, Chrome trace
format: chrome://tracing or ui.perfetto.dev) goes to bench_results/overlap-trace-<strategy>.json,
and its overlap report (tfdist.profiling.overlap) to the results,
bench_results/overlap[-<link>].json, beside the planner's prediction for each row.

--scaling --ps does the same for the parameter server: `tfdist launch --strategy=parameter_server`
with 1 ps task and 1 or 2 workers (each step one batch of train.batch_size on one worker; every
process 1 intra-op and --inter_op_threads inter-op threads). Steps/s is measured from the run's
progress reports after the first one; efficiency = steps/s(2 workers) / (2 * steps/s(1 worker)).
Writes bench_results/scaling-ps.json.
"""
import json
import os
import re
import subprocess
import sys
import time

from absl import flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist import cli  # noqa: E402

_CONFIG = cli.define_config_flag(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "gpt_mini.py"),
    "Model/training config to benchmark.")
_STEPS = flags.DEFINE_integer("steps", 6, "Timed steps per variant per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps per variant before the rounds.")
_JIT = flags.DEFINE_bool("jit", True, "Also time jit_compile=True.")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results "
                           "(default bench_results/bench.json, or scaling.json with --scaling).")
_SCALING = flags.DEFINE_bool("scaling", False, "Measure multi-worker scaling instead (see above).")
_WORKERS = flags.DEFINE_integer("workers", 2, "--scaling: workers of the multi-worker run.")
_PS_SCALING = flags.DEFINE_bool("ps", False, "--scaling: parameter_server instead: 2 workers + 1 ps "
                                 "vs 1 worker + 1 ps, in steps/s.")
_HOROVOD = flags.DEFINE_bool("horovod", False, "--scaling: Horovod ranks instead of "
                              "multi_worker_mirrored workers.")
_COMPRESSION = flags.DEFINE_enum("compression", "none", ["none", "fp16"],
                                 "--scaling --horovod: gradient compression.")
_PIPELINE = flags.DEFINE_bool("pipeline", False, "Measure the GPipe pipeline instead (see above).")
_MICROBATCHES = flags.DEFINE_list("microbatches", ["1", "2", "4", "8", "16"], "--pipeline: M values.")
_LINK = flags.DEFINE_string("link", None, "--scaling: run the multi-process runs on "
                            "tools/netcluster.py's hosts, one process per host, on links shaped "
                            "to this rate (1gbit, 10gbit; root), through `tfdist launch --hosts`.")
_STRAGGLER = flags.DEFINE_string("straggler", None, "--scaling --link: the last worker's host "
                                 "gets this rate instead (100mbit: a tenth of 1gbit), a straggler; "
                                 "the baseline runs keep --link.")
_OVERLAP = flags.DEFINE_bool("overlap", False, "Measure the overlap of the gradient all-reduce "
                             "with the backward pass instead (see above).")
_BUCKETS = flags.DEFINE_list("buckets", ["1", "4", "25", "100"], "--overlap: bucket sizes (MiB).")
_INTER = flags.DEFINE_integer("inter_op_threads", 1, "--scaling: inter-op threads per process. With "
                              "TF's default (0: one per core) a process with 1 intra-op thread "
                              "still runs independent ops in parallel, on ~1.4 of 2 cores.")


def matmul_peak(n=2048, repeats=10):
    import tensorflow as tf
    a = tf.random.normal((n, n))
    b = tf.random.normal((n, n))
    f = tf.function(lambda: tf.matmul(a, b))
    f().numpy()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f().numpy()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def _train_run(workdir, workers, steps, inter=None, extra=(), horovod=None):
    """One `tfdist train` (workers=1, strategy single) or `tfdist launch` run (multi_worker_mirrored,
    or horovod: --horovod unless `horovod` says); its per-step log."""
    inter = _INTER.value if inter is None else inter
    horovod = _HOROVOD.value if horovod is None else horovod
    config = config_flags_filename()
    per_worker = _CONFIG.value.train.batch_size
    train_flags = [f"--config={config}", f"--workdir={workdir}", "--overwrite",
                   f"--config.train.steps={steps}", f"--config.train.steps_per_epoch={steps}",
                   f"--config.train.batch_size={per_worker * workers}",
                   "--config.train.warmup_steps=1", "--config.train.eval_steps=1",
                   "--config.train.intra_op_threads=1",
                   f"--config.train.inter_op_threads={inter}", "--config.backup.enabled=false",
                   *extra]
    if workers == 1:
        cmd = [sys.executable, "-m", "tfdist", "train", *train_flags, "--strategy=single"]
    elif horovod:
        cmd = [sys.executable, "-m", "tfdist", "launch", "--strategy=horovod",
               f"--workers={workers}", "--max_restarts=0", "--", *train_flags,
               f"--config.strategy.compression={_COMPRESSION.value}"]
    else:
        cmd = [sys.executable, "-m", "tfdist", "launch", f"--workers={workers}",
               "--max_restarts=0", "--", *train_flags]
    p = _run(cmd, workers, straggler_host=workers - 1 if workers > 1 else None)
    _train_run.stdout = p.stdout
    if p.returncode:
        sys.exit(f"bench: {' '.join(cmd[2:5])} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n"
                 f"{p.stderr[-2000:]}")
    with open(os.path.join(workdir, "metrics.json")) as f:
        return json.load(f)["steps"]


def _ps_run(workdir, workers, steps):
    """Steps/s of one parameter-server run (its progress reports after the first)."""
    config = config_flags_filename()
    train_flags = [f"--config={config}", f"--workdir={workdir}", "--overwrite",
                   f"--config.train.steps={steps}", f"--config.train.steps_per_epoch={steps}",
                   "--config.train.warmup_steps=1", "--config.train.eval_steps=1",
                   "--config.train.intra_op_threads=1",
                   f"--config.train.inter_op_threads={_INTER.value}", "--config.backup.enabled=false"]
    cmd = [sys.executable, "-m", "tfdist", "launch", "--strategy=parameter_server",
           f"--workers={workers}", "--ps=1", "--max_restarts=0", "--", *train_flags]
    p = _run(cmd, workers + 2, straggler_host=workers if workers > 1 else None)  # chief, workers, ps
    if p.returncode:
        sys.exit(f"bench: parameter_server run failed (exit {p.returncode}):\n{p.stdout[-2000:]}")
    with open(os.path.join(workdir, "metrics.json")) as f:
        log = json.load(f)["steps"][1:]
    _ps_run.worker_steps = log[-1].get("worker_steps")
    return (log[-1]["step"] - log[0]["step"]) / (log[-1]["time"] - log[0]["time"])


def _run(cmd, processes, straggler_host=None):
    """Runs `cmd`; with --link, a `tfdist launch` runs on host 0 of a tools/netcluster.py cluster
    of `processes` hosts with --hosts=<all of them>, its links shaped to --link (and host
    `straggler_host`'s to --straggler, if given)."""
    if not _LINK.value or cmd[3:4] != ["launch"]:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    from tools.netcluster import NetCluster
    with NetCluster(processes, rate=_LINK.value) as net:
        if _STRAGGLER.value and straggler_host is not None:
            net.shape(straggler_host, rate=_STRAGGLER.value)
        hosts = ",".join(net.address(i) for i in range(processes))
        env = {**os.environ, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"]}
        return net.run(0, [*cmd[:4], f"--hosts={hosts}", *cmd[4:]], timeout=3600, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _link_suffix():
    return ((f"-{_LINK.value}" if _LINK.value else "") +
            (f"-straggler{_STRAGGLER.value}" if _LINK.value and _STRAGGLER.value else ""))


def _params(stdout):
    """The model's parameter count from a run's log line ("model 10,818,816 parameters"), or None."""
    found = re.search(r"model ([\d,]+) parameters", stdout or "")
    return int(found.group(1).replace(",", "")) if found else None


def _predicted_efficiency(stdout, tps1, tokens_1, fp16):
    """The planner's model (tfdist.plan.model: no overlap of compute and communication) of the
    2-process efficiency on a link of --link: T1 / (T1 + ring all-reduce of the gradients)."""
    from tfdist.plan.model import allreduce_seconds
    from tools.netcluster import _bits
    params = _params(stdout)
    if not (_LINK.value and params):
        return None
    t1 = tokens_1 / tps1
    slowest = _STRAGGLER.value or _LINK.value  # a ring goes at its slowest link's pace
    comm = allreduce_seconds(params * (2 if fp16 else 4), _WORKERS.value, _bits(slowest) / 8)
    return t1 / (t1 + comm)


def ps_scaling_main():
    import tempfile
    import numpy as np

    steps = 10 * max(2, _STEPS.value // 2 + 1)  # reports come every 10 steps; the first is warm-up
    c = _CONFIG.value
    tmp = tempfile.mkdtemp(prefix="tfdist-scaling-ps-")
    rounds = []
    for r in range(_ROUNDS.value):
        row = {}
        for workers in (1, 2):
            row[workers] = _ps_run(os.path.join(tmp, f"w{workers}"), workers, steps)
            print(f"round {r + 1}: {workers} worker(s) + 1 ps: {row[workers]:.3f} steps/s", flush=True)
        rounds.append({"steps_per_sec_1": row[1], "steps_per_sec_2": row[2],
                       "efficiency": row[2] / (2 * row[1]), "worker_steps_2": _ps_run.worker_steps})
    eff = float(np.median([x["efficiency"] for x in rounds]))
    s1 = float(np.median([x["steps_per_sec_1"] for x in rounds]))
    s2 = float(np.median([x["steps_per_sec_2"] for x in rounds]))
    result = {"config": os.path.basename(config_flags_filename()), "batch_per_step": c.train.batch_size,
              "context": c.model.block_size, "ps_tasks": 1, "intra_op_threads": 1,
              "inter_op_threads": _INTER.value or "TF default", "steps_per_run": steps,
              "rounds": rounds, "steps_per_sec_1": s1, "steps_per_sec_2": s2,
              "scaling_efficiency": eff, "link": _LINK.value or "loopback",
              "straggler": _LINK.value and _STRAGGLER.value}
    print(f"\n{result['config']}: batch {c.train.batch_size} x {c.model.block_size} per step, "
          f"parameter_server with 1 ps, median of {_ROUNDS.value} interleaved rounds")
    print(f"1 worker + 1 ps: {s1:.3f} steps/s; 2 workers + 1 ps: {s2:.3f} steps/s")
    print(f"scaling efficiency: {100 * eff:.1f}% (target >= 80%)")
    write_json(result, f"bench_results/scaling-ps{_link_suffix()}.json")


def scaling_main():
    import tempfile
    import numpy as np

    n, steps = _WORKERS.value, _WARMUP.value + _STEPS.value
    c = _CONFIG.value
    tokens_1 = c.train.batch_size * c.model.block_size
    tmp = tempfile.mkdtemp(prefix="tfdist-scaling-")
    rounds = []
    for r in range(_ROUNDS.value):
        row = {}
        for workers in (1, n):  # interleaved: the machine's noise hits both alike
            log = _train_run(os.path.join(tmp, f"w{workers}"), workers, steps)
            rates = [s["tokens_per_sec"] for s in log[_WARMUP.value:]]
            row[workers] = float(np.median(rates))
            print(f"round {r + 1}: {workers} worker(s) x 1 thread: {row[workers]:8.0f} tokens/s "
                  f"({workers * tokens_1 / row[workers]:.2f} s/step)", flush=True)
        rounds.append({"tokens_per_sec_1": row[1], f"tokens_per_sec_{n}": row[n],
                       "efficiency": row[n] / (n * row[1])})
    eff = float(np.median([x["efficiency"] for x in rounds]))
    tps1 = float(np.median([x["tokens_per_sec_1"] for x in rounds]))
    tpsn = float(np.median([x[f"tokens_per_sec_{n}"] for x in rounds]))
    strategy = (f"horovod, compression {_COMPRESSION.value}" if _HOROVOD.value
                else "multi_worker_mirrored")
    result = {"config": os.path.basename(config_flags_filename()), "batch_per_worker": c.train.batch_size,
              "strategy": strategy,
              "context": c.model.block_size, "workers": n, "intra_op_threads": 1,
              "inter_op_threads": _INTER.value or "TF default",
              "timed_steps_per_run": _STEPS.value, "rounds": rounds,
              "tokens_per_sec_1": tps1, f"tokens_per_sec_{n}": tpsn, "scaling_efficiency": eff,
              "link": _LINK.value or "loopback", "straggler": _LINK.value and _STRAGGLER.value}
    predicted = _predicted_efficiency(_train_run.stdout, tps1, tokens_1,
                                      _HOROVOD.value and _COMPRESSION.value == "fp16")
    if predicted is not None:
        result["planner_predicted_efficiency"] = predicted
        result["planner_error"] = predicted / eff - 1
    print(f"\n{result['config']}: batch {c.train.batch_size} x {c.model.block_size} per worker, "
          f"1 intra-op and {_INTER.value or 'default'} inter-op thread(s) per worker, median of "
          f"{_ROUNDS.value} interleaved rounds")
    print(f"{'run':34s} {'tokens/s':>10s} {'s/step':>8s}")
    print(f"{'1 process (single)':34s} {tps1:10.0f} {tokens_1 / tps1:8.2f}")
    print(f"{f'{n} workers ({strategy})':34s} {tpsn:10.0f} {n * tokens_1 / tpsn:8.2f}")
    print(f"scaling efficiency: {100 * eff:.1f}% (target >= 90%)"
          + (f"; on {_LINK.value} links the planner predicts {100 * predicted:.1f}% "
             f"({100 * result['planner_error']:+.1f}%)" if predicted is not None else ""))
    write_json(result, (f"bench_results/scaling{_link_suffix()}.json" if not _HOROVOD.value else
               f"bench_results/scaling-horovod{'-fp16' if _COMPRESSION.value == 'fp16' else ''}"
               f"{_link_suffix()}.json"))


def overlap_main():
    """--overlap: overlapped against not, and the bucket sizes, for both synchronous strategies."""
    import tempfile
    import numpy as np
    from tfdist import profiling
    from tfdist.plan.model import allreduce_seconds, exposed_allreduce

    n, steps = _WORKERS.value, _WARMUP.value + _STEPS.value
    c = _CONFIG.value
    tokens_1 = c.train.batch_size * c.model.block_size
    variants = {"1 process": (1, False, [])}
    for strategy, horovod in (("multi_worker_mirrored", False), ("horovod", True)):
        variants[f"{strategy} off"] = (n, horovod, ["--config.strategy.overlap=off"])
        for size in _BUCKETS.value:
            variants[f"{strategy} {float(size):g} MiB"] = (
                n, horovod, [f"--config.strategy.bucket_mb={float(size)}"])
    tmp = tempfile.mkdtemp(prefix="tfdist-overlap-")
    rates = {name: [] for name in variants}
    params = None
    for r in range(_ROUNDS.value):
        last = r == _ROUNDS.value - 1
        for name, (workers, horovod, extra) in variants.items():
            workdir = os.path.join(tmp, name.replace(" ", "_"))
            profile = [f"--config.train.profile_step={steps}"] if last and workers > 1 else []
            log = _train_run(workdir, workers, steps, extra=[*extra, *profile], horovod=horovod)
            params = params or _params(_train_run.stdout)
            rates[name].append(float(np.median([x["tokens_per_sec"] for x in log[_WARMUP.value:]])))
            eff = rates[name][-1] / (workers * rates["1 process"][-1])
            print(f"round {r + 1}: {name:32s} {rates[name][-1]:8.0f} tokens/s, efficiency "
                  f"{100 * eff:5.1f}%", flush=True)
    # the planner: T1 against T1 plus the all-reduce it leaves exposed (tfdist.plan.model), at
    # the link's rate, or on loopback at the bus bandwidth `make bench-allreduce` measured
    from tfdist.plan.machine import allreduce_bandwidth
    from tools.netcluster import _bits
    t1 = tokens_1 / float(np.median(rates["1 process"]))
    rows = []
    for name, (workers, horovod, extra) in variants.items():
        per_round = [x / (workers * y) for x, y in zip(rates[name], rates["1 process"])]
        row = {"variant": name, "tokens_per_sec": float(np.median(rates[name])),
               "efficiency": float(np.median(per_round)), "per_round": per_round}
        if workers > 1:
            row["strategy"] = "horovod" if horovod else "multi_worker_mirrored"
            row["overlap"] = "off" if name.endswith("off") else "on"
            row["bucket_mb"] = None if row["overlap"] == "off" else float(name.split()[-2])
            bw = (_bits(_LINK.value) / 8 if _LINK.value else
                  allreduce_bandwidth("bench_results", "horovod/gloo" if horovod else "tf ring (MWMS)"))
            if bw and params:
                comm = allreduce_seconds(4 * params, workers, bw)
                if row["overlap"] == "on":  # the backward pass: 2 of a step's 3 matmul passes
                    comm = exposed_allreduce(comm, t1 * 2 / 3, 4 * params, row["bucket_mb"] * 2 ** 20)
                row["planner_predicted_efficiency"] = t1 / (t1 + comm)
                row["planner_error"] = row["planner_predicted_efficiency"] / row["efficiency"] - 1
        rows.append(row)
    traces = {}
    sizes = [float(x) for x in _BUCKETS.value]
    on = f"{25.0 if 25.0 in sizes else sizes[0]:g} MiB"  # the default bucket size, if measured
    for strategy in ("multi_worker_mirrored", "horovod"):
        per_worker, reports = {}, {}
        for label in (on, "off"):
            name = f"{strategy} {label}"
            if name not in variants:
                continue
            workdir = os.path.join(tmp, name.replace(" ", "_"))
            for w in range(n):
                events = profiling.read(os.path.join(workdir, "profile", f"worker-{w}"))
                per_worker[len(per_worker)] = events
                report = profiling.overlap(events)
                report.pop("all_reduces")
                reports[f"{label}, worker {w}"] = report
        if per_worker:
            out = f"bench_results/overlap-trace-{strategy}{_link_suffix()}.json"
            with open(out, "w") as f:
                json.dump(profiling.chrome_trace(per_worker), f)
            traces[strategy] = {"file": out, "processes": f"overlapped ({on}) workers first, "
                                f"then overlap=off", "reports": reports}
    print(f"\n{os.path.basename(config_flags_filename())}: batch {c.train.batch_size} x "
          f"{c.model.block_size} per process, {n} processes, 1 intra-op and {_INTER.value} inter-op "
          f"thread(s) each, {_LINK.value or 'loopback'}; median of {_ROUNDS.value} interleaved rounds")
    print(f"{'variant':34s} {'tokens/s':>9s} {'efficiency':>11s} {'planner':>8s}")
    for row in rows:
        pred = row.get("planner_predicted_efficiency")
        print(f"{row['variant']:34s} {row['tokens_per_sec']:9.0f} {100 * row['efficiency']:10.1f}% "
              + (f"{100 * pred:7.1f}%" if pred else ""))
    for strategy, t in traces.items():
        for key, rep in t["reports"].items():
            print(f"trace {strategy} {key}: {rep['issued_during_backward']} all-reduce(s) issued "
                  f"and {rep['completed_during_backward']} completed before the backward pass "
                  f"ended; {100 * rep['hidden_fraction']:.0f}% of {rep['communication_us'] / 1e3:.0f} "
                  f"ms of communication hidden, {rep['exposed_communication_us'] / 1e3:.0f} ms exposed")
    write_json({"config": os.path.basename(config_flags_filename()), "workers": n,
                "batch_per_process": c.train.batch_size, "context": c.model.block_size,
                "intra_op_threads": 1, "inter_op_threads": _INTER.value,
                "timed_steps_per_run": _STEPS.value, "link": _LINK.value or "loopback",
                "rows": rows, "traces": traces}, f"bench_results/overlap{_link_suffix()}.json")


def pipeline_main():
    """--pipeline: K=2 stages on 2 logical CPU devices, M microbatches, vs the unsplit model."""
    import tempfile
    import numpy as np

    c = _CONFIG.value
    k, steps = 2, _WARMUP.value + _STEPS.value
    ms = [int(m) for m in _MICROBATCHES.value]
    tmp = tempfile.mkdtemp(prefix="tfdist-pipeline-")
    # Pipelined: 1 intra-op thread, and 2 inter-op threads so that the two stages' ops can run
    # at once. Unsplit, on one device: the same threads (the reference); and with 1 inter-op
    # thread, i.e. strictly one core (2 inter-op threads let independent ops, such as a
    # matmul's two gradients, run at once even on one device).
    variants = {"unsplit": (2, []), "unsplit-1": (1, [])}
    for m in ms:
        variants[f"M={m}"] = (2, [f"--config.pipeline.stages={k}", f"--config.pipeline.microbatches={m}"])
    times, memory = {name: [] for name in variants}, {}
    for r in range(_ROUNDS.value):
        for name, (inter, extra) in variants.items():
            log = _train_run(os.path.join(tmp, name.replace("=", "")), 1, steps, inter, extra)
            t = float(np.median([s["step_time"] for s in log[_WARMUP.value:]]))
            times[name].append(t)
            print(f"round {r + 1}: {name:8s} {t:6.2f} s/step", flush=True)
            if extra:  # the run's own report: estimated and measured peak memory per stage
                memory[name] = re.findall(r"tfdist: (stage \d+ on .*)$", _train_run.stdout, re.M)
    base = float(np.median(times["unsplit"]))
    one = float(np.median(times["unsplit-1"]))
    rows = [{"variant": "unsplit", "microbatches": None, "step_time_s": base, "speedup": 1.0},
            {"variant": "unsplit-1", "microbatches": None, "step_time_s": one, "speedup": base / one}]
    for m in ms:
        t = float(np.median(times[f"M={m}"]))
        speedup, ideal = base / t, k * m / (m + k - 1)
        rows.append({"variant": f"K={k}, M={m}", "microbatches": m, "step_time_s": t,
                     "speedup": speedup, "ideal_speedup": ideal, "of_ideal": speedup / ideal,
                     "ideal_bubble": (k - 1) / (m + k - 1), "measured_bubble": 1 - speedup / k,
                     "speedup_vs_1_inter_op_thread": one / t,
                     "per_round_s": times[f"M={m}"]})
    print(f"\n{os.path.basename(config_flags_filename())}: batch {c.train.batch_size} x "
          f"{c.model.block_size}, K={k} stages on 2 logical CPU devices, 1 intra-op thread per "
          f"device; median of {_ROUNDS.value} interleaved rounds")
    print(f"{'variant':12s} {'s/step':>7s} {'speedup':>8s} {'ideal':>6s} {'of ideal':>9s} "
          f"{'bubble':>7s} {'ideal bubble':>13s}")
    for r in rows:
        if r["microbatches"] is None:
            print(f"{r['variant']:12s} {r['step_time_s']:7.2f} {r['speedup']:8.2f}")
            continue
        print(f"{r['variant']:12s} {r['step_time_s']:7.2f} {r['speedup']:8.2f} {r['ideal_speedup']:6.2f} "
              f"{100 * r['of_ideal']:8.1f}% {100 * r['measured_bubble']:6.1f}% "
              f"{100 * r['ideal_bubble']:12.1f}%")
    print("target at M=8: >= 85% of ideal. unsplit: 1 intra + 2 inter-op threads (the reference); "
          "unsplit-1: 1 intra + 1 inter-op thread")
    print("\npeak memory per stage, as each run reported it:")
    for name, lines in memory.items():
        print(f"  {name}: " + "; ".join(lines))
    write_json({"config": os.path.basename(config_flags_filename()), "stages": k,
                "batch": c.train.batch_size, "context": c.model.block_size,
                "threads": "unsplit: 1 intra + 2 inter; unsplit-1: 1 intra + 1 inter; pipelined: 1 intra + 2 inter",
                "rows": rows, "memory": memory}, "bench_results/pipeline.json")


def main(argv):
    del argv
    if _PIPELINE.value:
        return pipeline_main()
    if _OVERLAP.value:
        return overlap_main()
    if _SCALING.value:
        return ps_scaling_main() if _PS_SCALING.value else scaling_main()
    import keras
    import numpy as np
    import tensorflow as tf
    from tfdist import config as config_lib
    from tfdist import strategies
    from tfdist.data import Windows, open_store
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer

    c = config_lib.validate(_CONFIG.value)
    t, m = c.train, c.model
    strategy = strategies.get("single")
    data = open_store(c.data)
    if not m.vocab_size:
        m.vocab_size = data.vocab_size
    windows = Windows(data.split("train"), m.block_size, t.batch_size, seed=c.seed)
    tokens_per_step = t.batch_size * m.block_size
    total = _WARMUP.value + _STEPS.value * _ROUNDS.value

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self._t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._t)

    def build():
        keras.utils.set_random_seed(c.seed)
        model = GPT.from_model_config(m)
        model.build()
        return model

    variants = {}

    # tfdist: strategy plugin, pipeline, optimizer fixes, tfdist's per-step log
    from tfdist.callbacks import TrainingLog

    def tfdist_variant(jit):
        with strategy.scope():
            model = build()
            opt = strategy.wrap_optimizer(make_optimizer(t, total))
            model.compile(optimizer=opt, loss=loss_fn(), jit_compile=jit)
        timer = Timer()
        log = TrainingLog("/tmp/tfdist-bench", tokens_per_step=tokens_per_step, is_chief=False)

        def run(steps):
            strategy.fit(model, lambda start: windows.dataset_fn(start, steps),
                         epochs=1, steps_per_epoch=steps, callbacks=[log, timer], verbose=0)
        return run, timer, model

    # plain Keras 3: same model class, same optimizer settings, no tfdist machinery
    def keras_variant():
        model = build()
        model.compile(optimizer=make_optimizer(t, total), loss=loss_fn())
        xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in windows.dataset_fn(0, total)(None)])
        timer = Timer()

        def run(steps, _pos=[0]):
            i = _pos[0]
            x, y = np.concatenate(xs[i:i + steps]), np.concatenate(ys[i:i + steps])
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(t.batch_size)
            model.fit(ds, epochs=1, steps_per_epoch=steps, callbacks=[timer], verbose=0,
                      shuffle=False)
            _pos[0] += steps
        return run, timer, model

    variants["tfdist"] = tfdist_variant(False)
    variants["keras"] = keras_variant()
    if _JIT.value:
        variants["tfdist+jit"] = tfdist_variant(True)

    peak = matmul_peak()
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s (fp32)", flush=True)
    for name, (run, timer, _) in variants.items():  # warm-up: tracing, first steps
        run(_WARMUP.value)
        timer.times.clear()
    for r in range(_ROUNDS.value):
        for name, (run, timer, _) in variants.items():
            run(_STEPS.value)
            print(f"round {r + 1}: {name:11s} {np.median(timer.times[-_STEPS.value:]):.3f} s/step",
                  flush=True)

    model = variants["tfdist"][2]
    fpt = model.flops_per_token()
    rows = []
    base = None
    for name, (_, timer, _) in variants.items():
        step = float(np.median(timer.times))
        tps = tokens_per_step / step
        base = base or tps
        rows.append({"variant": name, "step_time_s": step, "tokens_per_sec": tps,
                     "mfu": tps * fpt / peak, "relative_to_tfdist": tps / base})
    keras_tps = next(r["tokens_per_sec"] for r in rows if r["variant"] == "keras")
    result = {"config": os.path.basename(config_flags_filename()), "params": model.num_params(),
              "batch": t.batch_size, "context": m.block_size, "flops_per_token": fpt,
              "matmul_peak_flops": peak, "cores": os.cpu_count(), "threads": "TF default (all cores)",
              "tfdist_overhead_vs_keras": 1 - rows[0]["tokens_per_sec"] / keras_tps, "rows": rows}

    print(f"\n{result['config']}: {result['params']:,} params, batch {t.batch_size} x {m.block_size}"
          f", peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'variant':12s} {'s/step':>8s} {'tokens/s':>10s} {'MFU':>7s} {'vs tfdist':>10s}")
    for r in rows:
        print(f"{r['variant']:12s} {r['step_time_s']:8.3f} {r['tokens_per_sec']:10.0f} "
              f"{100 * r['mfu']:6.1f}% {r['relative_to_tfdist']:10.3f}")
    print(f"tfdist overhead vs plain Keras fit: {100 * result['tfdist_overhead_vs_keras']:+.1f}% "
          f"of throughput")
    write_json(result, "bench_results/bench.json")


def write_json(result, default_path):
    out = _OUT.value or default_path
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


def config_flags_filename():
    from ml_collections import config_flags
    return config_flags.get_config_filename(flags.FLAGS["config"])


if __name__ == "__main__":
    cli.run(main, sys.argv)
