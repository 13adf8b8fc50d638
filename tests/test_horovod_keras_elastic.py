"""`tfdist.horovod.keras.elastic`, Horovod's elastic Keras API on Keras 3: a program in the form of
Horovod's docs (tests/support/horovod_keras_elastic.py) runs under `horovodrun --min-np 1 --max-np 2
--host-discovery-script`; a rank killed, the job goes on at 1; the slot offered again, it is back
at 2; the loss falls and the ranks end identical. With Horovod's own `horovod.tensorflow.keras`
the same program crashes (the companion)."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import ROOT
from tests.test_horovod_keras import HOROVOD, TFDIST, program
from tfdist.launch.local import descendants

pytestmark = [pytest.mark.horovod, pytest.mark.slow]
TIMEOUT = 300  # seconds for a whole run; every wait below is bounded by it
EPOCHS = 20  # long enough at size 1 for the returning rank to start on a busy machine


class Elastic:
    """`horovodrun` elastic over this machine under two names (`localhost:1`, `127.0.0.1:1`: the
    driver blacklists the host of a failed worker, so one name would end the job), in a process
    group of its own; its output lines collected as they come."""

    def __init__(self, tmp_path, prog):
        self.hosts = tmp_path / "hosts.txt"
        self.offer("localhost:1", "127.0.0.1:1")
        discover = tmp_path / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {self.hosts}\n")
        discover.chmod(0o755)
        exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        self.p = subprocess.Popen(
            [exe, "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
             str(discover), "--network-interface", "lo", "--blacklist-cooldown-range", "1", "2",
             sys.executable, prog], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
            env={**os.environ, "PYTHONPATH": ROOT, "EPOCHS": str(EPOCHS)})
        self.lines = []
        threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True).start()
        self.deadline = time.monotonic() + TIMEOUT

    def offer(self, *hosts):
        self.hosts.write_text("".join(f"{h}\n" for h in hosts))

    def tagged(self, tag):
        return [json.loads(m.group(1)) for line in list(self.lines)
                for m in [re.search(rf"{tag} (\{{.*\}})$", line.rstrip())] if m]

    def wait_for(self, condition, what):
        while not condition():
            if self.p.poll() is not None or time.monotonic() > self.deadline:
                self.stop()
                raise AssertionError(f"no {what}: horovodrun exit {self.p.returncode}\n"
                                     + "".join(self.lines)[-4000:])
            time.sleep(0.1)

    def rank_on(self, host):
        """The PID of the worker horovodrun started for `host` (ours: its descendant)."""
        for pid in descendants(self.p.pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if f"HOROVOD_HOSTNAME={host}".encode() in env and b"horovod_keras_elastic" in cmd:
                return pid
        return None

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)  # our group: horovodrun and its ranks
        self.p.wait()

    def end(self):
        self.wait_for(lambda: self.p.poll() is not None, "end")
        self.stop()
        return "".join(self.lines)


def test_a_keras_elastic_program_shrinks_and_grows_back_with_one_line_changed(tmp_path):
    run = Elastic(tmp_path, program("horovod_keras_elastic.py", tmp_path, "tfdist"))
    run.wait_for(lambda: any(e["epoch"] >= 2 for e in run.tagged("EPOCH")), "epoch 2")
    victim = run.rank_on("127.0.0.1")
    assert victim, "".join(run.lines)[-3000:]
    run.offer("localhost:1")  # the slot gone from the discovery output, and its worker killed
    os.kill(victim, signal.SIGKILL)
    run.wait_for(lambda: any(e["size"] == 1 for e in run.tagged("EPOCH")), "epoch at size 1")
    at_one = len(run.tagged("EPOCH"))
    run.offer("localhost:1", "127.0.0.1:1")  # the slot back
    run.wait_for(lambda: any(e["size"] == 2 for e in run.tagged("EPOCH")[at_one:]),
                 "epoch at size 2 again")
    out = run.end()
    assert run.p.returncode == 0, out[-4000:]
    sizes = [e["size"] for e in run.tagged("EPOCH")]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    results = run.tagged("RESULT")
    assert len(results) == 2 and {r["size"] for r in results} == {2}, out[-3000:]
    assert {r["epochs"] for r in results} == {EPOCHS}
    assert results[0]["weights"] == results[1]["weights"]  # the ranks end identical
    losses = [e["loss"] for e in run.tagged("EPOCH")]
    assert losses[-1] < 0.5 * losses[0], losses  # the loss falls
    assert "Traceback" not in out


def test_with_horovods_own_keras_api_the_elastic_program_crashes(tmp_path):
    run = Elastic(tmp_path, program("horovod_keras_elastic.py", tmp_path, "horovod"))
    out = run.end()
    assert HOROVOD != TFDIST
    assert run.p.returncode != 0, "Horovod's own elastic Keras API worked on Keras 3: the " \
                                  "drop-in may no longer be needed"
    assert "'list' object is not callable" in out, out[-3000:]  # horovod/horovod#4290
