"""Time to resume after a node loss, and to grow back, under Ray (`tfdist launch --engine=ray`)
and under `tfdist launch`'s own elastic path, in one run (root: network namespaces).

    python tools/bench/node_loss.py                 # MWMS, 2 rounds (make bench-node-loss)
    python tools/bench/node_loss.py --strategy=horovod --rounds=1

Each round runs the same trial under each engine, alternately, on 3 fresh hosts
(tools/cluster/netcluster.py, 1 Gbit/s links): gpt_nano, 2 workers (min 1, max 2), a backup
every 5 steps; at step `--kill_at` every process of the second worker's host is SIGKILLed and
its link cut; at step 50 a host is offered again.
* **tfdist**: tools/faults/chaos_elastic.py's trial: hosts 0 and 1 in a discovery file, host 2
  added to it (the launcher looks every second).
* **Ray**: tools/faults/chaos_ray.py's trial: a head on host 0, nodes on hosts 1 and 2; node 2
  killed (its `ray start`, raylet and workers) and started again (Ray looks every 5 s).

Time to resume: from the kill to the start of the first step the 1-worker group runs. Time to
grow: from the offer (Ray: the node running again) to the start of the first step at 2 workers.
Logged after backup: for each restart, the steps metrics.json held after the backup it resumed
from (a lower bound of the steps run again: tools/faults/chaos_ray.py). Grow resumed where it
stopped (Ray): the 1-worker group stopped for the grow at one step, backed up, and the group of 2
resumed at that step (tfdist's own path backs up at a resize by design). The ratios are
Ray's time over tfdist's, per round (this machine is noisy: only ratios within a round count).

Prints a table and writes bench_results/node-loss-<strategy>.json.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.bench.common import host  # noqa: E402
from tools.cluster.netcluster import NetCluster  # noqa: E402
from tools.cluster.ray_cluster import RayCluster  # noqa: E402
from tools.faults.chaos_elastic import elastic_trial  # noqa: E402
from tools.faults.chaos_partition import prepare_data  # noqa: E402
from tools.faults.chaos_ray import (  # noqa: E402
    STEPS,
    grow_lossless,
    logged_after_backup,
    ray_trial,
)


def tfdist_run(work, data_dir, strategy, at):
    with NetCluster(3, rate="1gbit") as net:
        r = elastic_trial(net, work, data_dir, strategy, at, steps=STEPS)
    resumed = r["resumed_at"]
    r["before_join"] = None  # (tfdist backs up at the grow: it resumes where it stopped)
    r["resumed_at"] = sorted(set(resumed))
    r["stopped_for_grow"] = None
    return r


def ray_run(work, data_dir, strategy, at):
    with NetCluster(3, rate="1gbit") as net, RayCluster(net) as nodes:
        return ray_trial(net, nodes, work, data_dir, strategy, at)


def figures(engine, r, wall):
    steps = [x["step"] for x in r["rows"]]
    return {"engine": engine, "exit": r["exit"], "kill_at_step": r["cut_at"],
            "resume_s": r["continued_s"], "grow_s": r["joined_s"],
            "resumed_at": r["resumed_at"], "logged_after_backup": logged_after_backup(r),
            "stopped_for_grow": r["stopped_for_grow"],
            "grow_lossless": (grow_lossless(r)["grow lossless"] if r["stopped_for_grow"] is not None
                              else None),
            "steps_once": steps == list(range(1, STEPS + 1)), "wall_s": round(wall, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="multi_worker_mirrored",
                    choices=["multi_worker_mirrored", "horovod"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kill_at", type=int, default=20)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tfdist-node-loss-")
    data_dir = prepare_data(os.path.join(tmp, "data"))
    rows = []
    for k in range(args.rounds):
        for engine, trial in (("tfdist", tfdist_run), ("ray", ray_run)):
            t = time.monotonic()
            r = trial(os.path.join(tmp, f"{engine}{k}"), data_dir, args.strategy, args.kill_at)
            rows.append({"round": k, **figures(engine, r, time.monotonic() - t)})
            print(json.dumps(rows[-1]), flush=True)
            if r["exit"] != 0 or r["continued_s"] is None:
                with open(os.path.join(tmp, f"{engine}{k}.log"), "w") as f:
                    f.write(r["output"])
                sys.exit(f"bench: the {engine} run failed (exit {r['exit']}); its output: "
                         f"{tmp}/{engine}{k}.log")
    ratios = {key: [round(ray[key] / mine[key], 2) for mine, ray in zip(rows[::2], rows[1::2])
                    if mine[key] and ray[key]] for key in ("resume_s", "grow_s")}
    print(f"\ngpt_nano, {args.strategy}, 2 -> 1 -> 2 workers on 3 hosts (1 Gbit/s), a backup "
          f"every 5 steps, killed at step {args.kill_at}\n")
    print("| round | engine | time to resume | time to grow | logged after backup | grow resumed "
          "where it stopped | steps once |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['engine']} | {r['resume_s']} s | {r['grow_s']} s | "
              f"{','.join(map(str, r['logged_after_backup'])) or '-'} | "
              f"{ {None: '-', True: 'yes', False: 'NO'}[r['grow_lossless']]} | "
              f"{'yes' if r['steps_once'] else 'NO'} |")
    print(f"\nRay / tfdist, per round: resume {ratios['resume_s']}, grow {ratios['grow_s']}")
    out = os.path.join(ROOT, "bench_results", f"node-loss-{args.strategy}.json")
    with open(out, "w") as f:
        json.dump({"strategy": args.strategy, "config": "configs/gpt_nano.py", "steps": STEPS,
                   "kill_at_step": args.kill_at, "link": "1gbit", "rows": rows,
                   "ray_over_tfdist": ratios,
                   "median_ray_over_tfdist": {k: statistics.median(v) if v else None
                                              for k, v in ratios.items()}, "host": host()},
                  f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
