"""Benchmark: allreduce bus bandwidth, Horovod/Gloo vs TF's collective ring (MultiWorkerMirrored),
2 processes on 127.0.0.1, for 1, 4, 16 and 64 MB float32 tensors; Horovod also with fp16
compression.

    python tools/bench/allreduce.py                  # = make bench-allreduce
    python tools/bench/allreduce.py --sizes_mb=1,4 --iters=5    # quick look

The two back ends run in turn, each as 2 real processes (`horovodrun -np 2 --gloo`, and
`tfdist launch --workers 2` for MultiWorkerMirrored with CommunicationImplementation.RING); for
--rounds rounds, interleaved. In each process every size is reduced --warmup times untimed, then
--iters times timed, each call waiting for its result. Per size: t = median time per allreduce,
algorithm bandwidth = S / t, bus bandwidth = algbw * 2(n-1)/n (NCCL's definition: the bytes each
link carries in a ring; equal to algbw for n = 2). fp16 compression halves the bytes sent but
keeps S as the fp32 size, so its bus bandwidth is "effective". Prints a table and writes
bench_results/allreduce.json.

The processes run this same file with --worker=horovod|tf; rank 0 prints one RESULT line.
"""
import json
import os
import subprocess
import sys
import time

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist import cli  # noqa: E402

_SIZES = flags.DEFINE_list("sizes_mb", ["1", "4", "16", "64"], "Tensor sizes in MB (float32).")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed allreduces per size.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed allreduces per size first.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved rounds of the back ends.")
_OUT = flags.DEFINE_string("out", "bench_results/allreduce.json", "JSON output.")
_LINK = flags.DEFINE_string("link", None, "Run the 2 processes on 2 of "
                            "tools/cluster/netcluster.py's hosts, on links shaped to this rate "
                            "(1gbit, 10gbit; root). Writes allreduce-<link>.json unless --out is "
                            "given.")
_WORKER = flags.DEFINE_enum("worker", None, ["horovod", "tf"], "Internal: run as a worker.")
_COMPRESSION = flags.DEFINE_enum("compression", "none", ["none", "fp16"], "Internal: horovod.")


def _time(fn, sizes):
    """{MB: median seconds per call of fn(tensor)} (the call returns once the result is there)."""
    import numpy as np
    import tensorflow as tf
    out = {}
    for mb in sizes:
        x = tf.ones([int(mb * 2 ** 20) // 4], tf.float32)
        for _ in range(_WARMUP.value):
            fn(x)
        times = []
        for _ in range(_ITERS.value):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        out[mb] = float(np.median(times))
    return out


def horovod_worker(sizes):
    import horovod.tensorflow as hvd
    hvd.init()
    compression = hvd.Compression.fp16 if _COMPRESSION.value == "fp16" else hvd.Compression.none
    result = _time(lambda x: hvd.allreduce(x, op=hvd.Sum, compression=compression).numpy(), sizes)
    return hvd.rank(), hvd.size(), result


def tf_worker(sizes):
    import tensorflow as tf

    import tfdist.strategies
    plugin = tfdist.strategies.get("multi_worker_mirrored", cross_device_ops="ring")
    strategy = plugin.tf_strategy

    @tf.function
    def all_reduce(x):
        return strategy.run(lambda v: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.identity(v)), args=(x,))  # placed on the replica

    def call(x):
        return strategy.experimental_local_results(all_reduce(x))[0].numpy()

    return plugin.worker_index, plugin.num_workers, _time(call, sizes)


def run_worker():
    sizes = [float(s) for s in _SIZES.value]
    rank, n, result = (horovod_worker if _WORKER.value == "horovod" else tf_worker)(sizes)
    if rank == 0:
        print("RESULT " + json.dumps({"n": n, "seconds": {str(k): v for k, v in result.items()}}),
              flush=True)


def _run(cmd, net=None):
    if net is None:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    else:  # on host 0, which reaches host 1 through the cluster's ssh
        env = {**os.environ, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"]}
        p = net.run(0, cmd, timeout=1800, cwd=ROOT, env=env)
    lines = [x for x in p.stdout.splitlines() if "RESULT " in x]
    if p.returncode or not lines:
        sys.exit(f"bench_allreduce: {' '.join(cmd[:6])} failed (exit {p.returncode}):\n"
                 f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return json.loads(lines[-1].split("RESULT ", 1)[1])


def main(argv):
    del argv
    if _WORKER.value:
        return run_worker()
    import numpy as np

    from tfdist.strategies.horovod import horovodrun_argv
    me = [sys.executable, os.path.abspath(__file__), f"--sizes_mb={','.join(_SIZES.value)}",
          f"--iters={_ITERS.value}", f"--warmup={_WARMUP.value}"]
    net = None
    if _LINK.value:
        from tools.cluster.netcluster import NetCluster
        net = NetCluster(2, rate=_LINK.value).up()
    hosts = [net.address(0), net.address(1)] if net else None
    where = [f"--hosts={','.join(hosts)}"] if net else []
    variants = {
        "horovod/gloo": horovodrun_argv(2, me + ["--worker=horovod"], hosts),
        "horovod/gloo fp16": horovodrun_argv(2, me + ["--worker=horovod", "--compression=fp16"],
                                             hosts),
        "tf ring (MWMS)": [sys.executable, "-m", "tfdist", "launch", *where, "--workers=2",
                           "--max_restarts=0", "--", *me, "--worker=tf"],
    }
    runs = {name: [] for name in variants}
    try:
        for r in range(_ROUNDS.value):
            for name, cmd in variants.items():
                runs[name].append(_run(cmd, net))
                print(f"round {r + 1}: {name} done", flush=True)
    finally:
        if net:
            net.down()
    rows = []
    for mb in _SIZES.value:
        row = {"size_mb": float(mb)}
        for name, results in runs.items():
            n = results[0]["n"]
            t = float(np.median([x["seconds"][str(float(mb))] for x in results]))
            algbw = float(mb) * 2 ** 20 / t
            row[name] = {"seconds": t, "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * 2 * (n - 1) / n / 1e9}
        rows.append(row)
    names = list(variants)
    where = f"2 hosts on {_LINK.value} links" if _LINK.value else "2 processes on 127.0.0.1"
    print(f"\nallreduce (SUM, float32), {where}, bus bandwidth in GB/s "
          f"(median of {_ROUNDS.value} rounds x {_ITERS.value} calls)")
    print(f"{'size':>7s} " + " ".join(f"{n:>20s}" for n in names) + f" {'hvd/tf':>7s}")
    for row in rows:
        bw = [row[n]["busbw_GBps"] for n in names]
        print(f"{row['size_mb']:4g}MiB " + " ".join(f"{b:13.3f} ({row[n]['seconds'] * 1e3:5.1f}ms)"
                                                    for b, n in zip(bw, names))
              + f" {bw[0] / bw[2]:7.2f}")
    result = {"processes": 2, "rounds": _ROUNDS.value, "iters": _ITERS.value, "rows": rows,
              "link": _LINK.value or "loopback"}
    # the planner's model: a ring's bus bandwidth is the link's (fp16: 2x, effective)
    if _LINK.value:
        from tools.cluster.netcluster import _bits
        link = _bits(_LINK.value) / 8 / 1e9
        result["planner_busbw_GBps"] = {n: link * (2 if "fp16" in n else 1) for n in names}
        big = rows[-1]
        print("planner (ring at the link's rate): " + ", ".join(
            f"{n} {result['planner_busbw_GBps'][n]:.3f} GB/s "
            f"({result['planner_busbw_GBps'][n] / big[n]['busbw_GBps'] - 1:+.0%} at "
            f"{big['size_mb']:g} MiB)" for n in names))
    out = _OUT.value
    if _LINK.value and out == "bench_results/allreduce.json":
        out = f"bench_results/allreduce-{_LINK.value}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    cli.run(main, sys.argv)
