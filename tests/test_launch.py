"""`tfdist launch`: usage errors, TF_CONFIG per worker, prefixed output, supervision (restart with
backoff, restart limit, no restart on bad usage, signals), and the `tfdist train` form end to
end."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, first_fast, one_error_line, tfdist, wait_until

PY = sys.executable
BACKOFF = 0.2  # seconds before the first restart; it doubles at each one


def launch(*args, timeout=120):
    return tfdist("launch", f"--backoff={BACKOFF}", *args, timeout=timeout, check=False)


@pytest.mark.parametrize("args,needle", first_fast([
    ([], "nothing to run"),
    (["--workers=0", "--", "--config=configs/gpt_nano.py"], "--workers must be between 1 and 64"),
    (["--strategy=mirrored", "--", "--config=configs/gpt_nano.py"],
     "cannot start strategy 'mirrored'"),
    (["--", "--config=configs/gpt_nano.py", "--strategy=single"],
     "give the strategy to tfdist launch"),
    (["--max_restarts=-1", "--", PY, "-c", "pass"], "--max_restarts and --backoff must be >= 0"),
    (["--bind=everywhere", "--", PY, "-c", "pass"], "--bind"),
    (["--", "no-such-program", "x"], "cannot run 'no-such-program': not found"),
    (["--strategy=parameter_server", "--ps=0", "--", PY, "-c", "pass"],
     "--ps must be between 1 and 16"),
    (["--", "--config=configs/nope.py"], "config file 'configs/nope.py' not found"),
    (["--", "--config=configs/gpt_nano.py", "--config.model.n_layer=0"], "model.n_layer"),
    (["--hosts=no-such-host.invalid", "--", PY, "-c", "pass"],
     "cannot resolve host 'no-such-host.invalid'"),
    (["--hosts=,", "--", PY, "-c", "pass"], "--hosts is empty"),
    (["--hosts=127.0.0.1", "--port=70000", "--", PY, "-c", "pass"], "--port must be between"),
]))
def test_bad_usage_is_one_line_and_exit_2(args, needle):
    p = launch(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert needle in one_error_line(p)
    assert "started" not in p.stdout  # no worker was started


def test_hosts_place_the_tasks_round_robin_from_the_port():
    """--hosts: two tasks on one host (this machine: started directly) take --port and the next
    one; each is told its host's address to bind (TFDIST_BIND_ADDRESS). tests/test_netcluster.py
    starts tasks on other hosts, through ssh."""
    prog = ("import os, json; c = json.loads(os.environ['TF_CONFIG']); "
            "print('CONF', c['cluster']['worker'][c['task']['index']], "
            "os.environ['TFDIST_BIND_ADDRESS'])")
    p = launch("--hosts=127.0.0.1", "--port=23456", "--workers=2", "--max_restarts=0", "--", PY,
               "-c", prog)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(re.findall(r"CONF (\S+) (\S+)", p.stdout)) == [
        ("127.0.0.1:23456", "127.0.0.1"), ("127.0.0.1:23457", "127.0.0.1")], p.stdout


def test_each_worker_gets_its_tf_config_and_a_prefixed_output(tmp_path):
    n = 3
    prog = "import os; print('CONF', os.environ['TF_CONFIG'], os.environ['TFDIST_RESTART_COUNT'])"
    p = launch(f"--workers={n}", "--worker_logs", str(tmp_path), "--", PY, "-c", prog)
    assert p.returncode == 0, p.stderr
    confs = {}
    for line in p.stdout.splitlines():
        if " CONF " in line:
            prefix, _, rest = line.partition(" CONF ")
            conf, restart = rest.rsplit(" ", 1)
            confs[prefix] = (json.loads(conf), restart)
    assert sorted(confs) == [f"[w{i}]" for i in range(n)]
    addrs = confs["[w0]"][0]["cluster"]["worker"]
    assert len(set(addrs)) == n and all(a.startswith("127.0.0.1:") for a in addrs)
    for i in range(n):
        conf, restart = confs[f"[w{i}]"]
        assert conf == {"cluster": {"worker": addrs}, "task": {"type": "worker", "index": i}}
        assert restart == "0"
        assert "CONF" in open(tmp_path / f"w{i}.log").read()
    assert f"tfdist launch: done: {n} worker(s) finished" in p.stdout


# Worker 1 fails in the first FAILING attempts, once worker 0 is waiting. Worker 0 then waits for
# as long as its launcher lives: only the launcher stopping it (SIGTERM, which it records) ends it.
RESTARTED = """
import json, os, signal, sys, time
attempt, failing, log = int(os.environ["TFDIST_RESTART_COUNT"]), int(sys.argv[1]), sys.argv[2]
worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if attempt < failing:
    def note(line):
        with open(log, "a") as f:
            f.write(line + "\\n")
    if worker == 1:
        while f"{attempt} waiting" not in (open(log).read() if os.path.exists(log) else ""):
            time.sleep(0.05)
        sys.exit(5)
    def stopped(signum, frame):
        note(f"{attempt} stopped by {signal.Signals(signum).name}")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stopped)
    note(f"{attempt} waiting")
    launcher = os.getppid()
    while os.getppid() == launcher:
        time.sleep(0.1)
    note(f"{attempt} outlived the launcher")
"""


def test_a_failed_group_is_restarted_with_backoff_until_it_succeeds(tmp_path):
    failing, max_restarts, log = 2, 3, tmp_path / "worker0.log"
    p = launch("--workers=2", f"--max_restarts={max_restarts}", "--", PY, "-c", RESTARTED,
               str(failing), str(log))
    assert p.returncode == 0, p.stdout + p.stderr
    assert (f"worker 1 exited with status 5; stopped the others; restart 1 of {max_restarts} in "
            f"{BACKOFF:g} s") in p.stdout
    assert f"restart 2 of {max_restarts} in {2 * BACKOFF:g} s" in p.stdout  # the backoff doubles
    assert f"done: 2 worker(s) finished after {failing} restart(s)" in p.stdout
    assert p.stdout.count("started 2 worker(s)") == failing + 1
    # the waiting worker was stopped by the launcher in each failed attempt, not waited for
    assert log.read_text().splitlines() == [
        line for a in range(failing) for line in (f"{a} waiting", f"{a} stopped by SIGTERM")]


@pytest.mark.slow
def test_the_restart_budget_runs_out_with_exit_1():
    max_restarts = 2
    p = launch("--workers=2", f"--max_restarts={max_restarts}", "--", PY, "-c",
               "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert p.returncode == 1
    assert p.stdout.count("started 2 worker(s)") == max_restarts + 1
    assert (f"was killed by SIGKILL; gave up after {max_restarts} restart(s) "
            f"(--max_restarts={max_restarts})") in one_error_line(p)


@pytest.mark.slow
def test_a_worker_exiting_2_is_bad_usage_and_not_restarted():
    p = launch("--workers=2", "--max_restarts=3", "--", PY, "-c", "import sys; sys.exit(2)")
    assert p.returncode == 2
    assert p.stdout.count("started 2 worker(s)") == 1
    assert "exited with status 2 (bad usage); not restarting" in p.stdout


@pytest.mark.slow
def test_sigterm_stops_the_workers_and_exits_143(tmp_path):
    pidfile = tmp_path / "pids"
    prog = (f"import os, time; open({str(pidfile)!r}, 'a').write(f'{{os.getpid()}}\\n'); "
            "time.sleep(120)")
    p = subprocess.Popen([PY, "-m", "tfdist", "launch", "--workers=2", "--", PY, "-c", prog],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: pidfile.exists() and len(pidfile.read_text().split()) >= 2, 60,
                   "pid of both workers", proc=p)
        workers = [int(x) for x in pidfile.read_text().split()]
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM; workers stopped" in out
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()


@pytest.mark.slow
def test_train_form_prepares_once_and_overwrite_is_not_passed_to_workers(tmp_path, data_dir):
    """`-- <train flags>`: the prepare step applies --overwrite once; the workers get none (a
    restarted group must resume, not start over) and train the whole run."""
    (tmp_path / "model.keras").write_text("an earlier finished run")
    steps = 4
    flags = ["--config=configs/gpt_nano.py", f"--workdir={tmp_path}",
             f"--config.data.data_dir={data_dir}", f"--config.train.steps={steps}",
             "--config.train.steps_per_epoch=2", "--config.train.warmup_steps=1",
             "--config.train.eval_steps=1"]
    p = launch("--workers=2", "--", *flags, timeout=300)
    assert p.returncode == 2 and "already holds a finished run" in one_error_line(p)
    assert (tmp_path / "model.keras").read_text() == "an earlier finished run"  # untouched
    p = launch("--workers=2", "--", *flags, "--overwrite", timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert f"tfdist: prepared {tmp_path}" in p.stdout
    assert "[w0] tfdist: multi_worker_mirrored: worker 0 of 2, 2 replica(s) in sync" in p.stdout
    assert f"[w0] tfdist: done: {steps} steps run (step {steps} of {steps})" in p.stdout
    assert (tmp_path / "model.keras").stat().st_size > 10000
