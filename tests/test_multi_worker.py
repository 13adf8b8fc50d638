"""MultiWorkerMirrored: Keras 3 `fit` across 2 local worker processes equals single-process training."""
import json
import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import DRIVER, ROOT, driver

STEPS = 20


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_workers(workdir, overrides, n=2, extra=(), timeout=300):
    """Starts n workers on 127.0.0.1 with their TF_CONFIG; kills (by PID) any still running."""
    addrs = [f"127.0.0.1:{p}" for p in free_ports(n)]
    procs = []
    for i in range(n):
        tf_config = json.dumps({"cluster": {"worker": addrs}, "task": {"type": "worker", "index": i}})
        procs.append(subprocess.Popen(
            [sys.executable, DRIVER, str(workdir), json.dumps(overrides), *extra], cwd=ROOT,
            env={**os.environ, "TF_CONFIG": tf_config}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs


def common(data_dir):
    return {"data.data_dir": data_dir, "train.steps": STEPS, "train.steps_per_epoch": 10,
            "train.batch_size": 16, "backup.enabled": False}


def losses(workdir):
    return [r["loss"] for r in json.load(open(os.path.join(workdir, "metrics.json")))["steps"]]


@pytest.mark.slow
def test_two_workers_match_single_process_step_for_step(tmp_path, data_dir):
    driver(tmp_path / "single", {**common(data_dir), "strategy.name": "single"})
    codes, outs = run_workers(tmp_path / "mw", {**common(data_dir),
                                                "strategy.name": "multi_worker_mirrored"})
    assert codes == [0, 0], [o[1][-2000:] for o in outs]
    assert "worker 0 of 2, 2 replica(s) in sync" in outs[0][0]
    a, b = losses(tmp_path / "single"), losses(tmp_path / "mw")
    assert len(a) == len(b) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    results = [json.loads(o[0].split("DRIVER_RESULT ")[1]) for o in outs]
    assert results[0]["val_loss"] == pytest.approx(results[1]["val_loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("fix,needle", [(1, "PerReplica"), (2, "")])
def test_each_keras_correction_is_needed(tmp_path, data_dir, fix, needle):
    """Without correction 1 fit fails; without 2 it fails or reports only worker 0's loss."""
    driver(tmp_path / "single", {**common(data_dir), "strategy.name": "single",
                                 "train.steps": 10})
    codes, outs = run_workers(tmp_path / "mw", {**common(data_dir), "train.steps": 10,
                                                "strategy.name": "multi_worker_mirrored"},
                              extra=("--skip-keras-fix", str(fix)))
    if fix == 1:
        assert codes != [0, 0]
    if codes != [0, 0]:
        assert needle in "".join(o[1] for o in outs)
        return
    a, b = losses(tmp_path / "single"), losses(tmp_path / "mw")
    assert max(abs(x - y) for x, y in zip(a, b)) > 1e-3  # the losses are wrong without it
