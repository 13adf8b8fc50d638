"""The tests' harness (tools/faults/harness.py, tests/helpers.py) leaves no process behind: every
process a command starts carries the command's mark (`harness.MARK`), through any launcher and
into sessions of its own, and when the command ends, by its exit or by its bound, what it left
is killed by PID. The suite's end checks it (conftest.py, `no_process_left`)."""
import os
import sys

import pytest

from tests.helpers import ROOT, run_group
from tools.faults import harness

#: A rank that says it started (a file named after its PID in the directory argv[1]) and never
#: ends.
RANK = ("import os, sys, time; open(os.path.join(sys.argv[1], str(os.getpid())), 'w'); "
        "time.sleep(600)")


def never_ends(directory):
    """`tfdist launch` of 2 Horovod ranks that never end: its agent runs in a session of its own,
    and so does each rank."""
    return [sys.executable, "-m", "tfdist", "launch", "--strategy=horovod", "--workers=2",
            "--max_restarts=0", "--", sys.executable, "-c", RANK, str(directory)]


def never_ends_in_sessions_of_their_own(directory):
    """A launcher of the same 2 ranks that starts each in a session of its own and leaves them
    there when it ends (as horovodrun's ranks outlived `tfdist launch` before its agents)."""
    code = ("import subprocess, sys, time\n"
            "for _ in range(2):\n"
            "    subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]],\n"
            "                     start_new_session=True)\n"
            "time.sleep(600)")
    return [sys.executable, "-c", code, RANK, str(directory)]


def sleepers(token):
    """The marked processes that run the ranks' program."""
    found = []
    for pid in harness.marked(token):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")[:-1]
        except OSError:
            continue
        if argv[1:3] == [b"-c", RANK.encode()]:  # (a rank: python -c RANK)
            found.append(pid)
    return found


@pytest.mark.slow
@pytest.mark.horovod
def test_a_timed_out_horovod_launch_leaves_no_process(tmp_path):
    """Bounded at 20 s: the command fails with its timeout after both ranks started, and then
    none of its processes is alive, its 2 ranks included."""
    before = set(harness.marked(prefix=f"{os.getpid()}-"))
    with pytest.raises(AssertionError, match="timed out after 20 s"):
        run_group(never_ends(tmp_path), 20)
    ranks = [int(name) for name in os.listdir(tmp_path)]
    assert len(ranks) == 2  # (they ran when the bound came)
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}/cmdline")
                and open(f"/proc/{pid}/cmdline", "rb").read()]  # (a zombie's is empty)
    assert set(harness.marked(prefix=f"{os.getpid()}-")) == before  # (none: what it left is gone)


@pytest.mark.slow
def test_without_the_mark_the_ranks_outlive_their_timed_out_launcher(tmp_path):
    """The companion: the launcher's process group killed at the bound, as the harness did before
    the mark, leaves both ranks running (found here by the mark, and then killed). (tfdist
    launch's own ranks die with their host's agent, which ends when the launcher does: the
    launcher here is one whose ranks live in sessions of their own.)"""
    import signal
    import subprocess
    import time
    token = harness.new_mark()
    p = subprocess.Popen(never_ends_in_sessions_of_their_own(tmp_path), cwd=ROOT,
                         start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, harness.MARK: token})
    try:
        harness.wait_until(lambda: len(sleepers(token)) == 2, 120, "2 ranks sleeping", proc=p)
        os.killpg(p.pid, signal.SIGKILL)  # the old bound: the group of the command alone
        p.wait(timeout=30)
        time.sleep(3)  # (time for anything that would end them)
        assert len(sleepers(token)) == 2
    finally:
        harness.end_marked(token)
    assert not harness.marked(token)
