"""`tfdist launch --engine=ray` (tfdist/launch/ray_train.py): tfdist's workers as Ray Train
workers, on a Ray started for the run on 127.0.0.1 (ray[train]==2.60.0, the `ray` extra, which
`make setup` installs). Its bad input is one line each, exit 2: Ray missing (the extra named), an
address nothing listens at or that never answers (bounded), a strategy Ray cannot run (those it
can named), --min_workers above --max_workers."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import (
    ROOT,
    assert_usage_error,
    driver_argv,
    max_diff,
    reference_run,
    run,
    tfdist,
    tfdist_argv,
    weights,
)
from tools.cluster.netcluster import NetCluster, missing
from tools.cluster.ray_cluster import RayCluster
from tools.faults.harness import losses, metrics, wait_until

NANO = "--config=configs/gpt_nano.py"


def train_flags(workdir, overrides):
    return [NANO, f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())]


def epoch_means(workdir, per_epoch):
    """Each epoch's mean training loss (the parameter server logs one mean per report)."""
    got = losses(workdir)
    return [sum(got[i:i + per_epoch]) / per_epoch for i in range(0, len(got), per_epoch)]


@pytest.mark.slow
def test_the_parameter_server_on_a_ray_started_for_the_run(tmp_path, data_dir, single_reference):
    """Without --address: a Ray started here for the run. parameter_server's chief, worker and
    ps task are 3 Ray Train workers (tfdist/launch/ray_roles.py: rank 0 the chief, each its
    TF_CONFIG on 127.0.0.1); the worker and the ps only serve, and join the chief's reports to
    Ray. One worker runs the steps one after another, so each epoch's mean loss and the final
    validation loss equal the single process's; each epoch's metrics reach Ray, the last with the
    chief's pointer to the backup; the servers stop when the chief is done, and so does Ray."""
    p = tfdist("launch", "--engine=ray", "--strategy=parameter_server", "--workers=1", "--ps=1",
               "--max_restarts=0", "--", *train_flags(tmp_path, reference_run(data_dir)),
               timeout=600)
    out = p.stdout + p.stderr
    rows = metrics(tmp_path)["steps"]
    assert [r["step"] for r in rows] == [10, 20], out[-3000:]
    assert rows[-1]["worker_steps"] == [20]  # every step once, on the one worker
    got, want = [r["loss"] for r in rows], epoch_means(single_reference, 10)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    evals = [(e["step"], e["loss"]) for e in metrics(tmp_path)["evals"]]
    want = [(e["step"], e["loss"]) for e in metrics(single_reference)["evals"]]
    assert [s for s, _ in evals] == [s for s, _ in want] == [10, 20], evals
    assert max(abs(a[1] - b[1]) for a, b in zip(evals, want)) <= 1e-5, (evals, want)
    for task in ("worker 0", "ps 0"):
        assert re.search(rf"tfdist: {task} serving at 127\.0\.0\.1:\d+", out), out[-3000:]
        assert f"tfdist: the chief is done; {task} stops" in out
    assert "tfdist: parameter_server: coordinator of 1 worker(s) and 1 ps task(s)" in out
    assert "tfdist launch: done: Ray Train finished the run (last reported: {'step': 20, " in out
    assert "backup pointer at step 20" in out
    *_, pointer = sorted((tmp_path / "ray" / "tfdist").glob("checkpoint_*/tfdist.json"))
    assert json.loads(pointer.read_text())["step"] == 20


@pytest.mark.slow
@pytest.mark.long  # time: a run long enough to be killed in, then Ray's restart of all of it
def test_a_killed_ps_task_makes_ray_restart_the_group_from_its_backup(tmp_path, data_dir):
    """parameter_server on Ray: the ps task is SIGKILLed once a backup exists. Ray restarts the
    whole group (chief, worker and ps: `--max_restarts=1`), which resumes at the backed-up step
    and ends at the last one, every step logged once."""
    steps, per_epoch = 1000, 500
    log = tmp_path / "out.txt"
    flags = train_flags(tmp_path, {"data.data_dir": data_dir, "train.steps": steps,
                                   "train.steps_per_epoch": per_epoch, "train.eval_steps": 4,
                                   "backup.every_steps": 50})
    with open(log, "w") as f:
        p = subprocess.Popen(tfdist_argv("launch", "--engine=ray", "--strategy=parameter_server",
                                         "--workers=1", "--ps=1", "--max_restarts=1", "--",
                                         *flags), stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, cwd=ROOT)
    try:
        serving = re.compile(r"pid=(\d+)\) tfdist: ps 0 serving at")
        wait_until(lambda: serving.search(log.read_text()) and (
            tmp_path / "backup" / "checkpoint").exists(), 300, "a backup", proc=p,
            describe=lambda: log.read_text()[-3000:])
        os.kill(int(serving.search(log.read_text()).group(1)), signal.SIGKILL)
        assert p.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if p.poll() is None:  # ours, by PID: its Ray ends with it
            p.terminate()
            p.wait(timeout=60)
    out = log.read_text()
    resumed = re.search(r"tfdist: resuming from \S+ at step (\d+) of", out)
    assert resumed and 50 <= int(resumed.group(1)) < steps, out[-4000:]
    rows = [r["step"] for r in metrics(tmp_path)["steps"]]
    assert rows[-1] == steps and len(rows) == len(set(rows)), rows
    assert "tfdist launch: done: Ray Train finished the run" in out


@pytest.mark.slow
@pytest.mark.skipif(missing() is not None, reason=str(missing()))
@pytest.mark.parametrize("strategy", [
    "multi_worker_mirrored",
    # (long: the suite's time; Horovod under Ray stays in make test in the user's program's test)
    pytest.param("horovod", marks=[pytest.mark.horovod, pytest.mark.long])])
def test_tfdist_train_on_a_3_node_ray_cluster(tmp_path, data_dir, single_reference, strategy):
    """A head and two worker nodes, each `ray start` in a network namespace of its own
    (tools/cluster/ray_cluster.py); `tfdist launch --engine=ray --address=<head>` on the head's
    host runs the fault driver (a program calling `tfdist.train.train`) as 2 Ray Train workers,
    one on each worker node: under multi_worker_mirrored with Ray's TF_CONFIG, under horovod met
    through Horovod's Gloo rendezvous over the nodes' own interfaces. Per-step losses equal the
    single process's within 1e-5, the ranks' weights are bitwise identical, and each epoch's
    metrics reach Ray from inside the program."""
    overrides = {**reference_run(data_dir), "strategy.name": strategy}
    with NetCluster(3, rate="1gbit") as net, RayCluster(net) as nodes:
        p = net.run(0, [sys.executable, "-m", "tfdist", "launch", "--engine=ray",
                        f"--address={nodes.address}", f"--strategy={strategy}", "--workers=2",
                        "--max_restarts=0", f"--storage={tmp_path / 'ray'}", "--",
                        *driver_argv(tmp_path, overrides, "--dump-weights")],
                    env=nodes.env, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    got, want = losses(tmp_path), losses(single_reference)
    assert len(got) == len(want) == 20, out[-3000:]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    assert max_diff(weights(tmp_path, 0), weights(tmp_path, 1)) == 0.0
    assert "tfdist launch: done: Ray Train finished the run (last reported: {'step': 20, " in out
    results = [json.loads(r) for r in re.findall(r"DRIVER_RESULT (\{.*\})", out)]
    # one worker on each worker node (Ray's log lines come from the nodes' own addresses)
    assert sorted(r["addresses"] for r in results) == [[net.address(1)], [net.address(2)]], out



def test_a_resize_stops_the_run_of_another_thread_after_its_step_with_a_backup():
    """What Ray's controller runs on each worker before a resize (tfdist/launch/ray_resize.py):
    the run in progress (in Ray Train's training thread, where no signal reaches) stops after
    the step in progress, writes its backup and ends; `stop_here` returns once it has. With no
    run training (none yet, or past its last step) it returns at once."""
    import threading

    import keras
    import numpy as np

    from tfdist.launch import ray_resize
    from tfdist.runtime.preemption import Preempted, Preemption
    assert ray_resize.stop_here(1) is None  # no run in progress
    ray_resize.ENDED.clear()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    steps, said, saved, ended = [], [], [], []
    stepping = threading.Event()

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(batch + 1)
            stepping.set()
            time.sleep(0.01)

    def training():  # (a thread, as Ray Train's)
        stop = Preemption(["TERM"], save=lambda: saved.append(len(steps)) or len(steps),
                          say=said.append)
        with stop:
            try:
                model.fit(np.ones((2000, 2)), np.ones((2000, 1)), batch_size=1, verbose=0,
                          callbacks=[Steps(), stop])
            except Preempted as e:
                ended.append(e.step)
        ray_resize.ENDED.set()

    thread = threading.Thread(target=training, daemon=True)
    thread.start()
    assert stepping.wait(60)
    took = ray_resize.stop_here(60)
    thread.join(60)
    assert took is not None and ended == saved == [len(steps)] and len(steps) < 2000, steps
    assert said[-1] == (f"tfdist: preempted (Ray's resize) at step {len(steps)}: backup written; "
                        f"the group of the new size resumes from it"), said

    class Late(keras.callbacks.Callback):  # a resize after the last step: the run is left alone
        def on_train_end(self, logs=None):
            late.append(ray_resize.stop_here(1))

    late, stop = [], Preemption(["TERM"], save=lambda: 0, say=said.append)
    with stop:
        model.fit(np.ones((4, 2)), np.ones((4, 1)), batch_size=1, verbose=0,
                  callbacks=[stop, Late()])
    assert late == [None] and stop.received is None


# -- bad input: one line, exit 2 -------------------------------------------------------------------
def ray_launch(*args, check=False, **kw):
    return tfdist("launch", "--engine=ray", *args, "--", NANO, check=check, **kw)


def test_without_ray_the_line_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['tfdist', 'launch', "
            f"'--engine=ray', '--', '{NANO}']; from tfdist.__main__ import main; main()")
    p = run([sys.executable, "-c", code], check=False)
    assert_usage_error(p, "pip install 'tfdist[ray]'")


@pytest.mark.parametrize("args,needle", [
    (["--strategy=single"], "tfdist launch cannot start strategy 'single'"),
    (["--strategy=parameter_server", "--min_workers=1"], "strategy parameter_server does not "
                                                          "resize"),
    (["--strategy=parameter_server", "--ps=0"], "--ps must be between 1 and 16, got 0"),
    (["--min_workers=3", "--max_workers=2"], "--min_workers (3) is above --max_workers (2)"),
    (["--address=nope"], "give the Ray head's HOST:PORT"),
    (["--hosts=a,b"], "Ray places the workers"),
])
def test_what_ray_cannot_run_is_one_line(args, needle):
    assert_usage_error(ray_launch(*args), needle)


PLUGIN = """
from tfdist.strategies.base import Launch
from tfdist.strategies.single import SingleDevice


class OwnLauncher(SingleDevice):
    name = "own_launcher"
    launch = Launch(ray="its ranks are started by its own launcher")
"""


def test_a_strategy_ray_cannot_run_is_one_line_naming_those_it_can(tmp_path):
    """A plugin whose processes are not Ray Train workers (`Launch.ray` says why; every built-in
    strategy that tfdist launch starts runs on Ray)."""
    (tmp_path / "own_launcher.py").write_text(PLUGIN)
    env = {**os.environ, "TFDIST_PLUGINS": "own_launcher=own_launcher:OwnLauncher",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    assert_usage_error(ray_launch("--strategy=own_launcher", env=env),
                       "--engine=ray cannot run own_launcher: its ranks are started by its own "
                       "launcher. On Ray: horovod, multi_worker_mirrored, parameter_server;")


def test_a_command_ray_cannot_run_is_one_line():
    """After --, `tfdist train` flags or a Python program (run in each Ray Train worker)."""
    assert_usage_error(tfdist("launch", "--engine=ray", "--", "sh", "-c", "true", check=False),
                       "--engine=ray runs `tfdist train` (its flags after --) or a Python program")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_an_address_nothing_listens_at_is_one_line():
    port = free_port()
    assert_usage_error(ray_launch(f"--address=127.0.0.1:{port}"),
                       f"cannot reach a Ray cluster at 127.0.0.1:{port} (")


@pytest.mark.slow
def test_an_address_that_never_answers_ends_within_the_bound():
    """A port that accepts and says nothing: Ray's own `ray.init` waited there for minutes (200 s
    and on, measured); tfdist gives up after 15 s (ray_train.CONNECT_TIMEOUT), once the run is
    prepared."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        start = time.monotonic()
        p = ray_launch(f"--address=127.0.0.1:{port}", timeout=120)
        took = time.monotonic() - start
    assert_usage_error(p, "no answer within 15 s")
    assert took < 60, took


# -- a user's program, written the way Ray's docs write one ---------------------------------------
PROGRAM = "launchers/ray/keras_on_ray.py"


def program_result(tmp_path, *args):
    out = tmp_path / f"losses{len(list(tmp_path.glob('losses*.json')))}.json"
    p = run([sys.executable, PROGRAM, f"--out={out}", *args], timeout=600)
    [line] = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def program_losses(tmp_path, *args):
    return program_result(tmp_path, *args)["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,zero", [
    pytest.param("multi_worker_mirrored", 0, marks=pytest.mark.long),  # (time: the tests above
    ("multi_worker_mirrored", 3),  # train under multi_worker_mirrored with Ray's TF_CONFIG too)
    pytest.param("horovod", 0, marks=pytest.mark.horovod)])
def test_a_users_ray_program_equals_one_process(tmp_path, strategy, zero):
    """2 Ray Train workers whose loop takes `tfdist.strategies.get(strategy, zero=...)` and whose
    trainer is `tfdist.launch.ray_train.trainer(strategy, ...)` (Ray's `DataParallelTrainer` with
    the backend the strategy's plugin names: a TF_CONFIG of worker tasks, or Horovod's Gloo
    rendezvous). The per-epoch losses equal the same loop's under `single`, without Ray, within
    1e-5 (measured: 1.2e-7 with zero=3, 1.3e-7 without)."""
    want = program_losses(tmp_path, "--no_ray", "--strategy=single")
    got = program_losses(tmp_path, "--workers=2", f"--strategy={strategy}", f"--zero={zero}")
    assert len(got) == len(want) == 3
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


def test_the_users_ray_program_compares_no_strategy_name():
    """The program is the same under every strategy: no line of it compares a strategy's name
    (the trainer comes from `tfdist.launch.ray_train.trainer`)."""
    import ast
    text = open(os.path.join(ROOT, PROGRAM)).read()
    names = {"horovod", "multi_worker_mirrored", "mirrored", "parameter_server", "single", "tpu"}
    compared = [ast.get_source_segment(text, node) for node in ast.walk(ast.parse(text))
                if isinstance(node, ast.Compare) and (
                    "strategy" in ast.get_source_segment(text, node) or
                    any(isinstance(c, ast.Constant) and c.value in names
                        for c in ast.walk(node)))]
    assert not compared, compared
    assert "ray_train import trainer" in text


def test_a_trainer_for_a_strategy_ray_cannot_run_is_one_line():
    """`trainer` refuses, naming why and what it runs: a one-process strategy, and one whose tasks
    only serve (the parameter server: `tfdist launch --engine=ray` runs it)."""
    pytest.importorskip("ray.train", reason="needs the ray extra (make test installs it)")
    from tfdist.errors import UsageError
    from tfdist.launch.ray_train import trainer
    for strategy, why in (("single", "it runs in one process"),
                          ("parameter_server", "tasks only serve")):
        with pytest.raises(UsageError) as e:
            trainer(strategy, lambda config: None)
        assert why in str(e.value) and "horovod, multi_worker_mirrored" in str(e.value), e.value
        assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("backup", [True, pytest.param(False, marks=pytest.mark.long)])
def test_keras_backup_and_restore_survives_a_ray_restart(tmp_path, backup):
    """Worker 1 of the user's program exits after epoch 2 (after Keras's BackupAndRestore wrote
    it) in the first attempt. Ray (max_failures=1) starts the group again and the backup resumes
    it at epoch 3: rank 0 ran epochs 1, 2, 3, and every epoch's loss equals the uninterrupted
    loop's within 1e-5. The companion (`backup=False`, `make test-long`): without the backup the
    restarted group runs epochs 1, 2, 1, 2, 3."""
    want = program_losses(tmp_path, "--no_ray", "--strategy=single")
    r = program_result(tmp_path, "--workers=2", "--strategy=multi_worker_mirrored",
                       "--fail_once_after_epoch=2", *([] if backup else ["--no_backup"]))
    assert r["restarted"], r
    assert r["epochs_run"] == ([1, 2, 3] if backup else [1, 2, 1, 2, 3]), r
    assert len(r["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(r["losses"], want)) <= 1e-5, (r, want)
