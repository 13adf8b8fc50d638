"""`tfdist launch`: usage errors, TF_CONFIG per worker, prefixed output, supervision (restart with
backoff, restart limit, no restart on bad usage, signals), and the `tfdist train` form end to end."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, tfdist
from tests.test_cli import _tf_noise

PY = sys.executable


def launch(*args, timeout=120):
    return tfdist("launch", "--backoff=0.2", *args, timeout=timeout, check=False)


def one_error_line(p):
    lines = [x for x in p.stderr.splitlines() if x.strip() and not _tf_noise(x)]
    assert len(lines) == 1 and lines[0].startswith("tfdist: error: "), p.stderr
    return lines[0]


@pytest.mark.parametrize("args,needle", [
    ([], "nothing to run"),
    (["--workers=0", "--", "--config=configs/gpt_nano.py"], "--workers must be between 1 and 64"),
    (["--strategy=mirrored", "--", "--config=configs/gpt_nano.py"], "cannot start strategy 'mirrored'"),
    (["--", "--config=configs/gpt_nano.py", "--strategy=single"], "give the strategy to tfdist launch"),
    (["--max_restarts=-1", "--", PY, "-c", "pass"], "--max_restarts and --backoff must be >= 0"),
    (["--bind=everywhere", "--", PY, "-c", "pass"], "--bind"),
    (["--", "no-such-program", "x"], "cannot run 'no-such-program': not found"),
    (["--strategy=parameter_server", "--ps=0", "--", PY, "-c", "pass"], "--ps must be between 1 and 16"),
    (["--", "--config=configs/nope.py"], "config file 'configs/nope.py' not found"),
    (["--", "--config=configs/gpt_nano.py", "--config.model.n_layer=0"], "model.n_layer"),
])
def test_bad_usage_is_one_line_and_exit_2(args, needle):
    p = launch(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert needle in one_error_line(p)
    assert "started" not in p.stdout  # no worker was started


def test_each_worker_gets_its_tf_config_and_a_prefixed_output(tmp_path):
    prog = "import os; print('CONF', os.environ['TF_CONFIG'], os.environ['TFDIST_RESTART_COUNT'])"
    p = launch("--workers=3", "--worker_logs", str(tmp_path), "--", PY, "-c", prog)
    assert p.returncode == 0, p.stderr
    confs = {}
    for line in p.stdout.splitlines():
        if " CONF " in line:
            prefix, _, rest = line.partition(" CONF ")
            conf, restart = rest.rsplit(" ", 1)
            confs[prefix] = (json.loads(conf), restart)
    assert sorted(confs) == ["[w0]", "[w1]", "[w2]"]
    addrs = confs["[w0]"][0]["cluster"]["worker"]
    assert len(set(addrs)) == 3 and all(a.startswith("127.0.0.1:") for a in addrs)
    for i in range(3):
        conf, restart = confs[f"[w{i}]"]
        assert conf == {"cluster": {"worker": addrs}, "task": {"type": "worker", "index": i}}
        assert restart == "0"
        assert "CONF" in open(tmp_path / f"w{i}.log").read()
    assert "tfdist launch: done: 3 worker(s) finished" in p.stdout


def test_a_failed_group_is_restarted_with_backoff_until_it_succeeds():
    # worker 1 fails in the first two attempts; the others would wait forever without the stop.
    prog = ("import os, sys, time; r = int(os.environ['TFDIST_RESTART_COUNT']); "
            "i = __import__('json').loads(os.environ['TF_CONFIG'])['task']['index']; "
            "sys.exit(5) if (i == 1 and r < 2) else time.sleep(0 if r == 2 else 60)")
    t = time.monotonic()
    p = launch("--workers=2", "--max_restarts=3", "--", PY, "-c", prog)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "worker 1 exited with status 5; stopped the others; restart 1 of 3 in 0.2 s" in p.stdout
    assert "restart 2 of 3 in 0.4 s" in p.stdout  # the backoff doubles
    assert "done: 2 worker(s) finished after 2 restart(s)" in p.stdout
    assert time.monotonic() - t < 40  # the sleeping worker was stopped, not waited for


def test_the_restart_budget_runs_out_with_exit_1():
    p = launch("--workers=2", "--max_restarts=2", "--", PY, "-c",
               "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert p.returncode == 1
    assert p.stdout.count("started 2 worker(s)") == 3
    assert "was killed by SIGKILL; gave up after 2 restart(s) (--max_restarts=2)" in one_error_line(p)


def test_a_worker_exiting_2_is_bad_usage_and_not_restarted():
    p = launch("--workers=2", "--max_restarts=3", "--", PY, "-c", "import sys; sys.exit(2)")
    assert p.returncode == 2
    assert p.stdout.count("started 2 worker(s)") == 1
    assert "exited with status 2 (bad usage); not restarting" in p.stdout


def test_sigterm_stops_the_workers_and_exits_143(tmp_path):
    pidfile = tmp_path / "pids"
    prog = f"import os, time; open({str(pidfile)!r}, 'a').write(f'{{os.getpid()}}\\n'); time.sleep(120)"
    p = subprocess.Popen([PY, "-m", "tfdist", "launch", "--workers=2", "--", PY, "-c", prog],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not pidfile.exists() or
                                               len(pidfile.read_text().split()) < 2):
            time.sleep(0.1)
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
    flags = ["--config=configs/gpt_nano.py", f"--workdir={tmp_path}",
             f"--config.data.data_dir={data_dir}", "--config.train.steps=4",
             "--config.train.steps_per_epoch=2", "--config.train.warmup_steps=1",
             "--config.train.eval_steps=1"]
    p = launch("--workers=2", "--", *flags, timeout=300)
    assert p.returncode == 2 and "already holds a finished run" in one_error_line(p)
    assert (tmp_path / "model.keras").read_text() == "an earlier finished run"  # untouched
    p = launch("--workers=2", "--", *flags, "--overwrite", timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert f"tfdist: prepared {tmp_path}" in p.stdout
    assert "[w0] tfdist: multi_worker_mirrored: worker 0 of 2, 2 replica(s) in sync" in p.stdout
    assert "[w0] tfdist: done: 4 steps run (step 4 of 4)" in p.stdout
    assert (tmp_path / "model.keras").stat().st_size > 10000
