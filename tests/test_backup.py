"""Step-exact BackupAndRestore: SIGKILL at a random step (and inside a save), restart, compare."""
import os
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import callbacks as cb
from tfdist.models.gpt import GPT
from tests.helpers import driver, executed_steps, final_weights

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
@pytest.mark.parametrize("every,kill_at", KILLS)
def test_sigkill_at_random_step_then_restart_is_step_exact(tmp_path, data_dir, reference,
                                                           every, kill_at):
    o = overrides(data_dir, **{"backup.every_steps": every})
    p, _ = driver(tmp_path, o, "--kill-at-step", str(kill_at), check=False)
    assert p.returncode == -9, p.stderr[-2000:]  # really SIGKILLed
    first = executed_steps(tmp_path)
    assert len(first) == kill_at
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
    assert os.path.exists(tmp_path / "backup" / f"ckpt-{half_written}.index")  # the half-finished save
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
