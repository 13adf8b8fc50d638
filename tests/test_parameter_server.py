"""Parameter-server mode through `tfdist launch --strategy=parameter_server`: it trains as well as
the collective mode, it is asynchronous (a SIGSTOPped worker does not stop the other), a
SIGKILLed worker is restarted alone and the counted steps equal the planned ones, a killed ps
task restarts the job from its backup, and a user's model trains with plain `model.fit`.

Faults are injected at points of the run's progress (steps the chief has counted, read from its
progress bar), and the checks are on step counts and the order of events, not on durations."""
import json
import math
import os
import pty
import random
import re
import signal
import subprocess
import sys
import threading
import time
import tty

import pytest

from tests.helpers import ROOT, descendants, metrics, task_of, wait_until
from tfdist.data import ByteTokenizer

WORKERS, MAX_RESTARTS = 2, 3  # of every launch below


def flags(workdir, data_dir, steps, per_epoch, **extra):
    f = ["--config=configs/gpt_nano.py", f"--workdir={workdir}",
         f"--config.data.data_dir={data_dir}", f"--config.train.steps={steps}",
         f"--config.train.steps_per_epoch={per_epoch}", "--config.train.eval_steps=4"]
    return f + [f"--config.{k}={v}" for k, v in extra.items()]


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Launch:
    """`tfdist launch` in the background, on a pseudo-terminal (the launcher's output as a user
    sees it), and `step` is the last step count of the chief's progress (a line per report: its
    output goes to the launcher, not a terminal). The other output is collected line by line."""

    def __init__(self, strategy, train_flags, per_epoch, ps=1, max_restarts=MAX_RESTARTS):
        master, terminal = pty.openpty()
        tty.setraw(terminal)  # no newline translation
        try:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}",
                 f"--workers={WORKERS}", f"--ps={ps}", f"--max_restarts={max_restarts}",
                 "--backoff=0.5", "--", *train_flags],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
        finally:
            os.close(terminal)
        self.lines, self.step = [], 0
        # the chief's "[c0] Epoch <k>/<epochs>", then "[c0] step <done in the epoch>/<per_epoch>"
        self._per_epoch, self._epoch = per_epoch, 0
        self._epoch_line = re.compile(r"^\[c0\] Epoch (\d+)/")
        self._bar = re.compile(  # Keras's bar ("50/1500"), or tfdist's lines ("step 50/1,500")
            rf"^\[c0\]\s+(?:step\s+)?([\d,]+)/(?:{per_epoch}|{per_epoch:,})\b")
        self._reader = threading.Thread(target=self._read, args=(master,), daemon=True)
        self._reader.start()

    def _read(self, fd):
        buf = ""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: every process holding the terminal has ended
                chunk = b""
            if not chunk:
                break
            buf += chunk.decode(errors="replace")
            *done, buf = buf.split("\n")
            for line in done:
                segments = [_ANSI.sub("", x) for x in line.split("\r")]
                self._progress(segments)
                text = [x for x in segments if x.strip() and not self._bar.match(x)]
                if text:
                    self.lines.append(text[-1] + "\n")
            self._progress([_ANSI.sub("", x) for x in buf.split("\r")])
        os.close(fd)

    def _progress(self, segments):
        for x in segments:
            epoch, bar = self._epoch_line.match(x), self._bar.match(x)
            if epoch:
                self._epoch = int(epoch.group(1)) - 1
            if bar:
                self.step = max(self.step, self._epoch * self._per_epoch
                                + int(bar.group(1).replace(",", "")))

    @property
    def out(self):
        return "".join(self.lines)

    def wait_for(self, text, timeout=300):
        wait_until(lambda: text in self.out, timeout, repr(text), proc=self.p,
                   describe=lambda: self.out[-3000:])

    def wait_for_step(self, step, why="", timeout=300):
        """Until the chief has shown `step` steps done (a hang guard fails the test)."""
        wait_until(lambda: self.step >= step, timeout, f"step {step} {why}(at {self.step})",
                   proc=self.p, describe=lambda: self.out[-3000:])
        return self.step

    def pid_of(self, role, index):
        for pid in descendants(self.p.pid):
            if task_of(pid) == (role, index):
                return pid
        raise AssertionError(f"no {role} {index} among the launcher's processes")

    def finish(self, timeout=400):
        try:
            self.p.wait(timeout=timeout)
        finally:
            if self.p.poll() is None:  # ours, by PID; the launcher stops its own children
                self.p.terminate()
                self.p.wait(timeout=30)
        self._reader.join(timeout=10)
        return self.p.returncode


@pytest.mark.slow
@pytest.mark.long  # time; the kill tests and the Keras-program test train under it too
def test_trains_as_well_as_the_collective_mode(tmp_path, data_dir):
    """Same config and steps: the final validation loss is within 10 % of MultiWorkerMirrored's."""
    runs, steps, per_epoch = {}, 80, 40
    for strategy in ("multi_worker_mirrored", "parameter_server"):
        d = tmp_path / strategy
        run = Launch(strategy, flags(d, data_dir, steps, per_epoch), per_epoch, max_restarts=0)
        assert run.finish() == 0, run.out[-3000:]
        runs[strategy] = metrics(d)["evals"][-1]["loss"]
    collective, ps = runs["multi_worker_mirrored"], runs["parameter_server"]
    print(f"final validation loss after {steps} steps: {runs}")  # shown with pytest -s
    assert abs(ps - collective) <= 0.10 * collective, runs
    # it learned: from about ln(256) = 5.5 nats (a uniform guess over the bytes) at the start
    assert ps < 3.5 < math.log(ByteTokenizer.vocab_size)


@pytest.mark.slow
@pytest.mark.long  # time: test_netcluster's partitioned worker shows the other training on alone
def test_a_paused_worker_does_not_stop_the_other(tmp_path, data_dir):
    """Worker 1 is SIGSTOPped 3 times, each time until the chief has counted PAUSED more steps:
    worker 0 alone runs them. In the reports logged while worker 1 was stopped, worker 1's step
    count stands and worker 0's grows at every report; the run ends with every planned step, and
    worker 1, paused, ran fewer than worker 0. (Before the step functions stopped returning a
    tensor, about 1 pause in 15 stalled both: the count then stops and the wait fails.) The pauses
    stay under gRPC keepalive's detection (keepalive_secs 60 here), which would otherwise take a
    long-stopped worker for a lost one and run its step again (test_netcluster.py). Every logged
    loss is a mean of steps' own losses, never above the untrained model's (Keras's loss
    tracker, shared by the workers and reset by the chief, logged 10 to 20 nats: measured)."""
    steps, paused, between, pauses = 1500, 100, 50, 3
    assert between + pauses * (paused + between) < steps  # every pause ends before the run
    run = Launch("parameter_server", flags(tmp_path, data_dir, steps, steps, **{
        "backup.every_steps": 0, "strategy.keepalive_secs": 60}), steps)
    run.wait_for_step(between, "before the first pause ")  # both workers are training
    w1 = run.pid_of("worker", 1)
    windows = []  # (time stopped, time continued) of each pause
    try:
        for _ in range(pauses):
            os.kill(w1, signal.SIGSTOP)
            t_stop = time.time()
            run.wait_for_step(run.step + paused, "while worker 1 is stopped ")
            t_cont = time.time()
            os.kill(w1, signal.SIGCONT)
            windows.append((t_stop, t_cont))
            run.wait_for_step(run.step + between, "after worker 1 continued ")
    finally:
        os.kill(w1, signal.SIGCONT)  # ours (a child of our launcher); never left stopped
    assert run.finish() == 0, run.out[-3000:]
    reports = [r for r in metrics(tmp_path)["steps"] if "worker_steps" in r]
    for t_stop, t_cont in windows:  # the reports the chief logged while worker 1 was stopped
        inside = [r["worker_steps"] for r in reports if t_stop < r["time"] < t_cont]
        assert len(inside) >= 2, (t_stop, t_cont, [(r["step"], r["time"]) for r in reports])
        w0, w1_steps = [w[0] for w in inside], [w[1] for w in inside]
        assert w1_steps[-1] - w1_steps[0] <= 1, inside  # worker 1 stood still (1 step in flight)
        assert all(b > a for a, b in zip(w0, w0[1:])), inside  # worker 0 went on at every report
        assert w0[-1] - w0[0] >= paused // 2, inside  # most of the pause's steps, by worker 0
    last = reports[-1]
    assert max(r["loss"] for r in reports) < math.log(ByteTokenizer.vocab_size) + 0.5, reports
    assert last["step"] == steps and sum(last["worker_steps"]) == steps  # each step once
    assert last["worker_steps"][1] < last["worker_steps"][0], last  # the paused one ran fewer
    after = [r["worker_steps"][1] for r in reports if r["time"] > windows[-1][1]]
    assert after[-1] > after[0], after  # and worker 1 trained again after its last pause


@pytest.mark.slow
@pytest.mark.parametrize("seed,accumulate", [  # `make chaos-ps` repeats it over many seeds
    (1, 4), pytest.param(1, 1, marks=pytest.mark.long)])  # (1: time; the same loop)
def test_a_killed_worker_is_restarted_alone_and_no_step_is_lost(tmp_path, data_dir, seed,
                                                                accumulate):
    """SIGKILL a worker at a random step of the first epoch: it is restarted alone, during the
    run (a new process of that task before the chief's end), and the counted steps are the
    planned ones. With gradient accumulation (k = 4) each closure is an update of 4 steps, all 4
    counted."""
    steps, per_epoch = 600, 300
    rng = random.Random(seed)
    worker, kill_at = rng.randrange(WORKERS), rng.randint(20, per_epoch - 20)
    run = Launch("parameter_server", flags(tmp_path, data_dir, steps, per_epoch,
                                           **{"backup.every_steps": 100,
                                              "train.grad_accum_steps": accumulate}), per_epoch)
    run.wait_for_step(kill_at)
    killed = run.pid_of("worker", worker)
    os.kill(killed, signal.SIGKILL)
    restarted = f"worker {worker} was killed by SIGKILL; restarting it alone"
    run.wait_for(restarted)
    wait_until(lambda: any(task_of(p) == ("worker", worker) for p in descendants(run.p.pid)
                           if p != killed), 60, f"new worker {worker}", proc=run.p)
    assert run.finish() == 0, run.out[-3000:]
    assert run.out.index(restarted) < run.out.index("[c0] tfdist: done:")
    assert "resuming" not in run.out  # the job itself went on
    last = metrics(tmp_path)["steps"][-1]
    assert last["step"] == steps  # counted == planned: every step once
    # runs per worker: a step in flight on the killed worker may have been run again elsewhere
    # (at most the coordinator's window of 2 closures per worker, each of `accumulate` steps)
    assert steps <= sum(last["worker_steps"]) <= steps + 2 * WORKERS * accumulate


@pytest.mark.slow
@pytest.mark.long  # time: the SIGTERM test restarts the whole job from its backup
def test_a_killed_ps_task_restarts_the_job_from_its_backup(tmp_path, data_dir):
    steps, per_epoch = 600, 300
    run = Launch("parameter_server", flags(tmp_path, data_dir, steps, per_epoch,
                                           **{"backup.every_steps": 50}), per_epoch)
    wait_until(lambda: (tmp_path / "backup" / "checkpoint").exists(), 300, "backup", proc=run.p,
               describe=lambda: run.out[-3000:])
    os.kill(run.pid_of("ps", 0), signal.SIGKILL)
    assert run.finish() == 0, run.out[-3000:]
    assert f"ps 0 was killed by SIGKILL; stopped the others; restart 1 of {MAX_RESTARTS}" in run.out
    assert "tfdist: resuming from" in run.out
    assert metrics(tmp_path)["steps"][-1]["step"] == steps
    assert not (tmp_path / "backup").exists()


@pytest.mark.slow
def test_sigterm_to_the_launcher_drains_backs_up_and_resumes(tmp_path, data_dir):
    """Preemption of the whole job: SIGTERM to `tfdist launch` reaches every task; the coordinator
    drains the steps in flight and backs them up (there is no scheduled backup: epoch ends
    only), the servers wait for it, and every process exits 75. Run again,
    the job resumes at that step and ends at exactly the planned steps."""
    steps, per_epoch = 300, 150  # the signal after step 50: mid-epoch, before any backup
    f = flags(tmp_path, data_dir, steps, per_epoch, **{"backup.every_steps": 0})
    run = Launch("parameter_server", f, per_epoch)
    run.wait_for_step(50, "before the signal ")
    run.p.send_signal(signal.SIGTERM)
    assert run.finish() == 75, run.out[-3000:]
    found = re.search(r"preempted \(SIGTERM\) at step (\d+): backup written", run.out)
    assert found, run.out[-3000:]
    at = int(found.group(1))
    assert 50 <= at < per_epoch
    assert ("tfdist launch: preempted (SIGTERM): the workers backed up their step; exit 75"
            in run.out)
    again = Launch("parameter_server", f, per_epoch)
    assert again.finish() == 0, again.out[-3000:]
    assert f"resuming from {tmp_path}/backup at step {at} of {steps}" in again.out
    assert metrics(tmp_path)["steps"][-1]["step"] == steps


USER_MODEL = r"""
import json, sys, keras, numpy as np, tensorflow as tf, tfdist.strategies
epochs = int(sys.argv[1])
strategy = tfdist.strategies.get("parameter_server")
if strategy.is_server:  # the earlier serve pattern (the docs once showed it): still works
    strategy.serve()  # a worker or ps task serves the chief, then ends here; the chief goes on
with strategy.scope():
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(inp)))
    model.compile(optimizer=strategy.wrap_optimizer(keras.optimizers.Adam(0.01)), loss="mse")
x = np.random.default_rng(0).normal(size=(512, 8)).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(32).repeat()
try:
    model.fit(ds, epochs=1)
except Exception as e:
    print("NEEDS", e)
h = model.fit(ds, epochs=epochs, steps_per_epoch=40, verbose=0)
print("RESULT", json.dumps(h.history["loss"]))
"""


@pytest.mark.slow
def test_a_users_model_trains_with_plain_model_fit(tmp_path):
    prog, epochs = tmp_path / "user.py", 3
    prog.write_text(USER_MODEL)
    p = subprocess.run([sys.executable, "-m", "tfdist", "launch", "--strategy=parameter_server",
                        f"--workers={WORKERS}", "--ps=1", "--max_restarts=0", "--", sys.executable,
                        str(prog), str(epochs)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "needs steps_per_epoch" in p.stdout
    losses = json.loads(p.stdout.split("[c0] RESULT ", 1)[1].splitlines()[0])
    assert len(losses) == epochs and losses[-1] < 0.5 * losses[0]


FAULTY_TRAIN = os.path.join(ROOT, "tools", "faults", "faulty_train.py")
EXIT_BOUND = 60  # seconds: the chief's exit after its workers are cut off


@pytest.mark.slow
@pytest.mark.parametrize("teardown", [False, pytest.param(True, marks=pytest.mark.long)])
def test_the_chief_exits_within_a_bound_when_the_workers_are_cut_off_at_the_end(
        tmp_path, data_dir, teardown):
    """Both workers are SIGSTOPped (unreachable, their connections up) once the chief has trained
    and saved, and before it exits (faulty_train.py --hold-at-end): the chief ends within 60 s,
    with status 0 (10 s measured). The companion keeps TF's teardown (`TFDIST_PS_EXIT=teardown`):
    the chief is still there after 60 s, waiting for ping timeouts (72 s measured at the default
    keepalive; 30 s here makes each wait longer)."""
    from tools.faults import harness
    go = tmp_path / "go"
    overrides = {"strategy.name": "parameter_server", "train.steps": 20,
                 "train.steps_per_epoch": 10, "train.eval_steps": 2, "data.data_dir": data_dir,
                 "strategy.keepalive_secs": 30}
    token = harness.new_mark()
    env = {**os.environ, harness.MARK: token, **({"TFDIST_PS_EXIT": "teardown"} if teardown
                                                 else {})}
    log = open(tmp_path / "out.txt", "w")  # (a file: a pipe nobody reads would fill and block)
    p = subprocess.Popen(
        [sys.executable, "-m", "tfdist", "launch", "--strategy=parameter_server",
         f"--workers={WORKERS}", "--ps=1", "--max_restarts=0", "--", sys.executable,
         FAULTY_TRAIN, str(tmp_path), json.dumps(overrides), "--hold-at-end", str(go)],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    stopped = []
    try:
        wait_until(lambda: (tmp_path / "ended").exists(), 300, "the chief's end", proc=p)
        tasks = {task_of(pid): pid for pid in descendants(p.pid)}
        chief = tasks[("chief", 0)]
        for w in range(WORKERS):
            os.kill(tasks[("worker", w)], signal.SIGSTOP)
            stopped.append(tasks[("worker", w)])
        go.touch()
        if teardown:
            time.sleep(EXIT_BOUND)
            assert os.path.exists(f"/proc/{chief}"), "the chief exited without the fix"
            return
        wait_until(lambda: not _alive(chief), EXIT_BOUND, "the chief's exit", proc=None)
        p.wait(timeout=120)
        out = (tmp_path / "out.txt").read_text()
        assert p.returncode == 0, out[-3000:]
        assert "tfdist launch: done: the chief finished" in out, out[-3000:]
    finally:
        for pid in stopped:  # ours (children of our launcher): never left stopped
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        harness.end_marked(token)
        log.close()


def _alive(pid):
    """Running (a zombie, exited but not yet reaped by the launcher, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
