"""What a lost host costs: the seconds from its death to the first step trained after it, and the
steps trained twice, with a spare, without one, and with cold workers, in one run (root: network
namespaces).

    python tools/bench/node_loss.py                  # MWMS, 5 rounds (make bench-node-loss)
    python tools/bench/node_loss.py --strategy=horovod
    python tools/bench/node_loss.py --variants=ray,elastic --rounds=2    # the grow-back bench

**Spares** (the default variants; bench_results/node-loss-spares-<strategy>.json). Each round
runs, in turn, on 3 fresh hosts (tools/cluster/netcluster.py, 1 Gbit/s links) the fault driver
(gpt_nano, tools/faults/chaos_spares.py's STEPS steps, a backup every 5) as 2 workers started on
host 0, and SIGKILLs every process of host 1 (its link cut for good) at a seeded step:
* **spare**: `--hosts=h0,h1,h2 --spares=1`, warm: host 2 takes host 1's place at once, with the
  state of host 0's memory;
* **shrink**: no spare (`--min_workers=1 --max_workers=2`, hosts 0 and 1), warm: the group waits
  `--rejoin_timeout` (10 s) for host 1, then goes on with 1 worker, with the state of host 0's
  memory;
* **cold**: as spare, with `--cold`: every process imports TensorFlow, Keras and tfdist itself.
Time to the first step: from the kill to the start of the first step logged after it. Steps
trained twice: worker 0's executed steps beyond STEPS (0: the state of the newest step every
survivor completed). Ratios are each variant's time over spare's, within a round.

**Grow back** (`--variants=ray,elastic`; bench_results/node-loss-<strategy>.json), the bench of
before the spares: Ray (`tfdist launch --engine=ray`) against tfdist's own elastic path:

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

Prints a table and writes its JSON.
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
from tools.faults import chaos_spares  # noqa: E402
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


def spares_trial(variant, work, data_dir, strategy, at):
    """One lost host under `variant` (spare, shrink, cold: the module doc); the trial's record."""
    s = chaos_spares
    o = s.overrides(data_dir, strategy)
    with NetCluster(3, rate="1gbit") as net:
        run = s.launch(net, work, o, workers=(0, 1), spares=() if variant == "shrink" else (2,),
                       elastic=variant == "shrink", extra=["--cold"] if variant == "cold" else [])
        killed = None
        if run.wait(lambda: s.steps_done(work) >= at):
            killed = s.lose(net, [1])
            at = s.steps_done(work)
        r = s.outcome(run, work, killed)
    return r, at


def spares_main(args, variants):
    """The spares bench (module doc): `variants` in turn, `args.rounds` rounds."""
    import random
    s = chaos_spares
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="tfdist-node-loss-")
    data_dir = prepare_data(os.path.join(tmp, "data"))
    reference = s.reference_losses(tmp, data_dir, s.overrides(data_dir, args.strategy))
    rows = []
    for k in range(args.rounds):
        at = rng.randint(20, 60)
        for variant in variants:
            work = os.path.join(tmp, f"{variant}{k}")
            t = time.monotonic()
            r, killed_at = spares_trial(variant, work, data_dir, args.strategy, at)
            with open(work + ".log", "w") as f:
                f.write(r["output"])
            checks, diff = s.verdict(r, work, reference, replicas=1 if variant == "shrink" else 2)
            rows.append({"round": k, "variant": variant, "kill_at_step": killed_at,
                         "first_step_after_s": r["resume_s"], "steps_twice": r["twice"],
                         "resumed": r["resumed"], "exit": r["exit"], "max_loss_diff": diff,
                         **{c.replace(" ", "_"): v for c, v in checks.items()},
                         "wall_s": round(time.monotonic() - t, 1),
                         "passed": all(checks.values())})
            print(json.dumps(rows[-1]), flush=True)
            if not rows[-1]["passed"]:
                print(f"{r['output'][-3000:]}\n(all of it: {work}.log)", flush=True)
    by = {v: [r for r in rows if r["variant"] == v] for v in variants}
    summary = {}
    for v, rs in by.items():
        times = [r["first_step_after_s"] for r in rs if r["first_step_after_s"] is not None]
        summary[v] = {"median_s": statistics.median(times) if times else None,
                      "max_s": max(times) if times else None,
                      "steps_twice": [r["steps_twice"] for r in rs],
                      "passed": sum(r["passed"] for r in rs), "trials": len(rs)}
    ratios = {v: [round(a["first_step_after_s"] / b["first_step_after_s"], 2)
                  for a, b in zip(by[v], by[variants[0]])
                  if a["first_step_after_s"] and b["first_step_after_s"]] for v in variants[1:]}
    print(f"\ngpt_nano, {args.strategy}, 2 workers on 3 hosts (1 Gbit/s), a backup every "
          f"{s.EVERY} steps; one host SIGKILLed and cut off mid-run\n")
    print("| round | variant | killed at step | first step after | steps twice | resumed | "
          "passed |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['variant']} | {r['kill_at_step']} | "
              f"{r['first_step_after_s']} s | {r['steps_twice']} | "
              f"{', '.join(f'{w} {n}' for w, n in r['resumed'])} | "
              f"{'yes' if r['passed'] else 'NO'} |")
    print("\n| variant | median | max | steps twice | passed |\n|---|---|---|---|---|")
    for v, x in summary.items():
        print(f"| {v} | {x['median_s']} s | {x['max_s']} s | {x['steps_twice']} | "
              f"{x['passed']} of {x['trials']} |")
    print(f"\nover {variants[0]}, per round: " + "; ".join(f"{v} {r}" for v, r in ratios.items()))
    out = os.path.join(ROOT, "bench_results", f"node-loss-spares-{args.strategy}.json")
    with open(out, "w") as f:
        json.dump({"strategy": args.strategy, "config": "configs/gpt_nano.py",
                   "steps": s.STEPS, "backup_every": s.EVERY, "link": "1gbit",
                   "variants": variants, "rows": rows, "summary": summary,
                   f"over_{variants[0]}": ratios,
                   "median_over_spare": {v: statistics.median(r) if r else None
                                         for v, r in ratios.items()},
                   "host": host()}, f, indent=1)
    print(f"wrote {out}")
    return 0 if all(r["passed"] for r in rows) else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="multi_worker_mirrored",
                    choices=["multi_worker_mirrored", "horovod"])
    ap.add_argument("--variants", default="spare,shrink,cold",
                    help="spare, shrink, cold (the spares bench), or ray,elastic (grow back)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kill_at", type=int, default=20, help="grow back: the step of the kill")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    variants = args.variants.split(",")
    if set(variants) <= {"spare", "shrink", "cold"}:
        return spares_main(args, variants)
    if set(variants) != {"ray", "elastic"}:
        ap.error("--variants: spare, shrink and cold, or ray and elastic")
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
