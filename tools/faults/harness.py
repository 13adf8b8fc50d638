"""One harness for the tests and the tools: the command lines that start tfdist's processes (a
command, a local cluster through `tfdist launch`, the fault driver `tools/faults/faulty_train.py`),
running them with a bound, and reading what a run left (metrics.json, the steps each worker ran,
the weights) to compare runs. The tests use it through tests/helpers.py, the benchmarks and chaos
trials directly; it imports neither.

Example (what a finished run left):

    >>> import json, os, tempfile
    >>> from tools.faults import harness
    >>> run = tempfile.mkdtemp()
    >>> with open(os.path.join(run, "metrics.json"), "w") as f:
    ...     json.dump({"steps": [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 5.2}],
    ...                "evals": []}, f)
    >>> harness.losses(run)
    [5.5, 5.2]
    >>> harness.launch_argv(["--config=configs/gpt_nano.py"], strategy="horovod")[2:6]
    ['tfdist', 'launch', '--strategy=horovod', '--workers=2']
"""
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(ROOT, "tools", "faults", "faulty_train.py")


# -- command lines -------------------------------------------------------------------------------

def tfdist_argv(*args):
    """`python -m tfdist ARGS`."""
    return [sys.executable, "-m", "tfdist", *args]


def launch_argv(rest, strategy=None, workers=2, ps=None, max_restarts=2, backoff=0.5, extra=()):
    """`tfdist launch` of `workers` processes (with `ps` ps tasks, for the parameter server)
    running `rest`: `tfdist train` flags, or a command."""
    return tfdist_argv("launch", *([f"--strategy={strategy}"] if strategy else []),
                       f"--workers={workers}", *([f"--ps={ps}"] if ps else []),
                       f"--max_restarts={max_restarts}", f"--backoff={backoff}", *extra, "--",
                       *rest)


def driver_argv(workdir, overrides, *extra):
    """The fault driver (tools/faults/faulty_train.py) on `workdir` with config `overrides`."""
    return [sys.executable, DRIVER, str(workdir), json.dumps(overrides), *extra]


def relative(path):
    """`path` relative to the repository when it is inside it (configs/gpt_mini.py), else as
    given: what a committed result records, rather than the measuring machine's own paths."""
    absolute = os.path.abspath(path)
    if os.path.commonpath([absolute, ROOT]) == ROOT:
        return os.path.relpath(absolute, ROOT)
    return path


# -- running -------------------------------------------------------------------------------------

#: The environment variable that marks every process a command started here, its value the
#: command's own token. A process inherits it through any launcher (`tfdist launch`, horovodrun,
#: which starts its ranks in sessions of their own, and whose orphans no longer descend from the
#: command), so `end_marked` finds all of them, and kills them by PID.
MARK = "TFDIST_TEST_RUN"
_TOKENS = iter(range(1, 1 << 62))


def new_mark():
    """A token no other command of any process has: <pid>-<n>."""
    return f"{os.getpid()}-{next(_TOKENS)}"


def marked(token=None, prefix=None):
    """PIDs of the live processes whose environment has `MARK` = `token` (or a value that starts
    with `prefix`: the tokens of one process's commands are "<its pid>-..."; neither: any
    value), other than this one."""
    needle = f"{MARK}={token}".encode() if token else f"{MARK}={prefix or ''}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or a zombie's
            continue
        if any(v == needle or (token is None and v.startswith(needle)) for v in env):
            found.append(int(entry))
    return found


def end_marked(token=None, prefix=None, rounds=10):
    """SIGKILLs every process marked with `token` (or a token starting with `prefix`), by PID,
    until none is left (a process forked while the first ones were killed is found in the next
    round; `rounds` at most). Returns the PIDs it killed."""
    if not (token or prefix):
        raise ValueError("end_marked needs the token or prefix of this process's commands")
    killed = []
    for _ in range(rounds):
        pids = marked(token, prefix)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


def run_group(cmd, timeout, env=None, cwd=ROOT):
    """Runs `cmd` in a process group of its own, its processes marked (`MARK`). On timeout that
    group is killed and `TimeoutError` raised with the end of its output. When it ends, however it
    ends, every process it started that is still alive is killed (`end_marked`). Returns the
    CompletedProcess."""
    token = new_mark()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, **(env or {}), MARK: token})
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        end_marked(token)  # first: a process in a session of its own may hold the pipes open
        out, err = p.communicate(timeout=30)
        raise TimeoutError(f"{cmd[:6]} timed out after {timeout} s\n{out[-3000:]}\n"
                           f"{err[-2000:]}") from None
    finally:
        end_marked(token)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def wait_until(condition, timeout, what, proc=None, describe=lambda: ""):
    """Polls `condition()` until it is true. Fails (saying `what`, and `describe()`) if `proc`
    ends first, or after `timeout` seconds: a guard against a hang, not a measurement."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (status {proc.returncode}) before {what}\n"
                                 f"{describe()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s\n{describe()}")
        time.sleep(0.05)


def tagged(stdout, tag, prefix=r"\[w(\d+)\] "):
    """{process index: JSON} of the `<prefix><tag> {...}` lines of a launcher's output
    (`[w1] DRIVER_RESULT {...}`; horovodrun's is `[1]<stdout>:`)."""
    import re
    found = re.findall(rf"^{prefix}{re.escape(tag)} (.*)$", stdout, re.M)
    return {int(i): json.loads(r) for i, r in found}


# -- what a run left ------------------------------------------------------------------------------

def metrics(workdir):
    """The run's metrics.json: {"steps": [per logged step], "evals": [per evaluation]}."""
    with open(os.path.join(workdir, "metrics.json")) as f:
        return json.load(f)


def losses(workdir):
    """The logged training loss of every step."""
    return [r["loss"] for r in metrics(workdir)["steps"]]


def executed_steps(workdir):
    """The fault driver's executed_steps.txt: one [worker, pid, loss] per step run, across
    restarts."""
    path = os.path.join(workdir, "executed_steps.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.split() for line in f]


def steps_by_worker(workdir):
    """{worker index: steps it ran}, from executed_steps.txt."""
    counts = {}
    for worker, _, _ in executed_steps(workdir):
        counts[int(worker)] = counts.get(int(worker), 0) + 1
    return counts


def weights(workdir, worker):
    """The weights the fault driver's --dump-weights wrote for `worker` (weights-w<i>.npz)."""
    import numpy as np
    with np.load(os.path.join(workdir, f"weights-w{worker}.npz")) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def final_weights(workdir):
    """The weights of the run's saved model.keras."""
    import keras
    import numpy as np

    import tfdist.models.gpt  # noqa: F401  (registers the classes)
    m = keras.saving.load_model(os.path.join(workdir, "model.keras"), compile=False)
    return [np.asarray(w) for w in m.weights]


def max_diff(a, b):
    """Largest absolute difference between two equally long lists of arrays."""
    import numpy as np
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def committed_step(backup_dir):
    """The step the `checkpoint` index of `backup_dir` names as the latest (0: none yet)."""
    import re
    try:
        with open(os.path.join(backup_dir, "checkpoint")) as f:
            found = re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', f.read(), re.M)
    except FileNotFoundError:
        return 0
    return int(found.group(1)) if found else 0


def write_in_flight(backup_dir):
    """The step of a backup being written, read from the files: its `ckpt-N.index` is on disk
    while the `checkpoint` index names an earlier step (or none). None when no write is seen."""
    import re
    try:
        names = os.listdir(backup_dir)
    except FileNotFoundError:
        return None
    committed = committed_step(backup_dir)
    steps = [int(m.group(1)) for m in map(re.compile(r"ckpt-(\d+)\.index$").match, names) if m]
    newer = [n for n in steps if n > committed]
    return max(newer) if newer else None
