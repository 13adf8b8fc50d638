"""Benchmark: the bytes that cross the hosts' links, counted at the links (`make bench-links`).

    python tools/bench/links.py --link=1gbit                    # multi_worker_mirrored
    python tools/bench/links.py --link=1gbit --horovod
    python tools/bench/links.py --link=100mbit --runs=flat_host_order,hierarchy

gpt_mini on 2 hosts of tools/cluster/netcluster.py (network namespaces on a bridge, each host's
link shaped to --link; root) with 2 workers each, through `tfdist launch --hosts`. Each run
trains --warmup + --steps steps; a thread reads every host's link counters (`ip -s link`: the
bytes its eth0 sent and received) every 0.25 s, and a run's bytes per step are those between the
end of its first timed step and the end of its last, over the steps between (each step's end
from the run's metrics.json), so start-up, the first broadcast of the weights and validation are
not counted. Runs:

* `flat_host_order`: the strategy's flat ring, workers placed a, a, b, b (the ring crosses
  between the hosts twice);
* `flat_interleaved`: the same ring, workers placed a, b, a, b (every hop crosses);
* `hierarchy`: `dp.hierarchy=host` (tfdist/parallel/dp/hierarchy.py), placed a, b, a, b.
* `bf16`: `dp.compression=bf16` (tfdist/parallel/dp/compression.py: an all-to-all and an
  all-gather of bfloat16 over every worker), placed a, a, b, b;
* `powersgd`: `dp.compression=powersgd`, rank 4, from the second step (two all-reduces of P
  and Q over every worker), placed a, a, b, b.
* `islands`: `tfdist launch --islands=2`, an island of 2 workers on each host (DiLoCo, a sync
  every 50 updates, int8 deltas; the exchange on host a), timed over --island_steps steps (2
  syncs); its tokens/s is both islands'.

Each row beside the arithmetic: S the gradients' bytes (parameters x 4), a host's link carries at
least 2(H-1)/H x S per step for every host to hold the sum (H hosts: S for 2), a flat ring of N
workers 2(N-1)/N x S out of each worker, on each hop that crosses. The compressed runs have no
arithmetic row: their bytes are given against the flat ring in host order's (`x plain`, when it
ran). Writes bench_results/links[-horovod]-<link>.json.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import (  # noqa: E402
    HOROVOD,
    INTER,
    LINK,
    STEPS,
    WARMUP,
    config,
    config_filename,
    params,
    train_flags,
    write_json,
)
from tools.faults import harness  # noqa: E402

POWERSGD_RANK = 4
ISLANDS_H = 50
_ISLAND_STEPS = flags.DEFINE_integer(
    "island_steps", 2 * ISLANDS_H, "Timed steps of the islands run (it must span syncs: its "
    "bytes come every sync_every steps).")
RUNS = {  # name -> (placement of the 4 workers on hosts 0 and 1, config overrides)
    "flat_host_order": ((0, 0, 1, 1), ["--config.dp.hierarchy=flat"]),
    "flat_interleaved": ((0, 1, 0, 1), ["--config.dp.hierarchy=flat"]),
    "hierarchy": ((0, 1, 0, 1), ["--config.dp.hierarchy=host"]),
    "bf16": ((0, 0, 1, 1), ["--config.dp.compression=bf16"]),
    "powersgd": ((0, 0, 1, 1), ["--config.dp.compression=powersgd",
                                f"--config.dp.powersgd_rank={POWERSGD_RANK}",
                                "--config.dp.powersgd_start=1"]),
    # two islands of 2 workers, one on each host (DiLoCo): a sync every ISLANDS_H updates
    "islands": ((0, 0, 1, 1), ["--config.dp.islands=2", f"--config.dp.sync_every={ISLANDS_H}",
                               "--config.dp.exchange=int8"]),
}
ISLAND_RUNS = ("islands",)
_RUNS = flags.DEFINE_list("runs", list(RUNS), "Which runs, of: " + ", ".join(RUNS) + ".")
HOSTS, PER_HOST = 2, 2


class Counters:
    """Every 0.25 s, (time, [(tx, rx) bytes of each host's eth0]), in a thread."""

    def __init__(self, net):
        self.net, self.samples, self.stop = net, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def read(self):
        out = []
        for i in range(self.net.n):
            text = subprocess.run(["ip", "-n", self.net.ns(i), "-j", "-s", "link", "show", "eth0"],
                                  capture_output=True, text=True, timeout=10).stdout
            stats = json.loads(text)[0]["stats64"]
            out.append((stats["tx"]["bytes"], stats["rx"]["bytes"]))
        return out

    def _run(self):
        while not self.stop.is_set():
            self.samples.append((time.time(), self.read()))
            self.stop.wait(0.25)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=10)

    def at(self, when):
        """The counters at `when`, linear between the samples around it."""
        before = [s for s in self.samples if s[0] <= when][-1]
        after = next(s for s in self.samples if s[0] >= when)
        if after[0] == before[0]:
            return before[1]
        f = (when - before[0]) / (after[0] - before[0])
        return [tuple(b + f * (a - b) for b, a in zip(x, y)) for x, y in zip(before[1], after[1])]


def one_run(name, workdir):
    """One run: (tokens/s, [(tx, rx) bytes per step of each host], launcher stdout)."""
    from tools.cluster.netcluster import NetCluster
    placement, extra = RUNS[name]
    islands = 2 if name in ISLAND_RUNS else 1
    steps = WARMUP.value + (_ISLAND_STEPS.value if islands > 1 else STEPS.value)
    c = config()
    rest = train_flags(workdir, steps, c.train.batch_size * len(placement), INTER.value,
                       [*extra, "--config.train.log_every_steps=1"])
    strategy = "horovod" if HOROVOD.value else "multi_worker_mirrored"
    with NetCluster(HOSTS, rate=LINK.value) as net:
        hosts = ",".join(net.address(h) for h in placement)
        cmd = harness.launch_argv(rest, strategy=strategy, workers=len(placement),
                                  max_restarts=0, extra=[f"--hosts={hosts}",
                                                         f"--islands={islands}"])
        env = {**os.environ, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"]}
        with Counters(net) as counters:
            p = net.run(0, cmd, timeout=3600, env=env, cwd=harness.ROOT)
        if p.returncode:
            sys.exit(f"bench: {name} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n"
                     f"{p.stderr[-2000:]}")
    logs = [harness.metrics(os.path.join(workdir, f"island-{k}") if islands > 1 else workdir)
            ["steps"] for k in range(islands)]
    log = logs[0]  # (island 0's steps time the bytes)
    first, last = log[WARMUP.value - 1], log[-1]
    n = last["step"] - first["step"]
    a, b = counters.at(first["time"]), counters.at(last["time"])
    per_step = [((bt - at) / n, (br - ar) / n) for (at, ar), (bt, br) in zip(a, b)]
    # tokens/s: every island's (the median of each, summed)
    tps = 0.0
    for island_log in logs:
        rates = sorted(s["tokens_per_sec"] for s in island_log[WARMUP.value:])
        tps += rates[len(rates) // 2]
    return tps, per_step, p.stdout


def main(argv):
    del argv
    if not LINK.value:
        sys.exit("bench: --link is required (1gbit, 100mbit, ...): the bytes are counted at "
                 "tools/cluster/netcluster.py's links (root)")
    for name in _RUNS.value:
        if name not in RUNS:
            sys.exit(f"bench: unknown run {name!r}; runs: {', '.join(RUNS)}")
    tmp = tempfile.mkdtemp(prefix="tfdist-links-")
    rows, gradient_bytes = [], None
    n = HOSTS * PER_HOST
    for name in _RUNS.value:
        tps, per_step, stdout = one_run(name, os.path.join(tmp, name))
        gradient_bytes = gradient_bytes or 4 * params(stdout)
        s = gradient_bytes
        placement = RUNS[name][0]
        crossing = sum(placement[i] != placement[(i + 1) % n] for i in range(n)) // HOSTS
        expected = {"hierarchy": 2 * (HOSTS - 1) / HOSTS * s, "bf16": None, "powersgd": None,
                    "islands": None}.get(name, crossing * 2 * (n - 1) / n * s)  # per host
        tx = max(t for t, _ in per_step)
        predicted = _predicted(name, placement)
        plain = next((max(r["tx_bytes_per_step"]) for r in rows
                      if r["run"] == "flat_host_order"), None)
        rows.append({"run": name, "placement": "".join("ab"[h] for h in placement),
                     "tokens_per_sec": tps, "tx_bytes_per_step": [t for t, _ in per_step],
                     "rx_bytes_per_step": [r for _, r in per_step],
                     "arithmetic_bytes_per_step": expected,
                     "tx_over_arithmetic": tx / expected if expected else None,
                     "tx_over_minimum": tx / (2 * (HOSTS - 1) / HOSTS * s),
                     "predicted_bytes_per_step": predicted,
                     "tx_over_predicted": tx / predicted,
                     "tx_over_plain": tx / plain if plain else None})
        print(f"{name:18s} {tps:8.0f} tokens/s; each host's link sends "
              f"{' / '.join(f'{t / 1e6:.1f}' for t, _ in per_step)} MB a step"
              + (f"; the arithmetic {expected / 1e6:.1f} MB ({tx / expected:.3f}x)"
                 if expected else "")
              + (f"; {tx / plain:.3f}x the flat ring in host order's" if plain else ""),
              flush=True)
    strategy = "horovod" if HOROVOD.value else "multi_worker_mirrored"
    print(f"\n{os.path.basename(config_filename())} on {HOSTS} hosts x {PER_HOST} workers, "
          f"{LINK.value} links, {strategy}; S = {gradient_bytes / 1e6:.1f} MB of gradients")
    print(f"{'run':18s} {'place':>6s} {'tokens/s':>9s} {'MB/step out of a host':>22s} "
          f"{'predicted':>10s} {'x minimum':>10s} {'x plain':>8s}")
    for r in rows:
        plain, predicted = r["tx_over_plain"], r.get("predicted_bytes_per_step")
        print(f"{r['run']:18s} {r['placement']:>6s} {r['tokens_per_sec']:9.0f} "
              f"{max(r['tx_bytes_per_step']) / 1e6:22.1f} "
              f"{predicted / 1e6 if predicted else float('nan'):10.1f} "
              f"{r['tx_over_minimum']:10.3f} {plain if plain else float('nan'):8.3f}")
    path = f"bench_results/links{'-horovod' if HOROVOD.value else ''}-{LINK.value}.json"
    from tools.cluster.netcluster import _bits
    rows = predicted_rates(merged(path, rows),
                           n * config().train.batch_size * config().model.block_size,
                           _bits(LINK.value) / 8)
    print(f"{'run':18s} {'tokens/s':>9s} {'planner':>9s}")
    for r in rows:
        print(f"{r['run']:18s} {r['tokens_per_sec']:9.0f} "
              f"{r.get('predicted_tokens_per_sec') or float('nan'):9.0f}")
    write_json({"config": os.path.basename(config_filename()), "strategy": strategy,
                "link": LINK.value, "hosts": HOSTS, "workers_per_host": PER_HOST,
                "batch_per_worker": config().train.batch_size, "steps": STEPS.value,
                "warmup": WARMUP.value, "gradient_bytes": gradient_bytes,
                "minimum_bytes_per_host": 2 * (HOSTS - 1) / HOSTS * gradient_bytes,
                "rows": rows}, path)


def _predicted(name, placement):
    """The planner's bytes out of the busiest host a step for run `name` (tfdist.plan.comm)."""
    from tfdist.plan import comm, load_config, model_from_config
    model = model_from_config(load_config(config_filename()), "bench")
    n = len(placement)
    interleaved = all(placement[i] != placement[(i + 1) % n] for i in range(n))
    route = {"flat_host_order": "flat", "flat_interleaved": "flat"}.get(name, name)
    return comm.routes(model, HOSTS, PER_HOST, rank=POWERSGD_RANK, sync_every=ISLANDS_H,
                       order="interleaved" if interleaved else "hosts")[route]


def predicted_rates(rows, tokens_per_step, rate):
    """`rows` with the planner's tokens/s for each (tfdist.plan.comm.step_seconds): every run
    computes the same on the same cores (4 workers), so the compute is the least that any run's
    step leaves after its predicted bytes at the link's rate (bytes/s; that run is fitted, the
    others predicted), and each run adds its own bytes."""
    from tfdist.plan import comm
    compute = min(tokens_per_step / r["tokens_per_sec"] - r["predicted_bytes_per_step"] / rate
                  for r in rows)
    steps = comm.step_seconds(compute, {r["run"]: r["predicted_bytes_per_step"] for r in rows},
                              rate)
    for r in rows:
        r["predicted_tokens_per_sec"] = tokens_per_step / steps[r["run"]]
        r["tokens_over_predicted"] = r["tokens_per_sec"] / r["predicted_tokens_per_sec"]
    return rows


def merged(path, rows):
    """`rows`, and the rows of other runs that `path` (the JSON of an earlier run of this bench,
    with the same config, strategy and link) holds, in RUNS' order: --runs=a,b measures a and b
    again and keeps the rest."""
    try:
        with open(os.path.join(harness.ROOT, path)) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return rows
    if old.get("config") != os.path.basename(config_filename()):
        return rows
    ran = {r["run"] for r in rows}
    kept = [r for r in old.get("rows", []) if r["run"] not in ran and r["run"] in RUNS]
    rows = sorted(rows + kept, key=lambda r: list(RUNS).index(r["run"]))
    plain = next((max(r["tx_bytes_per_step"]) for r in rows if r["run"] == "flat_host_order"),
                 None)
    for r in rows:
        if plain and r["run"] != "flat_host_order":
            r["tx_over_plain"] = max(r["tx_bytes_per_step"]) / plain
    return rows


if __name__ == "__main__":
    app.run(main)
