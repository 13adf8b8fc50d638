"""Warm workers (tfdist/launch/agent.py, warm.py): a process an agent starts is a real process
of its own, started as a fork of a process that has imported TensorFlow, Keras and tfdist and
whose TensorFlow runtime has not started; a fork that could not be one starts cold (an exec)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, run
from tfdist.launch.warm import Agent


@pytest.fixture(scope="module")
def agent():
    a = Agent(dict(os.environ), cwd=ROOT)
    a.ready()
    yield a
    a.close()


def spawn(agent, code, env=None, name="w1"):
    return agent.spawn([sys.executable, "-c", code], {**os.environ, **(env or {})}, ROOT, name)


def output(p):
    chunks = []
    while True:
        chunk = os.read(p.stdout_fd, 1 << 16)
        if not chunk:
            return b"".join(chunks).decode()
        chunks.append(chunk)


def test_the_agent_imported_everything_and_started_no_runtime(agent):
    """Its ready report: TensorFlow, Keras and tfdist imported, and no reason not to fork."""
    assert agent.info["refused"] is None
    assert agent.info["import_s"] > 0 and agent.keeper.startswith("127.0.0.1:")


def test_a_warm_process_is_a_process_of_its_own(agent):
    """Its own pid, session and process group, environment, directory, name and exit status."""
    code = ("import json, os, sys, threading\n"
            "from tfdist import compat\n"
            "print(json.dumps({'pid': os.getpid(), 'sid': os.getsid(0), 'pgid': os.getpgid(0),\n"
            "    'env': os.environ.get('TF_CONFIG'), 'cwd': os.getcwd(),\n"
            "    'started': compat.tf_runtime_started(), 'threads': threading.active_count(),\n"
            "    'imported': 'tensorflow' in sys.modules}))\n"
            "sys.exit(7)")
    p = spawn(agent, code, {"TF_CONFIG": '{"task": 1}'})
    assert p.wait(timeout=60) == 7
    seen = json.loads(output(p).strip().splitlines()[-1])
    assert p.how == "warm" and seen["pid"] == p.pid != agent.proc.pid
    assert seen["sid"] == seen["pgid"] == p.pid  # a session and process group of its own
    assert seen["env"] == '{"task": 1}' and seen["cwd"] == ROOT
    # TensorFlow was imported before the fork, its runtime was not started
    assert seen["imported"] and seen["started"] is False and seen["threads"] == 1


def test_signals_reach_it_and_its_title_names_its_task(agent):
    p = spawn(agent, "import time; time.sleep(60)", name="w1")
    assert p.started.wait(30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # (the fork titles itself first thing)
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            if f.read().startswith(b"tfdist-w1"):
                break
        time.sleep(0.05)
    from tfdist.launch.local import task_of
    assert task_of(p.pid) == ("worker", 1)
    p.terminate()
    assert p.wait(timeout=30) == -signal.SIGTERM


def test_an_uncaught_error_is_a_traceback_and_status_1(agent):
    p = spawn(agent, "raise ValueError('boom')")
    assert p.wait(timeout=60) == 1
    assert "ValueError: boom" in output(p)


def test_a_variable_read_at_start_makes_it_start_cold(agent):
    """A TF_* variable that the agent's TensorFlow read at import differs: an exec, said why."""
    p = spawn(agent, "import os; print(os.environ['TF_CPP_MIN_LOG_LEVEL'])",
              {"TF_CPP_MIN_LOG_LEVEL": "1"})
    assert p.wait(timeout=120) == 0
    assert p.how == "cold" and "TF_CPP_MIN_LOG_LEVEL differs" in p.why
    assert output(p).strip() == "1"


def test_its_processes_die_with_the_agent():
    """PR_SET_PDEATHSIG: a process cannot outlive its host's agent."""
    a = Agent(dict(os.environ), cwd=ROOT, warm=False)  # (no imports needed for this)
    a.ready()
    p = a.spawn([sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ), ROOT,
                "w0")
    assert p.started.wait(30)
    os.kill(a.proc.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL and p.host_lost
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{p.pid}") and time.monotonic() < deadline:
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{p.pid}") or open(f"/proc/{p.pid}/stat").read().rsplit(
        ")", 1)[1].split()[0] == "Z"
    a.close()


def test_a_process_whose_runtime_started_forks_no_worker():
    """The guarantee's check (tfdist.runtime.process.why_not_fork) fails once an op has run: TF's
    eager context and its thread pools exist, and the agent would start every process cold."""
    code = ("from tfdist.runtime import process\n"
            "from tfdist.runtime.console import quiet_tensorflow_import\n"
            "quiet_tensorflow_import()\n"
            "import tensorflow as tf\n"
            "print(process.why_not_fork())\n"
            "tf.constant(1.0) + 1\n"
            "print(process.why_not_fork())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    before, after = p.stdout.strip().splitlines()[-2:]
    assert before == "None", p.stdout + p.stderr
    assert "TensorFlow's runtime" in after, after


@pytest.mark.slow
def test_tfdist_launch_starts_its_workers_warm_and_cold(tmp_path):
    """`tfdist launch` says how it started them; `--cold` execs each (its TF_CONFIG then in its
    own environment block)."""
    code = ("import json, os, sys\n"
            "print('TASK', json.loads(os.environ['TF_CONFIG'])['task']['index'], "
            "'tensorflow' in sys.modules)")
    for cold in (False, True):
        p = run([sys.executable, "-m", "tfdist", "launch", "--workers=2", "--max_restarts=0",
                 *(["--cold"] if cold else []), "--", sys.executable, "-c", code], timeout=300)
        how = "cold (tfdist launch --cold)" if cold else "warm"
        assert f"started 2 worker(s) {how} on" in p.stdout, p.stdout
        for w in (0, 1):  # a warm worker has TensorFlow imported already
            assert f"[w{w}] TASK {w} {not cold}" in p.stdout, p.stdout


LAUNCHER = """
import json, os, sys
from tfdist.launch.warm import Agent, keep_a_fork
keep_a_fork()  # (as `tfdist launch` does first)
env = {**os.environ, **json.loads(sys.argv[1])}
a = Agent(env)
info = a.ready()
with open(f"/proc/{info['pid']}/stat") as f:
    parent = int(f.read().rsplit(")", 1)[1].split()[1])
w = a.spawn([sys.executable, "-c", "import sys; sys.exit(5)"], env, os.getcwd(), "w0")
code = w.wait(timeout=120)
a.close()
print(json.dumps({"launcher": os.getpid(), "agent": info["pid"], "parent": parent,
                  "import_s": info["import_s"], "how": w.how, "code": code}))
"""


def launcher_agent(extra):
    p = run([sys.executable, "-c", LAUNCHER, json.dumps(extra)], timeout=300)
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_warm_launchers_agent_is_a_fork_of_it_with_nothing_to_import():
    """A launcher started warm (the tests start every launch so) keeps a fork of itself, which
    becomes its agent: the agent's parent is the launcher, it imported nothing, and the processes
    it starts are warm forks with their own status. The companion: an environment that differs in
    a variable read at start (OMP_NUM_THREADS) gets a new interpreter, which imports everything
    (and the kept fork ends with the launcher)."""
    forked = launcher_agent({})
    assert forked["parent"] == forked["launcher"] and forked["import_s"] < 0.5, forked
    assert forked["how"] == "warm" and forked["code"] == 5
    fresh = launcher_agent({"OMP_NUM_THREADS": "1"})
    assert fresh["parent"] == fresh["launcher"] and fresh["import_s"] > 1.0, fresh
    assert fresh["how"] == "warm" and fresh["code"] == 5


def test_a_kept_fork_nobody_takes_ends_with_its_launcher():
    code = ("import os, sys\n"
            "from tfdist.launch import warm\n"
            "warm.keep_a_fork()\n"
            "print(warm._KEPT[0])\n")
    kept = int(run([sys.executable, "-c", code], timeout=120).stdout.split()[-1])
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{kept}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{kept}")
