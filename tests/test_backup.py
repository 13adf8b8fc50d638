"""Step-exact BackupAndRestore: SIGKILL at a random step (and inside a save), restart, compare;
damaged backups, a full disk, the end window, preemption (SIGTERM) and the workdir lock."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    DRIVER,
    ROOT,
    assert_usage_error,
    driver,
    executed_steps,
    final_weights,
    harness,
    tree_digest,
    wait_until,
)
from tfdist import callbacks as cb
from tfdist.errors import EXIT_PREEMPTED, UsageError
from tfdist.models.gpt import GPT
from tfdist.runtime.lock import LOCK_NAME

STEPS, PER_EPOCH = 30, 10


def overrides(data_dir, **extra):
    o = {"data.data_dir": data_dir, "train.steps": STEPS, "train.steps_per_epoch": PER_EPOCH,
         "train.batch_size": 8, "train.deterministic": True, "train.eval_steps": 2,
         "model.dropout": 0.1, "backup.delete_on_success": True}
    o.update(extra)
    return o


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """An uninterrupted run, per backup interval used below."""
    runs = {}
    for every in (1, 4):
        d = tmp_path_factory.mktemp(f"ref{every}")
        driver(d, overrides(data_dir, **{"backup.every_steps": every}))
        assert len(executed_steps(d)) == STEPS
        runs[every] = final_weights(d)
    return runs


# Seeded random kill steps: mid-epoch and epoch-boundary cases both occur over the trials.
KILLS = [(1, random.Random(7).randint(2, STEPS - 2)), (4, random.Random(11).randint(2, STEPS - 2))]


@pytest.mark.slow
@pytest.mark.parametrize("every,kill_at", [  # the second repeats the first at another cadence
    KILLS[0], pytest.param(*KILLS[1], marks=pytest.mark.long)])
def test_sigkill_at_random_step_then_restart_is_step_exact(tmp_path, data_dir, reference,
                                                           every, kill_at):
    o = overrides(data_dir, **{"backup.every_steps": every})
    p, _ = driver(tmp_path, o, "--kill-at-step", str(kill_at), check=False)
    assert p.returncode == -9, p.stderr[-2000:]  # really SIGKILLed
    first = executed_steps(tmp_path)
    assert len(first) == kill_at
    # the dead run's lock is still on disk, naming it; the kernel dropped its flock: no obstacle
    assert f'"pid": {first[0][1]}' in (tmp_path / LOCK_NAME).read_text()
    _, result = driver(tmp_path, o)
    resumed_at = kill_at // every * every  # the last backup before the kill
    assert result["steps_run"] == STEPS - resumed_at and result["final_step"] == STEPS
    assert len(executed_steps(tmp_path)) - len(first) == STEPS - resumed_at
    if every == 1:  # a backup after every step: executed steps add up exactly to the plan
        assert len(executed_steps(tmp_path)) == STEPS
    for a, b in zip(final_weights(tmp_path), reference[every]):
        np.testing.assert_array_equal(a, b)  # bitwise, with op determinism (and dropout RNG)
    assert not os.path.exists(tmp_path / "backup")  # removed after a successful end


@pytest.mark.slow
def test_kill_inside_a_save_leaves_the_previous_backup_usable(tmp_path, data_dir, reference):
    every, dying = 4, 3  # dies inside the 3rd save
    # backups at every 4th step and at each epoch end: 4, 8, 10, 12, ...
    saves = sorted({s for s in range(1, STEPS + 1) if s % every == 0 or s % PER_EPOCH == 0})
    o = overrides(data_dir, **{"backup.every_steps": every})
    p, _ = driver(tmp_path, o, "--kill-in-save", str(dying), check=False)
    assert p.returncode == -9
    latest, half_written = saves[dying - 2], saves[dying - 1]
    assert tf.train.latest_checkpoint(str(tmp_path / "backup")).endswith(f"ckpt-{latest}")
    # the half-finished save
    assert os.path.exists(tmp_path / "backup" / f"ckpt-{half_written}.index")
    _, result = driver(tmp_path, o)
    assert result["steps_run"] == STEPS - latest
    for a, b in zip(final_weights(tmp_path), reference[every]):
        np.testing.assert_array_equal(a, b)


BLOCK = 16  # of the small GPT below


def _built(n_layer=1, dropout=0.1):
    m = GPT(vocab_size=256, block_size=BLOCK, n_layer=n_layer, n_head=2, n_embd=16, dropout=dropout)
    m.build()
    m.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    m.optimizer.build(m.trainable_variables)
    return m


def test_backup_refuses_a_different_model_and_keeps_files(tmp_path):
    m = _built()
    b = cb.BackupAndRestore(str(tmp_path), signature={"model": {"n_layer": 1}})
    b.set_model(m)
    assert b.restore(m) == 0
    b.step.assign(5)
    b.save()
    before = sorted(os.listdir(tmp_path))
    other = _built(n_layer=2)
    with pytest.raises(Exception, match="different model"):
        cb.BackupAndRestore(str(tmp_path), signature={"model": {"n_layer": 2}}).restore(other)
    with pytest.raises(Exception, match="different weights"):
        cb.BackupAndRestore(str(tmp_path), signature={"model": {"n_layer": 1}}).restore(other)
    assert sorted(os.listdir(tmp_path)) == before


def test_restore_brings_back_weights_optimizer_step_and_dropout_rng(tmp_path):
    keras.utils.set_random_seed(1)
    m = _built()
    b = cb.BackupAndRestore(str(tmp_path))
    b.set_model(m)
    b.restore(m)
    x = np.arange(BLOCK, dtype="int32")[None]
    m(x, training=True)  # advances the dropout RNG state
    m.optimizer.iterations.assign(7)
    b.step.assign(3)
    b.save()
    keras.utils.set_random_seed(2)
    m2 = _built()
    b2 = cb.BackupAndRestore(str(tmp_path))
    assert b2.restore(m2) == 3
    assert int(m2.optimizer.iterations.numpy()) == 7
    for v, v2 in zip(m.variables, m2.variables):
        np.testing.assert_array_equal(np.asarray(v), np.asarray(v2))
    np.testing.assert_array_equal(np.asarray(m(x, training=True)), np.asarray(m2(x, training=True)))


def test_non_chief_writes_to_a_temporary_dir_that_is_removed(tmp_path):
    m = _built()
    b = cb.BackupAndRestore(str(tmp_path), is_chief=False, worker_index=1)
    b.set_model(m)
    b.restore(m)
    b.step.assign(2)
    b.save()
    assert os.listdir(tmp_path) == [] or not any("ckpt" in f for f in os.listdir(tmp_path))
    assert not os.path.exists(tmp_path / ".tmp-worker-1")


# -- damaged backups, a full disk, the end window, preemption, one run per workdir ---------------

@pytest.fixture(scope="module")
def killed_at_13(tmp_path_factory, data_dir):
    """A run SIGKILLed after step 13, backed up every 4 steps: ckpt-10 (epoch end) and ckpt-12."""
    d = tmp_path_factory.mktemp("killed13")
    p, _ = driver(d, overrides(data_dir, **{"backup.every_steps": 4}), "--kill-at-step", "13",
                  check=False)
    assert p.returncode == -9, p.stderr[-2000:]
    assert tf.train.latest_checkpoint(str(d / "backup")).endswith("ckpt-12")
    return d


def _damage(path, how):
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(10)
    else:  # overwritten in place with other bytes of the same length
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())


@pytest.mark.slow
@pytest.mark.parametrize("part,how", [("index", "truncated"),
                                      pytest.param("data-00000-of-00001", "overwritten",
                                                   marks=pytest.mark.long)])
def test_a_damaged_newest_backup_falls_back_to_the_one_before(tmp_path, data_dir, reference,
                                                              killed_at_13, part, how):
    run = tmp_path / "run"
    shutil.copytree(killed_at_13, run)
    _damage(run / "backup" / f"ckpt-12.{part}", how)
    p, result = driver(run, overrides(data_dir, **{"backup.every_steps": 4}))
    warned = [line for line in p.stderr.splitlines() if "cannot be read" in line]
    assert len(warned) == 1 and "ckpt-12 cannot be read" in warned[0], p.stderr[-2000:]
    assert "using ckpt-10, the newest intact one" in warned[0]
    assert result["steps_run"] == STEPS - 10  # from ckpt-10, the intact one
    for a, b in zip(final_weights(run), reference[4]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_damaged_backup_index_resumes_from_the_backups_on_disk(tmp_path, data_dir, reference,
                                                                 killed_at_13):
    """The index that names the backups (`backup/checkpoint`) overwritten with text TF cannot
    parse: TF's own reader logs two lines and answers "no checkpoint", which made the run start
    over at step 0 without a word. It resumes from the newest backup on disk, ckpt-12, says so in
    one line, and ends as the uninterrupted run."""
    run = tmp_path / "run"
    shutil.copytree(killed_at_13, run)
    (run / "backup" / "checkpoint").write_text("not a checkpoint index\n")
    p, result = driver(run, overrides(data_dir, **{"backup.every_steps": 4}))
    warned = [line for line in p.stderr.splitlines() if "cannot be read" in line]
    assert len(warned) == 1 and "the backup index" in warned[0], p.stderr[-2000:]
    assert "using ckpt-12, the newest backup on disk" in warned[0]
    assert "Checkpoint ignored" not in p.stderr  # (TF's two lines)
    assert result["steps_run"] == STEPS - 12
    for a, b in zip(final_weights(run), reference[4]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_every_backup_damaged_is_one_line_and_deletes_nothing(tmp_path, data_dir, killed_at_13):
    run = tmp_path / "run"
    shutil.copytree(killed_at_13, run)
    for step in (10, 12):
        _damage(run / "backup" / f"ckpt-{step}.index", "truncated")
    before = tree_digest(run, exclude=[LOCK_NAME])
    p, _ = driver(run, overrides(data_dir, **{"backup.every_steps": 4}), check=False)
    assert_usage_error(p, "no backup in")
    assert "ckpt-12 (" in p.stderr and "ckpt-10 (" in p.stderr and "nothing was deleted" in p.stderr
    assert tree_digest(run, exclude=[LOCK_NAME]) == before  # (the killed run's stale lock was
    assert not (run / LOCK_NAME).exists()  # taken over by the refused run, which removed it)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_into_a_full_filesystem_is_one_line_and_keeps_the_previous_backup(tmp_path,
                                                                                 asynchronous):
    """Synchronous: the save raises. Asynchronous: the background write fails, and the next
    save or the wait for it (the end of the run, a preemption) raises: training stops there."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (the full filesystem)")
    m = _built()
    probe = cb.BackupAndRestore(str(tmp_path / "probe"))
    probe.set_model(m)
    probe.step.assign(1)
    probe.save()
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "probe")
               for f in fs)
    full = tmp_path / "full"
    full.mkdir()
    # room for one backup and a half: the second save runs out of space
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(size * 3 // 2 + 8191) // 4096 * 4096}",
                    "tfdist-test-full", str(full)], check=True, timeout=30)
    try:
        b = cb.BackupAndRestore(str(full / "backup"), asynchronous=asynchronous)
        b.set_model(m)
        b.step.assign(1)
        b.save()
        b.step.assign(2)
        with pytest.raises(UsageError, match=r"could not write the backup of step 2 into .*"
                                             r"the backup of step 1 is intact") as e:
            b.save()
            b.wait()  # (asynchronous: the write's failure)
        assert "\n" not in str(e.value)
        assert not [f for f in os.listdir(full / "backup") if f.startswith("ckpt-2")]
        assert cb.BackupAndRestore(str(full / "backup")).restore(_built()) == 1
    finally:
        subprocess.run(["umount", str(full)], check=True, timeout=30)


@pytest.mark.slow
def test_a_kill_after_the_last_backup_finishes_the_run_on_restart(tmp_path, data_dir, reference):
    o = overrides(data_dir, **{"backup.every_steps": 4})
    p, _ = driver(tmp_path, o, "--kill-before-model-save", check=False)
    assert p.returncode == -9, p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "model.keras")
    assert tf.train.latest_checkpoint(str(tmp_path / "backup")).endswith(f"ckpt-{STEPS}")
    p, result = driver(tmp_path, o)
    assert f"is at the final step {STEPS}; training is done" in p.stdout
    assert result["steps_run"] == 0 and result["final_step"] == STEPS
    assert result["val_loss"] is not None  # the last epoch's, logged before its backup
    assert len(executed_steps(tmp_path)) == STEPS  # no step ran twice
    for a, b in zip(final_weights(tmp_path), reference[4]):
        np.testing.assert_array_equal(a, b)
    assert not os.path.exists(tmp_path / "backup") and os.path.exists(tmp_path / "loss.png")


@pytest.mark.slow
def test_sigterm_backs_up_the_step_in_progress_and_the_run_resumes_there(tmp_path, data_dir,
                                                                         reference):
    at = random.Random(5).randint(2, STEPS - 2)
    o = overrides(data_dir, **{"backup.every_steps": 4})
    p, _ = driver(tmp_path, o, "--signal-at-step", str(at), check=False)
    assert p.returncode == EXIT_PREEMPTED, p.stderr[-2000:]
    assert f"preempted (SIGTERM) at step {at}: backup written" in p.stderr
    assert tf.train.latest_checkpoint(str(tmp_path / "backup")).endswith(f"ckpt-{at}")
    assert len(executed_steps(tmp_path)) == at
    _, result = driver(tmp_path, o)
    assert result["steps_run"] == STEPS - at
    assert len(executed_steps(tmp_path)) == STEPS  # none lost, none twice
    for a, b in zip(final_weights(tmp_path), reference[4]):
        np.testing.assert_array_equal(a, b)


def fault_in_a_write(workdir, o, sig, after_step, *extra, timeout=300):
    """Runs the driver (with `extra` flags) with slow backup writes (--slow-write: data files, a
    2 s pause, the commit) and sends `sig` while the write of a step >= `after_step` is in
    flight, seen on disk (`harness.write_in_flight`). Returns (exit status, stderr, that step)."""
    backup, seen = workdir / "backup", []
    p = subprocess.Popen(harness.driver_argv(str(workdir), o, "--slow-write", "2", *extra),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        wait_until(lambda: seen.append(harness.write_in_flight(backup)) or
                   (seen[-1] or 0) >= after_step, timeout, "a backup write in flight", proc=p)
        p.send_signal(sig)
        _, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, err, seen[-1]


@pytest.mark.slow
def test_a_kill_during_a_background_write_resumes_from_the_backup_before(tmp_path, data_dir,
                                                                        reference):
    """Asynchronous backups (the default): SIGKILL while a write is in flight leaves the backup
    before it the newest intact one; the restart resumes there and ends bitwise equal."""
    o = overrides(data_dir, **{"backup.every_steps": 4})
    status, err, step = fault_in_a_write(tmp_path, o, signal.SIGKILL, after_step=12)
    assert status == -9, err[-2000:]
    before = int(tf.train.latest_checkpoint(str(tmp_path / "backup")).rsplit("-", 1)[1])
    assert step - 4 <= before < step  # (every 4 steps, and at epoch ends)
    assert (tmp_path / "backup" / f"ckpt-{step}.index").exists()  # written, not committed
    p, result = driver(tmp_path, o)
    assert f"at step {before} of {STEPS}" in p.stdout, p.stdout[-2000:]
    assert result["steps_run"] == STEPS - before
    for a, b in zip(final_weights(tmp_path), reference[4]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.long
def test_without_the_snapshot_a_kill_during_a_write_resumes_from_later_values(tmp_path, data_dir,
                                                                             reference):
    """Companion: the background writes saving the live variables instead of their values at
    the save. Training runs on until the next save waits for the write, so the backup named
    ckpt-N holds a later step's state, and the run resumes there, not at N."""
    o = overrides(data_dir, **{"backup.every_steps": 4})
    status, err, _ = fault_in_a_write(tmp_path, o, signal.SIGKILL, 12, "--skip-freeze")
    assert status == -9, err[-2000:]
    before = int(tf.train.latest_checkpoint(str(tmp_path / "backup")).rsplit("-", 1)[1])
    p, _ = driver(tmp_path, o)
    assert f"at step {before} of {STEPS}" not in p.stdout, p.stdout[-2000:]


@pytest.mark.slow
def test_sigterm_during_a_background_write_backs_up_the_step_in_progress(tmp_path, data_dir,
                                                                         reference):
    """Preemption while a write is in flight: the run waits for it, then writes the step in
    progress, within the grace period, and exits 75; the rerun resumes at that step."""
    o = overrides(data_dir, **{"backup.every_steps": 4})
    status, err, step = fault_in_a_write(tmp_path, o, signal.SIGTERM, after_step=8)
    assert status == EXIT_PREEMPTED, err[-2000:]
    at = int(err.split("preempted (SIGTERM) at step ")[1].split(":")[0])
    assert at >= step and f"at step {at}: backup written" in err
    assert tf.train.latest_checkpoint(str(tmp_path / "backup")).endswith(f"ckpt-{at}")
    p, result = driver(tmp_path, o)
    assert f"at step {at} of {STEPS}" in p.stdout, p.stdout[-2000:]
    for a, b in zip(final_weights(tmp_path), reference[4]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_second_run_on_a_busy_workdir_is_refused_and_the_first_goes_on(tmp_path, data_dir,
                                                                         reference):
    o = overrides(data_dir, **{"backup.every_steps": 4})
    first = subprocess.Popen([sys.executable, DRIVER, str(tmp_path), json.dumps(o)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = tmp_path / LOCK_NAME
        wait_until(lambda: lock.exists() and f'"pid": {first.pid}' in lock.read_text(), 240,
                   "the first run to take the workdir's lock", proc=first)
        first.send_signal(signal.SIGSTOP)  # it holds the lock, and does not finish meanwhile
        try:
            p, _ = driver(tmp_path, o, check=False)
        finally:
            first.send_signal(signal.SIGCONT)
        assert_usage_error(p, f"is in use by another run (pid {first.pid} on host ")
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err[-2000:]
    for a, b in zip(final_weights(tmp_path), reference[4]):
        np.testing.assert_array_equal(a, b)


def test_a_signal_in_an_epochs_last_step_stops_after_its_validation():
    """Preemption in the last step of an epoch waits for the epoch's end, so its validation is
    logged as in an uninterrupted run; in any other step it stops at the step's end."""
    from tfdist.runtime.preemption import Preempted, Preemption
    x = np.ones((4, 2), "float32")

    class Watch(keras.callbacks.Callback):
        def __init__(self, signal_at, events):
            super().__init__()
            self.signal_at, self.events = signal_at, events

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if (self.epoch, batch) == self.signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)

        def on_train_batch_end(self, batch, logs=None):
            if batch in (1, 3):
                self.events.append(f"batch {batch}")

        def on_epoch_end(self, epoch, logs=None):
            self.events.append(f"epoch {epoch} val" if "val_loss" in logs else f"epoch {epoch}")

    for signal_at, expected in (
            ((0, 3), ["batch 1", "batch 3", "epoch 0 val", "save"]),
            ((1, 1), ["batch 1", "batch 3", "epoch 0 val", "batch 1", "save"])):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        events = []
        stop = Preemption(["USR1"], save=lambda events=events: events.append("save") or 0,
                          say=lambda m: None)
        with stop, pytest.raises(Preempted):
            model.fit(x, x[:, :1], batch_size=1, epochs=2, validation_data=(x, x[:, :1]),
                      callbacks=[Watch(signal_at, events), stop], verbose=0)
        assert events == expected, (signal_at, events)


_STOPPED_THEN_TERMINATED = """
import os, signal, sys, time
import keras, numpy as np
from tfdist.runtime.preemption import Preemption
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
class Signal(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
stop = Preemption(["USR1"], save=lambda: 2, say=lambda m: None)
try:
    with stop:
        model.fit(np.ones((4, 2)), np.ones((4, 1)), batch_size=1, verbose=0,
                  callbacks=[Signal(), stop])
finally:  # the process's slow teardown, during which srun terminates it
    if sys.argv[1] == "restore":  # the companion: the handlers as they were before the fix
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
"""


@pytest.mark.parametrize("mode", ["as built", "restore"])
def test_a_term_after_the_preemption_backup_keeps_status_75(mode):
    """srun --kill-on-bad-exit terminates the tasks still exiting once one has exited 75 (a
    preemption both backed up: tests/test_slurm.py's USR1 trial saw 143); a TERM after the backup
    is written ends the task with 75 at once. Companion: with SIGTERM's default handler back,
    the task dies of the signal."""
    p = subprocess.run([sys.executable, "-c", _STOPPED_THEN_TERMINATED, mode],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == (75 if mode == "as built" else -signal.SIGTERM), p.stderr[-2000:]
