"""What a resize of an elastic job costs (tfdist/launch/elastic.py): progress lost and time to
resume.

    python tools/bench/elastic.py    # gpt_mini, with ZeRO-1 and without (make bench-elastic)
    python tools/bench/elastic.py --zero=0 --strategy=horovod

One elastic `tfdist launch` per variant on this machine: 2 workers (--min_workers=1,
--max_workers=2, --rejoin_timeout, a backup every --every steps), the slots given by a discovery
command that prints a file.

* **Shrink.** `--kill_after` steps after a backup is logged, worker 1 is SIGKILLed and its slot
  taken out of the discovery output. Progress lost: the seconds from the backup step's end to
  the kill (the job resumes from that backup), and the steps they hold (at the median step
  time). Time to resume: from the kill to the start of the first step the single worker runs
  (detection, the stop, the rejoin bound, the restart: a new process, TF's start-up, the model
  built, the backup read).
* **Grow.** Once the single worker has run `--grow_after` steps, the slot is offered again. Steps
  lost: those between the step the group backed up when asked to stop and the step it resumed at
  (0: the backup is taken at the resize). Time to resume: from the offer to the start of the first
  step at 2 workers (the discovery interval, the step in progress, the backup, the restart).

Prints a table and writes bench_results/elastic.json.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist.launch.local import descendants, task_of  # noqa: E402
from tools.bench import common as bench_common  # noqa: E402
from tools.faults import harness  # noqa: E402

_ZERO = flags.DEFINE_list("zero", ["0", "1"], "ZeRO stages to measure.")
_STRATEGY = flags.DEFINE_enum("strategy", "multi_worker_mirrored",
                              ["multi_worker_mirrored", "horovod"], "Strategy of the workers.")
_EVERY = flags.DEFINE_integer("every", 10, "A backup every this many steps.")
_KILL_AFTER = flags.DEFINE_integer("kill_after", 5, "Shrink: steps after a backup to kill at.")
_GROW_AFTER = flags.DEFINE_integer("grow_after", 4, "Grow: steps the single worker runs first.")
_REJOIN = flags.DEFINE_float("rejoin_timeout", 10.0, "The launcher's --rejoin_timeout.")
_BATCH = flags.DEFINE_integer("batch", 8, "Global batch (sequences).")


def rows(work):
    try:
        return harness.metrics(work)["steps"]
    except (OSError, ValueError, KeyError):
        return []


def _worker_1(pid, strategy):
    for q in descendants(pid):
        try:
            with open(f"/proc/{q}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if (strategy == "horovod" and b"\0HOROVOD_RANK=1\0" in b"\0" + env) or \
                (strategy != "horovod" and task_of(q) == ("worker", 1)):
            return q
    return None


def variant(zero, tmp):
    """One elastic run: 2 workers, shrunk to 1 by a kill, grown back to 2. Its figures."""
    work, hosts = os.path.join(tmp, f"zero{zero}"), os.path.join(tmp, f"hosts{zero}")
    every, steps = _EVERY.value, 4 * _EVERY.value
    with open(hosts, "w") as f:
        f.write("127.0.0.1:2\n")
    flags_ = bench_common.train_flags(work, steps, _BATCH.value, bench_common.INTER.value, extra=[
        "--config.backup.enabled=true", f"--config.backup.every_steps={every}",
        f"--config.zero.stage={zero}"])
    cmd = harness.tfdist_argv("launch", f"--strategy={_STRATEGY.value}", "--workers=2",
                              "--min_workers=1", "--max_workers=2", f"--discovery=cat {hosts}",
                              f"--rejoin_timeout={_REJOIN.value:g}", "--discovery_interval=1",
                              "--max_restarts=0", "--", *flags_)
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    out = []
    threading.Thread(target=lambda: out.extend(p.stdout), daemon=True).start()
    deadline = time.monotonic() + 1800

    def wait(condition, what):
        while not condition():
            if p.poll() is not None or time.monotonic() > deadline:
                os.killpg(p.pid, signal.SIGKILL)
                sys.exit(f"bench: no {what} (exit {p.poll()}):\n{''.join(out)[-3000:]}")
            time.sleep(0.05)

    wait(lambda: any(r["step"] == every for r in rows(work)), f"backup at step {every}")
    backup_end = next(r["time"] for r in rows(work) if r["step"] == every)
    step_s = sorted(r["step_time"] for r in rows(work)[2:])
    median = step_s[len(step_s) // 2]
    time.sleep(max(0.0, backup_end + (_KILL_AFTER.value + 0.5) * median - time.time()))
    victim = _worker_1(p.pid, _STRATEGY.value)
    with open(hosts, "w") as f:
        f.write("127.0.0.1:1\n")
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    wait(lambda: any(r["replicas"] == 1 for r in rows(work)), "step at 1 worker")
    wait(lambda: rows(work)[-1]["replicas"] == 1 and
         sum(r["replicas"] == 1 for r in rows(work)) >= _GROW_AFTER.value, "steps at 1 worker")
    with open(hosts, "w") as f:
        f.write("127.0.0.1:2\n")
    offered = time.time()
    wait(lambda: p.poll() == 0, "end")
    text = "".join(out)
    final = rows(work)
    resumed = [int(s) for s in re.findall(r"resuming from \S+ at step (\d+) of", text)]
    stopped = [int(s) for s in re.findall(r"preempted \(\w+\) at step (\d+): backup written", text)]
    first_1 = next(r for r in final if r["replicas"] == 1)
    first_2 = next(r for r in final if r["replicas"] == 2 and r["time"] > offered)
    shrink_lost = killed - backup_end  # the steps after the backup, run again
    return {
        "zero": zero, "step_s_2_workers": round(median, 3),
        "shrink": {"resumed_at": resumed[0], "steps_lost": int(shrink_lost / median),
                   "seconds_lost": round(shrink_lost, 1),
                   "time_to_resume_s": round(first_1["time"] - first_1["step_time"] - killed, 1)},
        "grow": {"stopped_at": stopped[-1] if stopped else None, "resumed_at": resumed[-1],
                 "steps_lost": (stopped[-1] - resumed[-1]) if stopped else None,
                 "time_to_resume_s": round(first_2["time"] - first_2["step_time"] - offered, 1)},
        "steps_once": [r["step"] for r in final] == list(range(1, steps + 1)),
    }


def main(argv):
    del argv
    tmp = tempfile.mkdtemp(prefix="tfdist-bench-elastic-")
    results = [variant(int(z), tmp) for z in _ZERO.value]
    print(f"\n{bench_common.config_filename()}, {_STRATEGY.value}, 2 -> 1 -> 2 workers, a backup "
          f"every {_EVERY.value} steps, --rejoin_timeout={_REJOIN.value:g}\n")
    print("| ZeRO | step (2 workers) | shrink: steps lost | s lost | time to resume | "
          "grow: steps lost | time to resume |\n|---|---|---|---|---|---|---|")
    for r in results:
        s, g = r["shrink"], r["grow"]
        print(f"| {r['zero']} | {r['step_s_2_workers']:.2f} s | {s['steps_lost']} | "
              f"{s['seconds_lost']:.1f} s | {s['time_to_resume_s']:.1f} s | {g['steps_lost']} | "
              f"{g['time_to_resume_s']:.1f} s |")
    bench_common.write_json({"config": harness.relative(bench_common.config_filename()),
                             "strategy": _STRATEGY.value, "every_steps": _EVERY.value,
                             "rejoin_timeout_s": _REJOIN.value, "batch": _BATCH.value,
                             "variants": results},
                            os.path.join(ROOT, "bench_results", "elastic.json"))


if __name__ == "__main__":
    flags.FLAGS.set_default("config", os.path.join(ROOT, "configs", "gpt_mini.py"))
    app.run(main)
