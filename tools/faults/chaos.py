"""Chaos trials for `tfdist launch`: SIGKILL a worker and check how the run ends.

    python tools/faults/chaos.py                       # 5 trials, 2 workers, gpt_nano, 30 steps
    python tools/faults/chaos.py --trials=10 --seed=1 --workers=3
    python tools/faults/chaos.py --strategy=parameter_server      # 5 trials, 2 workers + 1 ps,
                                                                  # 600 steps
    python tools/faults/chaos.py --strategy=horovod    # 5 trials, 2 Horovod ranks (horovodrun),
                                                       # 30 steps
    python tools/faults/chaos.py --strategy=horovod --zero=1   # the same under ZeRO-1
                                                               # (chaos-zero.json)
    python tools/faults/chaos.py --zero=1              # ZeRO-1 under multi_worker_mirrored
                                                       # (chaos-zero-mwms.json)
    python tools/faults/chaos.py [--strategy=horovod] --zero=3  # ZeRO-3 (chaos-zero3[-mwms].json)
    python tools/faults/chaos.py --strategy=horovod --zero=3 --offload=disk \
        --fault=kill_in_offload                        # chaos-offload.json

multi_worker_mirrored and horovod (synchronous):
First one uninterrupted run is the reference. Then each trial picks a step at random (seeded)
and a worker in turn (worker 0, the chief, first). That worker SIGKILLs itself right after the
step (tools/faults/faulty_train.py), the launcher stops the group and restarts it, and training
resumes from the survivors' snapshots in memory (or the backup: the same step). A backup is
written after every step, with op determinism and dropout on. A trial passes when the launcher
exits 0 after exactly one restart, every worker executed
exactly the planned steps (none lost, none repeated), and the final weights are bitwise equal to
the reference's.

parameter_server (asynchronous): each trial SIGKILLs a worker (in turn) at a random time (seeded,
1-6 s into training). The launcher restarts that worker alone and it rejoins. A trial passes when
the run completes (exit 0), the counted steps equal the planned steps, the runs summed over the
workers exceed them by no more than the steps that were in flight (TF's coordinator re-runs a
closure whose worker died: at least once), and no gap between two progress reports exceeds 60 s.

--fault=kill_in_write (asynchronous backups): the chief is SIGKILLed while a background write
is in flight, seen from its files; the run must resume from the backup before it
(`write_trials`; chaos-write-<strategy>.json).

--fault=kill_in_offload (with --offload=host|disk): a worker is SIGKILLed during the offloaded
optimizer step of a random update U, once the writes of a random sub-group of it have started
(its store's files half written). The restarted group resumes from the backup of step U - 1 (its
store is rebuilt from there); a trial passes when the launcher exits 0 after one restart, the
run resumed at step U - 1, and the final weights are bitwise the reference's (the killed step's
work done again).

--fault=sigterm (preemption; also --strategy=single): the worker gets SIGTERM while the step
runs. Every process backs up that step and exits 75 (tfdist/runtime/preemption.py); the launcher
restarts the group (a single process is run again), and the run resumes at that step. Backups are
written at epoch ends only, so the resumed step is the signal's own backup. Passes as above.

Under the parameter server, --fault=sigterm sends SIGTERM to `tfdist launch` at a random time
(seeded, 1-6 s into training, 600 steps, backups at epoch ends only): the coordinator drains the
steps in flight and backs them up, every process exits 75, and the same command, run again,
must resume at that step and count exactly the planned steps.

Prints a table and writes bench_results/chaos.json (chaos-ps.json, chaos-horovod.json,
chaos-sigterm-<strategy>.json). Exit status 1 if a trial fails.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tools.faults.harness import (  # noqa: E402
    driver_argv,
    final_weights,
    launch_argv,
    metrics,
    steps_by_worker,
)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def launch(workdir, overrides, workers, *extra):
    if overrides["strategy.name"] == "single":  # one process, run again by hand after exit 75
        return single(workdir, overrides, *extra)
    cmd = launch_argv(driver_argv(workdir, overrides, *extra), strategy=overrides["strategy.name"],
                      workers=workers)
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    return p, time.monotonic() - t


def single(workdir, overrides, *extra):
    """The driver, and once more if it exited 75 (preempted), as a scheduler would requeue it.
    Returns a CompletedProcess whose stdout counts its starts as the launcher's would."""
    t = time.monotonic()
    out = ""
    err = ""
    for attempt in range(2):
        p = subprocess.run(driver_argv(workdir, overrides, *(extra if attempt == 0 else ())),
                           capture_output=True, text=True, timeout=900, cwd=ROOT)
        out += "tfdist launch: started 1 process\n" + p.stdout
        err += p.stderr
        if p.returncode != 75:
            break
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), time.monotonic() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--data_dir", default="", help="TFDS data_dir (default ~/tensorflow_datasets)")
    ap.add_argument("--strategy", default="multi_worker_mirrored",
                    choices=["multi_worker_mirrored", "parameter_server", "horovod", "single"])
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                    help="ZeRO stage, synchronous strategies (each replica backs up its optimizer "
                         "shard; stage 3: and its weights)")
    ap.add_argument("--offload", default="none", choices=["none", "host", "disk"],
                    help="ZeRO-Offload of the replicas' state (with --zero)")
    ap.add_argument("--fault", default="kill",
                    choices=["kill", "sigterm", "kill_in_write", "kill_in_offload"],
                    help="kill: SIGKILL after a step; sigterm: preemption during a step (the run "
                         "backs up that step and exits 75)")
    ap.add_argument("--out", default=None, help="default bench_results/chaos.json (chaos-ps.json, "
                    "chaos-horovod.json, chaos-zero.json, chaos-zero-mwms.json, "
                    "chaos-sigterm-<strategy>.json)")
    args = ap.parse_args()
    if args.strategy == "parameter_server":
        return ps_trials(args) if args.fault == "kill" else ps_preempt_trials(args)
    mwms = args.strategy == "multi_worker_mirrored"
    if (args.fault == "kill_in_offload") != (args.offload != "none") or \
            (args.offload != "none" and not args.zero):
        ap.error("--fault=kill_in_offload goes with --offload=host|disk, which needs --zero")
    args.out = args.out or os.path.join(ROOT, "bench_results", (
        "chaos-offload.json" if args.fault == "kill_in_offload" else
        f"chaos-sigterm-{args.strategy}.json" if args.fault == "sigterm" else
        f"chaos-write-{args.strategy}.json" if args.fault == "kill_in_write" else
        (f"chaos-zero{'3' * (args.zero == 3)}-mwms.json" if args.zero else "chaos.json") if mwms
        else f"chaos-zero{'3' * (args.zero == 3)}.json" if args.zero else "chaos-horovod.json"))
    if args.steps < 4 or args.steps % 10 or args.workers < 1 or args.trials < 1:
        ap.error("--steps must be a multiple of 10 (>= 10); --workers and --trials >= 1")

    overrides = {"train.steps": args.steps, "train.steps_per_epoch": 10, "train.batch_size": 16,
                 "train.deterministic": True, "train.eval_steps": 2, "model.dropout": 0.1,
                 "backup.every_steps": 1, "strategy.name": args.strategy, "zero.stage": args.zero}
    if args.fault == "sigterm":  # backups at epoch ends only: the signal's backup is the one used
        overrides["backup.every_steps"] = 0
    if args.fault == "kill_in_write":  # slow writes (tools/faults/faulty_train.py --slow-write)
        overrides["backup.every_steps"] = 5
        # the disk's own fault: without the survivors' memory (tfdist/callbacks/memory.py), which
        # would restore the newer step the others completed (tools/faults/chaos_spares.py)
        overrides["backup.memory_every_steps"] = 0
    if args.offload != "none":  # (sub-groups of 10,000 parameters: several per update)
        overrides.update({"zero.offload": args.offload, "zero.offload_subgroup": 10000})
    if args.strategy == "single":
        args.workers = 1
    if args.data_dir:
        overrides["data.data_dir"] = args.data_dir
    plan = {w: args.steps for w in range(args.workers)}
    tmp = tempfile.mkdtemp(prefix="tfdist-chaos-")
    ref_dir = os.path.join(tmp, "reference")
    p, seconds = launch(ref_dir, overrides, args.workers)
    if p.returncode or steps_by_worker(ref_dir) != plan:
        sys.exit(f"chaos: the reference run failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n"
                 f"{p.stderr[-2000:]}")
    reference = final_weights(ref_dir)
    print(f"reference: {args.strategy}, {args.workers} workers, {args.steps} steps, "
          f"{seconds:.1f} s", flush=True)

    rng = random.Random(args.seed)
    rows = []
    if args.fault == "kill_in_write":
        return report(args, *write_trials(args, overrides, plan, tmp, reference, rng))
    if args.fault == "kill_in_offload":
        return report(args, *offload_trials(args, overrides, tmp, reference, rng))
    for trial in range(args.trials):
        worker = trial % args.workers  # chief, then others
        step = rng.randint(1, args.steps - 1)
        d = os.path.join(tmp, f"trial{trial}")
        fault = (["--kill-at-step", str(step)] if args.fault == "kill" else
                 ["--signal-at-step", str(step), "--signal", "TERM"])
        p, seconds = launch(d, overrides, args.workers, *fault, "--kill-worker", str(worker))
        restarts = p.stdout.count("tfdist launch: started") - 1
        executed = (steps_by_worker(d) if os.path.exists(os.path.join(d, "executed_steps.txt"))
                    else {})
        diff = None
        if p.returncode == 0:
            diff = max(float(abs(a - b).max()) for a, b in zip(final_weights(d), reference))
        # (from the survivors' memory, or the backup: the same step)
        resumed = bool(re.search(rf"resuming from (memory:\S+|{re.escape(d)}/backup) at step "
                                 rf"{step} of {args.steps} ", p.stdout))
        ok = p.returncode == 0 and restarts == 1 and executed == plan and resumed and diff == 0.0
        rows.append({"trial": trial, "fault": args.fault, "killed_worker": worker,
                     "kill_after_step": step,
                     "exit": p.returncode, "restarts": restarts, "resumed_at_kill_step": resumed,
                     "executed_steps": executed, "planned_steps": args.steps,
                     "max_abs_weight_diff": diff, "seconds": round(seconds, 1), "ok": ok})
        if not ok:
            print(p.stdout[-3000:], p.stderr[-2000:], sep="\n")
        print(f"trial {trial}: {'ok' if ok else 'FAILED'}", flush=True)

    head = ("trial", "killed" if args.fault == "kill" else "signalled",
            "after step" if args.fault == "kill" else "during step", "exit", "restarts",
            "executed (per worker)", "planned", "max |dw|", "s", "ok")
    table = [head] + [(r["trial"], f"w{r['killed_worker']}", r["kill_after_step"], r["exit"],
                       r["restarts"], "/".join(str(r["executed_steps"].get(w, 0))
                                               for w in range(args.workers)),
                       r["planned_steps"], r["max_abs_weight_diff"], r["seconds"],
                       "yes" if r["ok"] else "NO") for r in rows]
    report(args, table, rows)


def write_trials(args, overrides, plan, tmp, reference, rng):
    """--fault=kill_in_write: each trial SIGKILLs the chief (which writes the checkpoint) while
    the background write of a backup after a random step is in flight, seen from its files on
    disk (`harness.write_in_flight`: the step's data files there, the index naming an earlier
    step; the driver's writes pause 1 s between them, a slow disk). The launcher restarts the
    group; a trial passes when the run resumes from the backup committed before the kill, ends
    after exactly one restart, logs every step once, and ends bitwise equal to the reference."""
    from tools.faults.harness import committed_step, write_in_flight
    rows = []
    for trial in range(args.trials):
        d = os.path.join(tmp, f"trial{trial}")
        target = rng.randint(6, args.steps - 5)
        killed = {}

        def watch(d=d, target=target, killed=killed):
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not killed:
                step = write_in_flight(os.path.join(d, "backup"))
                if step and step >= target:
                    pids = [int(line.split()[1]) for line in open(
                        os.path.join(d, "executed_steps.txt")) if line.split()[0] == "0"]
                    os.kill(pids[-1], signal.SIGKILL)  # the chief, of this (first) attempt
                    killed.update(in_flight=step,
                                  committed=committed_step(os.path.join(d, "backup")))
                time.sleep(0.02)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        p, seconds = launch(d, overrides, args.workers, "--slow-write", "1")
        watcher.join(5)
        restarts = p.stdout.count("tfdist launch: started") - 1
        logged = [r["step"] for r in metrics(d)["steps"]] if p.returncode == 0 else []
        diff = None
        if p.returncode == 0:
            diff = max(float(abs(a - b).max()) for a, b in zip(final_weights(d), reference))
        resumed = bool(killed) and (f"resuming from {d}/backup at step {killed['committed']} of "
                                    f"{args.steps}") in p.stdout
        once = logged == list(range(1, args.steps + 1))
        ok = p.returncode == 0 and restarts == 1 and resumed and once and diff == 0.0
        rows.append({"trial": trial, "fault": args.fault, "killed_worker": 0,
                     "write_in_flight": killed.get("in_flight"),
                     "committed_before": killed.get("committed"), "exit": p.returncode,
                     "restarts": restarts, "resumed_at_committed": resumed,
                     "every_step_logged_once": once, "max_abs_weight_diff": diff,
                     "seconds": round(seconds, 1), "ok": ok})
        if not ok:
            print(p.stdout[-3000:], p.stderr[-2000:], sep="\n")
        print(f"trial {trial}: {'ok' if ok else 'FAILED'}", flush=True)
    head = ("trial", "write in flight", "resumed at", "exit", "restarts", "steps once",
            "max |dw|", "s", "ok")
    table = [head] + [(r["trial"], r["write_in_flight"], r["committed_before"], r["exit"],
                       r["restarts"], r["every_step_logged_once"], r["max_abs_weight_diff"],
                       r["seconds"], "yes" if r["ok"] else "NO") for r in rows]
    return table, rows


def offload_trials(args, overrides, tmp, reference, rng):
    """SIGKILL inside an offloaded optimizer step (module doc); (table, rows)."""
    rows = []
    for trial in range(args.trials):
        worker = trial % args.workers
        update, group = rng.randint(2, args.steps - 1), rng.randint(0, 3)
        d = os.path.join(tmp, f"trial{trial}")
        p, seconds = launch(d, overrides, args.workers, "--kill-in-offload", f"{update}:{group}",
                            "--kill-worker", str(worker))
        restarts = p.stdout.count("tfdist launch: started") - 1
        diff = None
        if p.returncode == 0:
            diff = max(float(abs(a - b).max()) for a, b in zip(final_weights(d), reference))
        resumed = f"resuming from {d}/backup at step {update - 1} of {args.steps}" in p.stdout
        executed = steps_by_worker(d)
        ok = p.returncode == 0 and restarts == 1 and resumed and diff == 0.0
        rows.append({"trial": trial, "fault": args.fault, "killed_worker": worker,
                     "kill_in_update": update, "kill_after_subgroup_writes": group,
                     "exit": p.returncode, "restarts": restarts,
                     "resumed_at": update - 1 if resumed else None, "executed_steps": executed,
                     "planned_steps": args.steps, "max_abs_weight_diff": diff,
                     "seconds": round(seconds, 1), "ok": ok})
        if not ok:
            print(p.stdout[-3000:], p.stderr[-2000:], sep="\n")
        print(f"trial {trial}: {'ok' if ok else 'FAILED'}", flush=True)
    head = ("trial", "killed", "in update", "after sub-group", "exit", "restarts",
            "resumed at", "executed (per worker)", "max |dw|", "s", "ok")
    table = [head] + [(r["trial"], f"w{r['killed_worker']}", r["kill_in_update"],
                       r["kill_after_subgroup_writes"], r["exit"], r["restarts"], r["resumed_at"],
                       "/".join(str(r["executed_steps"].get(w, 0)) for w in range(args.workers)),
                       r["max_abs_weight_diff"], r["seconds"], "yes" if r["ok"] else "NO")
                      for r in rows]
    return table, rows


def report(args, table, rows):
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"strategy": args.strategy, "zero": getattr(args, "zero", 0),
                   "workers": args.workers, "steps": args.steps, "seed": args.seed,
                   "trials": rows}, f, indent=1)
    print(f"wrote {args.out}; {sum(r['ok'] for r in rows)} of {len(rows)} trials ok")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


def _ps_run_with_fault(cmd, delay, fault, timeout):
    """Runs the parameter-server launcher `cmd`; `delay` s after the chief's first epoch began,
    calls `fault(popen)`. Returns (exit status, output lines). Every wait is bounded."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not any("[c0] Epoch 1/" in x for x in lines) and p.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(delay)
    fault(p)
    try:
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(timeout=10)
    return p.returncode, lines


def ps_trials(args):
    from tfdist.launch.local import children, task_of

    args.out = args.out or os.path.join(ROOT, "bench_results", "chaos-ps.json")
    steps = args.steps if args.steps != 30 else 600
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="tfdist-chaos-ps-")
    rows = []
    for trial in range(args.trials):
        worker = trial % args.workers
        delay = round(rng.uniform(1.0, 6.0), 2)
        d = os.path.join(tmp, f"trial{trial}")
        flags = ["--config=configs/gpt_nano.py", f"--workdir={d}", f"--config.train.steps={steps}",
                 f"--config.train.steps_per_epoch={steps // 2}", "--config.train.eval_steps=4",
                 "--config.backup.every_steps=100"]
        if args.data_dir:
            flags.append(f"--config.data.data_dir={args.data_dir}")
        t = time.monotonic()
        cmd = [sys.executable, "-m", "tfdist", "launch", "--strategy=parameter_server",
               f"--workers={args.workers}", "--ps=1", "--max_restarts=5", "--backoff=0.5", "--",
               *flags]
        victim = []

        def kill_worker(p, victim=victim, worker=worker):
            victim.extend(pid for pid in children(p.pid) if task_of(pid) == ("worker", worker))
            for pid in victim:
                os.kill(pid, signal.SIGKILL)
        code, lines = _ps_run_with_fault(cmd, delay, kill_worker, 900)
        out = "".join(lines)
        seconds = time.monotonic() - t
        counted = summed = stall = None
        if code == 0:
            log = metrics(d)["steps"]
            counted, summed = log[-1]["step"], sum(log[-1]["worker_steps"])
            times = [r["time"] for r in log]
            stall = round(max(b - a for a, b in zip(times, times[1:])), 1)
        restarted = f"worker {worker} was killed by SIGKILL; restarting it alone" in out
        # every step counted once; runs may exceed it by steps re-run after the kill (at most the
        # 2 x workers in flight)
        ok = (code == 0 and bool(victim) and restarted and counted == steps
              and steps <= summed <= steps + 2 * args.workers and stall < 60)
        rows.append({"trial": trial, "killed_worker": worker, "kill_after_s": delay,
                     "exit": code, "worker_restarted": restarted, "counted_steps": counted,
                     "runs_incl_retries": summed, "planned_steps": steps,
                     "max_stall_s": stall, "seconds": round(seconds, 1), "ok": ok})
        if not ok:
            print(out[-3000:])
        print(f"trial {trial}: {'ok' if ok else 'FAILED'}", flush=True)
    head = ("trial", "killed", "at s", "exit", "restarted alone", "counted", "runs (retries incl.)",
            "planned", "max stall s", "s", "ok")
    table = [head] + [(r["trial"], f"w{r['killed_worker']}", r["kill_after_s"], r["exit"],
                       "yes" if r["worker_restarted"] else "no", r["counted_steps"],
                       r["runs_incl_retries"], r["planned_steps"], r["max_stall_s"],
                       r["seconds"], "yes" if r["ok"] else "NO") for r in rows]
    args.steps = steps
    report(args, table, rows)


def ps_preempt_trials(args):
    """--fault=sigterm under the parameter server: SIGTERM to `tfdist launch` at a random time
    (seeded, 1-6 s into training); the coordinator drains the steps in flight, backs them up and
    every process exits 75; the same command then resumes at that step and counts exactly the
    planned steps."""
    import re
    args.out = args.out or os.path.join(ROOT, "bench_results",
                                        "chaos-sigterm-parameter_server.json")
    steps = args.steps if args.steps != 30 else 600
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="tfdist-chaos-ps-")
    rows = []
    for trial in range(args.trials):
        delay = round(rng.uniform(1.0, 6.0), 2)
        d = os.path.join(tmp, f"trial{trial}")
        flags = ["--config=configs/gpt_nano.py", f"--workdir={d}", f"--config.train.steps={steps}",
                 f"--config.train.steps_per_epoch={steps // 2}", "--config.train.eval_steps=4",
                 "--config.backup.every_steps=0"]  # epoch ends only: the signal's backup is used
        if args.data_dir:
            flags.append(f"--config.data.data_dir={args.data_dir}")
        cmd = [sys.executable, "-m", "tfdist", "launch", "--strategy=parameter_server",
               f"--workers={args.workers}", "--ps=1", "--max_restarts=2", "--backoff=0.5", "--",
               *flags]
        t = time.monotonic()
        code, lines = _ps_run_with_fault(cmd, delay, lambda p: p.send_signal(signal.SIGTERM), 300)
        first = "".join(lines)
        found = re.search(r"preempted \(SIGTERM\) at step (\d+): backup written", first)
        at = int(found.group(1)) if found else None
        again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        seconds = time.monotonic() - t
        resumed = (at is not None
                   and f"resuming from {d}/backup at step {at} of {steps}" in again.stdout)
        counted = None
        if again.returncode == 0:
            counted = metrics(d)["steps"][-1]["step"]
        ok = (code == 75 and at is not None and resumed and again.returncode == 0
              and counted == steps)
        rows.append({"trial": trial, "signal_after_s": delay, "first_exit": code,
                     "backed_up_step": at, "resumed_there": resumed,
                     "second_exit": again.returncode, "counted_steps": counted,
                     "planned_steps": steps, "seconds": round(seconds, 1), "ok": ok})
        if not ok:
            print(first[-3000:], again.stdout[-2000:], again.stderr[-1000:], sep="\n")
        print(f"trial {trial}: {'ok' if ok else 'FAILED'}", flush=True)
    head = ("trial", "SIGTERM at s", "exit", "backed up step", "resumed there", "exit again",
            "counted", "planned", "s", "ok")
    table = [head] + [(r["trial"], r["signal_after_s"], r["first_exit"], r["backed_up_step"],
                       "yes" if r["resumed_there"] else "no", r["second_exit"], r["counted_steps"],
                       r["planned_steps"], r["seconds"], "yes" if r["ok"] else "NO") for r in rows]
    args.steps = steps
    report(args, table, rows)


if __name__ == "__main__":
    main()
