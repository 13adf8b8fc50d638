"""Helpers shared by the test modules. Fixtures and pytest hooks live in conftest.py; the test
modules import what they share from here, never from each other.

The harness the tests share with the tools (tools/faults/harness.py) comes through here: command
lines (`tfdist_argv`, `launch_argv`, `driver_argv` of the fault driver
tools/faults/faulty_train.py), `tagged` (JSON result lines of a launcher's prefixed output),
`wait_until` (poll with a deadline: a hang guard, not a timing), and what a run left: `metrics`,
`losses`, `executed_steps`, `steps_by_worker`, `weights`, `final_weights`, `max_diff`. The tests'
own:

* processes: `run` (a command with a hard timeout, a process of the tests' warm agent when it
  can),
  `tfdist` (the CLI), `run_group` (a process group killed on timeout), `driver` (the driver),
  `driver_group` (the driver as Horovod ranks or `tfdist launch` workers);
* errors: `tf_noise`, `one_error_line`, `assert_usage_error` (exit 2, one line, no traceback);
* `tree_digest` (nothing on disk changed);
* inputs: `load_config` (a file of configs/), `write_nanogpt`, `free_port`, `free_port_run`;
* tiers: `first_fast` (a CLI case family: its first case in `make test-fast`, the rest in the
  whole suite);
* `once` (a directory made once per test run, shared by both pytest processes: the prepared
  corpus, the single-process reference run);
* `descendants` and `task_of` (a launcher's tasks: its agents' children).
"""
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tfdist.launch.local import children, descendants, task_of  # noqa: F401  (for the tests)
from tools.faults import harness
from tools.faults.harness import (  # noqa: F401
    DRIVER,
    ROOT,
    driver_argv,
    executed_steps,
    final_weights,
    launch_argv,
    losses,
    max_diff,
    metrics,
    steps_by_worker,
    tagged,
    tfdist_argv,
    wait_until,
    weights,
)


# -- tiers ---------------------------------------------------------------------------------------
def first_fast(cases):
    """Parametrize cases of which only the first runs in `make test-fast`; the others are marked
    `slow` and run in the whole suite. For families of CLI cases where each case starts a
    `tfdist` process (about 3 s of TensorFlow import on this machine) to check one message."""
    def slow(c):
        if hasattr(c, "marks"):  # a pytest.param already: keep its marks and id
            return pytest.param(*c.values, marks=[*c.marks, pytest.mark.slow], id=c.id)
        return pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow)
    return [cases[0]] + [slow(c) for c in cases[1:]]


# -- made once per test run ----------------------------------------------------------------------
def once(root, name, make, timeout=1200):
    """`root/name`, made by `make(directory)` once per test run: the first pytest process to ask
    makes it while holding `root/name.lock`, the other waits for it (`timeout` s at most). A make
    that failed leaves no `.made` mark, so the next to ask makes it again from nothing."""
    directory = root / name
    with open(root / f"{name}.lock", "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{directory} was not made within {timeout} s by the "
                                       f"pytest process making it") from None
                time.sleep(0.2)
        if not (directory / ".made").exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            (directory / ".made").touch()
    return directory


SINGLE_STEPS = 20


def reference_run(data_dir):
    """The runs several families compare with one process (test_strategies, test_multi_worker,
    test_horovod, test_netcluster): gpt_nano, 20 steps of a global batch of 16, 10 steps per
    epoch, no backup. Its single-process run is conftest's `single_reference`, made once."""
    return {"data.data_dir": data_dir, "train.steps": SINGLE_STEPS, "train.steps_per_epoch": 10,
            "train.batch_size": 16, "backup.enabled": False}


def single_overrides(data_dir):
    return {**reference_run(data_dir), "strategy.name": "single"}


# -- processes -----------------------------------------------------------------------------------
_AGENT = None


def _agent():
    """This pytest process's warm agent (tfdist/launch/agent.py, as `tfdist launch` starts on
    each host): TensorFlow, Keras and tfdist imported once, each command a fork of it."""
    global _AGENT
    if _AGENT is None or not _AGENT.alive:
        import atexit

        from tfdist.launch.warm import Agent
        _AGENT = Agent(dict(os.environ), cwd=ROOT)
        atexit.register(_AGENT.close)
    return _AGENT


def _warm(cmd, env, timeout):
    """Runs `python <cmd[1:]>` as a process of the tests' agent; a CompletedProcess, or
    TimeoutExpired after `timeout` s (its process group killed)."""
    p = _agent().spawn(cmd, env, ROOT, "test", separate=True)
    out = {}
    readers = [threading.Thread(target=lambda fd=fd, k=k: out.__setitem__(k, _read_all(fd)),
                                daemon=True) for k, fd in (("out", p.stdout_fd),
                                                           ("err", p.stderr_fd))]
    for t in readers:
        t.start()
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(30)
        for t in readers:
            t.join(10)
        raise subprocess.TimeoutExpired(cmd, timeout, out.get("out", ""),
                                        out.get("err", "")) from None
    for t in readers:
        t.join(30)
    return subprocess.CompletedProcess(cmd, p.returncode, out.get("out", ""), out.get("err", ""))


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            os.close(fd)
            return b"".join(chunks).decode(errors="replace")
        chunks.append(chunk)


def run(cmd, timeout=300, env=None, check=True, fresh=False):
    """Runs a command with a hard timeout; the process is ours and is killed on timeout.

    A Python command of this interpreter (`python -m ...`, `python -c ...`, `python script.py`)
    runs as a process of the tests' warm agent (`_agent`): a fork of a process that has
    TensorFlow, Keras and tfdist imported (2-3 s of CPU here saved per command). The agent starts
    it fresh (an exec) itself when its environment changes what Python or TF read at start
    (`tfdist.launch.agent.READ_AT_START`); `fresh` does so for any command. Either way it is a
    process of its own, in a process group of its own."""
    token = harness.new_mark()  # (every process the command starts carries it)
    env = {**os.environ, **(env or {}), harness.MARK: token}
    try:
        if cmd[0] == sys.executable and len(cmd) > 1 and not fresh:
            p = _warm(list(cmd), env, timeout)
        else:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                               env=env)
    finally:
        harness.end_marked(token)  # what it left behind, in any session, by PID
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\n"
                             f"stderr:\n{p.stderr[-3000:]}")
    return p


def tfdist(*args, timeout=300, check=True, env=None, fresh=False):
    """`python -m tfdist ARGS` from the repository root (warm, as `run` starts it)."""
    return run(tfdist_argv(*args), timeout=timeout, check=check, env=env, fresh=fresh)


def run_group(cmd, timeout):
    """Runs `cmd` in its own process group; on timeout that group (ours) is killed. (A Python
    command as a process of the tests' agent, as `run` does.)"""
    if cmd[0] == sys.executable and len(cmd) > 1:
        try:
            return run(cmd, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{cmd[:6]} timed out after {timeout} s\n"
                                 f"{(e.stdout or '')[-3000:]}\n"
                                 f"{(e.stderr or '')[-2000:]}") from None
    try:
        return harness.run_group(cmd, timeout)
    except TimeoutError as e:
        raise AssertionError(str(e)) from None


def in_threads(n, work):
    """Runs `work(rank)` on `n` threads at once (workers, islands); returns {rank: its result}
    (the first exception raised in a thread, raised here)."""
    out, errors = {}, []

    def worker(r):
        try:
            out[r] = work(r)
        except Exception as e:  # noqa: BLE001 (raised below, in the test)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


def hashes(workdir, rank):
    """The weights' hashes after each step that the driver's worker `rank` wrote
    (`--hash-weights`)."""
    with open(os.path.join(workdir, f"weight_hashes-w{rank}.txt")) as f:
        return [line.split()[1] for line in f]


def driver(workdir, overrides, *extra, timeout=300, check=True, env=None):
    """Runs the fault driver (tools/faults/faulty_train.py); returns (CompletedProcess, result
    dict or None)."""
    p = run(driver_argv(workdir, overrides, *extra), timeout=timeout, check=check, env=env)
    line = [x for x in p.stdout.splitlines() if x.startswith("DRIVER_RESULT ")]
    return p, (json.loads(line[-1][len("DRIVER_RESULT "):]) if line else None)


def driver_group(workdir, overrides, *extra, ranks=2, timeout=300, check=True, max_restarts=None):
    """Runs the driver as `ranks` processes of `overrides["strategy.name"]` under `tfdist launch`
    (warm): Horovod ranks, which it starts itself (no restart unless `max_restarts`, as under
    horovodrun), or workers (restarting the group after a failure `max_restarts` times, once by
    default, as `make chaos` does). Returns the CompletedProcess."""
    strategy = overrides["strategy.name"]
    if max_restarts is None:
        max_restarts = 0 if strategy == "horovod" else 1
    cmd = [sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}",
           f"--workers={ranks}", f"--max_restarts={max_restarts}", "--backoff=0.5", "--",
           *driver_argv(workdir, overrides, *extra)]
    p = run_group(cmd, timeout)
    assert p.returncode == 0 or not check, p.stdout[-4000:] + p.stderr[-2000:]
    return p


# -- errors --------------------------------------------------------------------------------------
def tf_noise(line):
    """TensorFlow's C++ start-up lines (oneDNN notice, absl pre-init warning) are not ours."""
    return ("oneDNN custom operations" in line or "absl::InitializeLog" in line
            or line.startswith(("I0000", "W0000", "E0000")))


def one_error_line(p):
    """The single line a failed tfdist command leaves on stderr (TF's start-up lines aside)."""
    lines = [x for x in p.stderr.splitlines() if x.strip() and not tf_noise(x)]
    assert len(lines) == 1 and lines[0].startswith("tfdist: error: "), p.stderr[-3000:]
    return lines[0]


def assert_usage_error(p, needle):
    """Bad input: exit status 2 and one line `tfdist: error: ...` holding `needle`."""
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    line = one_error_line(p)
    assert needle in line, line
    return line


# -- what a run left -----------------------------------------------------------------------------
# -- gradient overlap (tfdist/parallel/buckets.py, tfdist/runtime/profiling.py) ------------------
OVERLAP_BUCKET_MB = 0.1  # gpt_nano's 0.46 MiB of gradients in 4 buckets


def assert_overlap(overlapped, not_overlapped, workers):
    """Each process's profiled step (train.profile_step) read back: in the `overlapped` run,
    gradient all-reduces were issued before its last backward op ended; in `not_overlapped` (the
    companion: strategy.overlap=off) there is one, issued after it. An order, not a timing.

    The tests that profile are in `make test-long`: in one of about ten 2-process runs here
    (`make test`, 2026-11-26) a process aborted in its profiled step ("free(): invalid pointer",
    SIGABRT, inside TF 2.21's profiler; not reproduced alone), which a suite must not depend on."""
    from tfdist.runtime import profiling
    for w in range(workers):
        on = profiling.overlap(profiling.read(os.path.join(overlapped, "profile", f"worker-{w}")))
        off = profiling.overlap(profiling.read(os.path.join(not_overlapped, "profile",
                                                            f"worker-{w}")))
        assert len(on["all_reduces"]) > 1 and on["issued_during_backward"] >= 1, on
        assert len(off["all_reduces"]) == 1 and off["issued_during_backward"] == 0, off


def tree_digest(root, exclude=()):
    """Hash of every file's path and content under root: proves nothing on disk changed. Files
    named in `exclude` are left out."""
    h = hashlib.sha1()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for f in sorted(set(filenames) - set(exclude)):
            p = os.path.join(dirpath, f)
            h.update(p.encode())
            with open(p, "rb") as data:
                h.update(data.read())
    return h.hexdigest()


# -- inputs --------------------------------------------------------------------------------------
def load_config(path):
    """`get_config()` of a config file (e.g. "configs/gpt_nano.py", relative to the repository)."""
    full = os.path.join(ROOT, path)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def write_nanogpt(directory, n_train=200_000, n_val=20_000, vocab=50257, seed=0):
    """train.bin / val.bin as nanoGPT's prepare.py writes them: np.memmap of uint16 ids."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    out = {}
    for name, n in (("train", n_train), ("val", n_val)):
        ids = rng.integers(0, vocab, n, dtype=np.uint16)
        arr = np.memmap(os.path.join(directory, f"{name}.bin"), dtype=np.uint16, mode="w+",
                        shape=(n,))
        arr[:] = ids
        arr.flush()
        out[name] = ids
    return out


def free_port():
    """A port free on 127.0.0.1 now (and closed: nothing listens on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n):
    """A port p such that p .. p+n-1 are free on 127.0.0.1 now."""
    for _ in range(100):
        socks = [socket.socket() for _ in range(n)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            port = socks[0].getsockname()[1]
            for i, s in enumerate(socks[1:], 1):
                s.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")
