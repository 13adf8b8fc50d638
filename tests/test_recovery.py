"""A lost host costs seconds: a spare takes its place at once, and the group's state comes from
the surviving processes' memory (their host's keeper; a ZeRO shard's peer copy), at the newest
step every survivor completed: no step trained twice.

Three hosts on this machine: 127.0.0.1, .2 and .3 (each its own agent and keeper;
`tfdist launch --hosts`), the third a spare. The fault driver of worker 1 SIGKILLs its host's
agent after step KILL_AT (`--kill-host-at-step`): its processes and its keeper die with it.

Each test has its companion: the same run with the state from the disk backup instead (memory
snapshots off, or no peer copy of the lost shard) trains steps twice, and the check that none
ran twice catches it."""
import json
import sys
import time

import numpy as np
import pytest

from tests.helpers import (
    DRIVER,
    SINGLE_STEPS,
    assert_usage_error,
    free_port,
    losses,
    max_diff,
    reference_run,
    run,
    run_group,
    steps_by_worker,
    tfdist,
    weights,
)

STEPS = SINGLE_STEPS
HOSTS = "127.0.0.1,127.0.0.2,127.0.0.3"
KILL_AT = 7  # the disk backup is at step 5 then
TOLERANCE = 1e-5


def overrides(data_dir, strategy, **extra):
    return {**reference_run(data_dir), "strategy.name": strategy, "backup.enabled": True,
            "backup.every_steps": 5, **extra}


def lose_a_host(workdir, o):
    """The launch with a spare; worker 1's host lost after step KILL_AT. The launcher's output."""
    p = run_group([sys.executable, "-m", "tfdist", "launch", f"--strategy={o['strategy.name']}",
                   "--workers=2", f"--hosts={HOSTS}", "--spares=1", f"--port={free_port()}",
                   "--max_restarts=1", "--backoff=0", "--", sys.executable, DRIVER,
                   str(workdir), json.dumps(o), "--kill-host-at-step", str(KILL_AT),
                   "--kill-worker", "1", "--dump-weights"], timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "host 127.0.0.2 is lost: the spare host 127.0.0.3 takes its place" in p.stdout
    return p.stdout


def check(workdir, out, reference, sharded):
    """Resumed from memory at the step it was lost at: every step ran once, the losses are
    the reference's, the replicas' weights bitwise equal."""
    shard = ", each replica's shard" if sharded else ""
    assert f"at step {KILL_AT} of {STEPS} (the keepers' snapshots{shard}; the newest disk backup " \
           f"is at step 5)" in out, out[-4000:]
    assert steps_by_worker(workdir) == {0: STEPS, 1: STEPS}  # none trained twice
    got = losses(workdir)
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, reference)) <= TOLERANCE
    assert max_diff(weights(workdir, 0), weights(workdir, 1)) == 0.0


@pytest.mark.slow
def test_a_spare_takes_a_lost_hosts_place_with_the_state_of_its_peers_memory(
        tmp_path, data_dir, single_reference):
    """Data parallel (multi_worker_mirrored): the spare restores worker 1 from worker 0's
    keeper, at the step worker 0 completed; the companion resumes from the disk backup."""
    reference = losses(single_reference)
    o = overrides(data_dir, "multi_worker_mirrored")
    out = lose_a_host(tmp_path / "memory", o)
    check(tmp_path / "memory", out, reference, sharded=False)

    # the companion: no snapshots in memory, so the disk backup of step 5 (steps 6, 7 twice)
    out = lose_a_host(tmp_path / "disk", {**o, "backup.memory_every_steps": 0})
    assert f"resuming from {tmp_path / 'disk'}/backup at step 5 of {STEPS}" in out
    with pytest.raises(AssertionError):
        check(tmp_path / "disk", out, reference, sharded=False)
    assert steps_by_worker(tmp_path / "disk") == {0: STEPS + 2, 1: STEPS + 2}


@pytest.mark.slow
@pytest.mark.horovod
def test_a_lost_zero3_shard_is_rebuilt_from_its_peer_copy(tmp_path, data_dir, single_reference):
    """ZeRO-3 over 2 Horovod ranks: rank 1's shard (its weights and slots) dies with its host;
    its copy in rank 0's host's keeper rebuilds it on the spare. The companion keeps no peer
    copy (one every 1000 steps): no complete set in memory, so the disk backup."""
    reference = losses(single_reference)
    o = overrides(data_dir, "horovod", **{"zero.stage": 3})
    out = lose_a_host(tmp_path / "memory", o)
    check(tmp_path / "memory", out, reference, sharded=True)

    out = lose_a_host(tmp_path / "disk", {**o, "backup.peer_every_steps": 1000})
    assert f"resuming from {tmp_path / 'disk'}/backup at step 5 of {STEPS}" in out
    with pytest.raises(AssertionError):
        check(tmp_path / "disk", out, reference, sharded=True)


@pytest.mark.parametrize("args,needle", [
    (["--strategy=parameter_server", "--spares=1"],
     "--spares cannot serve strategy parameter_server: its state lives on the ps tasks"),
    (["--hosts=127.0.0.1,127.0.0.2", "--spares=1"],
     "--spares=1 needs 1 host(s) besides the 2 the 2 worker(s) take, and --hosts has 0 free"),
    (["--spares=1", "--max_restarts=0"], "--spares needs restarts"),
    (["--spares=1", "--min_workers=1"], "--spares keeps the group's size"),
    (["--spares=1", "--engine=ray"], "--spares is tfdist's own engine's"),
])
def test_spares_that_cannot_serve_are_one_line(args, needle):
    p = tfdist("launch", "--workers=2", *args, "--", "--config=configs/gpt_nano.py", check=False)
    line = assert_usage_error(p, needle)
    if "parameter_server" in args[0]:  # it says which strategies can
        assert "under horovod, multi_worker_mirrored" in line


def test_the_plan_is_the_newest_step_held_whole():
    """tfdist.launch.recovery.best: data parallel takes any replica's snapshot; ZeRO needs every
    replica's shard of one step; nothing complete is no plan."""
    from tfdist.launch import recovery

    def held(owner, step, sharded, size=2):
        return {"owner": owner, "step": step, "meta": {"sharded": sharded, "size": size}}
    dp = {"a": {"held": [held(0, 9, False), held(0, 8, False)]},
          "b": {"held": [held(1, 8, False)]}}
    assert recovery.best(dp)["step"] == 9 and recovery.best(dp)["sources"] == {"0": ["a"]}
    zero = {"a": {"held": [held(0, 9, True), held(0, 8, True)]},
            "b": {"held": [held(1, 8, True)]}}
    assert recovery.best(zero) == {"step": 8, "sharded": True, "size": 2,
                                   "sources": {"0": ["a"], "1": ["b"]}}
    assert recovery.best({"a": {"held": [held(0, 9, True)]}}) is None


def test_a_keeper_keeps_the_newest_and_its_anchor_and_settles():
    """Per owner the newest KEEP snapshots and the newest at a multiple of the anchor (the peer
    copies' interval); `settle` waits for a push under way; a closed push is dropped."""
    from tfdist.runtime import keeper
    server = keeper.serve_in_thread("127.0.0.1")
    try:
        k = keeper.Client(server.address)
        for step in range(1, 8):
            k.put(0, step, {"anchor": 5, "size": 1}, {"f": bytes([step])})
        assert sorted(h["step"] for h in k.list()["held"]) == [5, 6, 7]
        assert k.get(0, 5) == {"f": b"\x05"}
        k.pending(0, 8)
        other = keeper.Client(server.address)
        assert other.settle(timeout=0.5, quiet=0)["pending"] == [[0, 8]]  # (still under way)
        k.close()  # the push died with its process: nothing pending, nothing kept
        listing = other.settle(timeout=5, quiet=0)
        assert listing["pending"] == [] and max(h["step"] for h in listing["held"]) == 7
        with pytest.raises(keeper.KeeperError, match="no snapshot of rank 0 at step 8"):
            other.get(0, 8)
        other.close()
    finally:
        server.shutdown()


def test_the_keepers_weights_are_the_runs_own(tmp_path):
    """A snapshot restored (`tfdist.callbacks.memory.restore`) gives the model the values it had
    when the snapshot was taken, whatever it held since."""
    import keras

    from tfdist.callbacks import BackupAndRestore, memory
    from tfdist.runtime import keeper
    server = keeper.serve_in_thread("127.0.0.1")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=1, verbose=0)
    backup = BackupAndRestore(str(tmp_path / "backup"))
    backup.set_model(model)
    snaps = memory.MemorySnapshots(backup, {"local": server.address}, rank=0, size=1)
    backup.step.assign(4)
    before = [v.numpy().copy() for v in model.variables]
    snaps.take(4)
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), epochs=2, verbose=0)  # it changes on
    snaps.wait(timeout=60)
    plan = {"step": 4, "size": 1, "sharded": False, "sources": {"0": [server.address]}}
    assert memory.restore(backup, model, plan, rank=0, size=1)[0] == 4
    for a, b in zip(before, model.variables):
        np.testing.assert_array_equal(a, b.numpy())
    snaps.close()
    server.shutdown()


# A run stopped while a snapshot is in flight (a preemption raising `Preempted` out of `train`):
# Python 3.11's finalisation ends a thread still inside TensorFlow with pthread_exit, which TF's
# C++ code turns into SIGABRT (cpython#87135); `close` waits for the send first.
_STOPPED_WHILE_SENDING = """
import sys, time, keras
from tfdist.callbacks import BackupAndRestore, memory
from tfdist.runtime import keeper
server = keeper.serve_in_thread("127.0.0.1")
model = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(2048), keras.layers.Dense(2048)])
model.compile(optimizer="adam", loss="mse"); model.optimizer.build(model.trainable_variables)
backup = BackupAndRestore(sys.argv[1]); backup.set_model(model)
snaps = memory.MemorySnapshots(backup, {"local": server.address}, rank=0, size=1)
backup.step.assign(3); snaps.take(3)
time.sleep(0.2)  # (the send is inside TF's write then: 50 MB of state)
snaps.close()
sys.exit(75)
"""


def test_a_run_stopped_while_a_snapshot_is_sent_exits_with_its_own_status(tmp_path):
    p = run([sys.executable, "-c", _STOPPED_WHILE_SENDING, str(tmp_path / "backup")],
            timeout=120, check=False)
    assert p.returncode == 75, p.stderr[-2000:]
    assert "exception not rethrown" not in p.stderr


class _SlowKeeper:
    """A keeper client whose every call takes `seconds` (a stand-in: the send in flight)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def pending(self, rank, step):
        time.sleep(self.seconds)

    def put(self, *args):
        pass

    def close(self):
        pass


def _sending(tmp_path, seconds=1.0):
    """MemorySnapshots whose send of step 1 is in flight (its thread alive)."""
    import keras

    from tfdist.callbacks import BackupAndRestore, memory
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.build(model.trainable_variables)
    backup = BackupAndRestore(str(tmp_path / "backup"))
    backup.set_model(model)
    snaps = memory.MemorySnapshots(backup, {"local": "127.0.0.1:9"}, rank=0, size=1)
    snaps.local = _SlowKeeper(seconds)
    backup.step.assign(1)
    snaps.take(1)
    assert snaps._thread.is_alive()
    return snaps


def test_close_returns_once_the_snapshot_in_flight_is_sent(tmp_path):
    snaps = _sending(tmp_path)
    snaps.close()
    assert not snaps._thread.is_alive() and snaps._sent == 1


def test_without_the_wait_the_snapshot_thread_outlives_close(tmp_path):
    """The companion: closed as before (no wait), the thread is still sending, which is what a
    finalising Python then ends inside TensorFlow."""
    snaps = _sending(tmp_path)
    with snaps._cv:  # the close of before: the flag only
        snaps._closed = True
        snaps._cv.notify_all()
    assert snaps._thread.is_alive()
    snaps._thread.join(10)
