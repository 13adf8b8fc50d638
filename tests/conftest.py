"""Shared fixtures. TF and the default corpus are prepared once per session in a private data_dir."""
import json
import os
import subprocess
import sys

import pytest

from tfdist.launch.local import children, task_of  # noqa: F401  (re-exported for tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "faulty_train.py")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data_dir with the default corpus (this Python's stdlib) prepared in it as a token store."""
    d = str(tmp_path_factory.mktemp("tfds"))
    from tfdist import config
    from tfdist.data import open_store

    c = config.default_config()
    c.data.data_dir = d
    open_store(c.data, progress=False)
    return d


def run(cmd, timeout=300, env=None, check=True):
    """Runs a command with a hard timeout; the process is ours and is killed on timeout."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\n"
                             f"stderr:\n{p.stderr[-3000:]}")
    return p


def tfdist(*args, timeout=300, check=True):
    return run([sys.executable, "-m", "tfdist", *args], timeout=timeout, check=check)


def driver(workdir, overrides, *extra, timeout=300, check=True):
    """Runs tests/faulty_train.py; returns (CompletedProcess, result dict or None)."""
    p = run([sys.executable, DRIVER, str(workdir), json.dumps(overrides), *extra],
            timeout=timeout, check=check)
    line = [x for x in p.stdout.splitlines() if x.startswith("DRIVER_RESULT ")]
    return p, (json.loads(line[-1][len("DRIVER_RESULT "):]) if line else None)


def executed_steps(workdir):
    path = os.path.join(workdir, "executed_steps.txt")
    if not os.path.exists(path):
        return []
    return [line.split() for line in open(path)]

