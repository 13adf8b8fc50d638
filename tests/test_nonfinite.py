"""Updates whose loss or gradients are not finite, skipped (tfdist/runtime/nonfinite.py): a user's
program (tests/support/bad_batch.py) with one batch holding a NaN input, under
`tfdist.strategies.get(name, skip_nonfinite=K)`. Under `single`, `horovod` (the NaN in one
rank's half of the batch) and `multi_worker_mirrored` the update is skipped on every process
and counted once; the weights and the optimizer's variables after it are bitwise those before
it; the run ends finite and equal to one device's. A run killed after the skip resumes from
Keras's backup equal to the uninterrupted one. K bad batches in a row end the run in one line,
the backup intact. Without skipping, the run ends with NaN weights."""
import json
import os
import sys

import h5py
import numpy as np
import pytest

from tests.helpers import ROOT, assert_usage_error, run

PROGRAM = os.path.join(ROOT, "tests", "support", "bad_batch.py")


def launch(strategy, max_restarts=0):
    python = [sys.executable]
    if strategy == "single":
        return python
    flags = ["--strategy=horovod"] if strategy == "horovod" else []
    return python + ["-m", "tfdist", "launch", *flags, "--workers=2",
                     f"--max_restarts={max_restarts}", "--"] + python


def run_program(base, strategy, extra=(), max_restarts=0, check=True):
    argv = launch(strategy, max_restarts) + [PROGRAM, f"--strategy={strategy}",
                                             f"--out={base / 'out'}", *extra]
    p = run(argv, timeout=240, check=False)
    out = p.stdout + p.stderr
    if check:
        assert p.returncode == 0, out[-4000:]
    return [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
            if "RESULT " in line], p


def final_weights(base):
    with np.load(base / "out" / "weights.npz") as f:
        return [f[k] for k in f.files]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    base = tmp_path_factory.mktemp("single")
    results, _ = run_program(base, "single")
    return results[0], final_weights(base)


def check_skipped_once(results, processes):
    assert len(results) == processes, results
    for r in results:
        assert r["skipped"] == 1 and r["same_after_the_bad_step"] and r["finite"], r
        assert r["iterations"] == 4 * 6 - 1, r  # 4 epochs of 6 batches, one update skipped


@pytest.mark.slow
def test_a_nan_batch_is_skipped_on_one_device(single):
    check_skipped_once([single[0]], 1)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("horovod", marks=pytest.mark.horovod),
                                      "multi_worker_mirrored"])
def test_a_nan_batch_on_one_process_is_skipped_on_every_process(single, tmp_path, strategy):
    results, _ = run_program(tmp_path, strategy)
    check_skipped_once(results, 2)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(final_weights(tmp_path), single[1]))
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_without_skipping_the_nan_batch_ends_in_nan_weights(tmp_path):
    """The companion: `skip_nonfinite=0` (Keras's own step, as before)."""
    results, _ = run_program(tmp_path, "single", extra=["--k=0"])
    assert not results[0]["finite"] and results[0]["skipped"] == 0


@pytest.mark.slow
@pytest.mark.horovod
def test_a_run_killed_after_the_skip_resumes_equal_to_the_uninterrupted_one(single, tmp_path):
    """Rank 1 killed after step 17 (the skip was step 9): both ranks restart from the backup of
    epoch 2's end and end within 1e-5 of the uninterrupted run."""
    extra = [f"--backup={tmp_path / 'backup'}", "--kill_at=17", f"--marker={tmp_path / 'killed'}"]
    results, p = run_program(tmp_path, "horovod", extra=extra, max_restarts=1)
    assert "killing worker 1 after step 17" in p.stdout + p.stderr
    assert all(r["epochs"] == [2, 3] and r["finite"] for r in results), results
    worst = max(float(np.abs(a - b).max()) for a, b in zip(final_weights(tmp_path), single[1]))
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_k_bad_batches_in_a_row_end_the_run_in_one_line_with_the_backup_intact(tmp_path):
    backup = tmp_path / "backup"
    _, p = run_program(tmp_path, "single", extra=["--bad=3", "--k=3", f"--backup={backup}"],
                       check=False)
    assert_usage_error(p, "3 updates in a row had a loss or gradients that are not finite")
    with h5py.File(backup / "latest.weights.h5") as f:  # (epoch 1's, before the bad ones)
        arrays = []
        f.visititems(lambda name, x: arrays.append(x[()]) if isinstance(x, h5py.Dataset)
                     else None)
    assert arrays and all(np.isfinite(a).all() for a in arrays)


@pytest.mark.slow
def test_tfdist_train_with_skipping_on_and_no_bad_batch_equals_the_plain_run(single_reference,
                                                                            data_dir, tmp_path):
    """`--config.train.skip_nonfinite=3` on gpt_nano: the kept-then-applied update is the plain
    one (per-step losses equal the reference run's within 1e-6), and every step in metrics.json
    counts 0 updates skipped."""
    from tests.helpers import driver, single_overrides
    from tools.faults.harness import losses, metrics
    driver(tmp_path, {**single_overrides(data_dir), "train.skip_nonfinite": 3})
    got, want = losses(tmp_path), losses(single_reference)
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= 1e-6
    assert all(r["skipped"] == 0 for r in metrics(tmp_path)["steps"])


def test_skipping_is_refused_under_the_parameter_server():
    """Judged with the plugin (`Layout.from_config`): its workers update on their own. (A loss
    spike's rollback is not refused there: tests/test_spike.py.)"""
    import tfdist.strategies
    from tfdist import config
    from tfdist.errors import UsageError
    from tfdist.parallel.layout import Layout
    c = config.default_config()
    c.strategy.name = "parameter_server"
    c.train.spike = 3
    config.validate(c)
    Layout.from_config(c, tfdist.strategies.get_class("parameter_server"))
    c.train.skip_nonfinite = 3
    with pytest.raises(UsageError, match=r"train.skip_nonfinite=3 under parameter_server"):
        Layout.from_config(c, tfdist.strategies.get_class("parameter_server"))


@pytest.mark.parametrize("key,value,needle", [
    ("train.steps_per_execution", 2, "runs several batches in one call"),
    ("train.precision", "mixed_float16", "skips non-finite steps on its own")])
def test_skipping_is_refused_where_it_cannot_decide_in_one_line(key, value, needle):
    from tfdist import config
    from tfdist.errors import UsageError
    c = config.default_config()
    c.train.skip_nonfinite = 3
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(UsageError, match=needle):
        config.validate(c)
    c.train.skip_nonfinite = 0
    config.validate(c)  # (fine without it)


def test_a_users_skipping_under_the_parameter_server_is_refused():
    import tfdist.strategies
    from tfdist.errors import UsageError
    with pytest.raises(UsageError, match="skip_nonfinite=3 under strategy parameter_server"):
        tfdist.strategies.get("parameter_server", skip_nonfinite=3)


def test_metrics_json_counts_each_skip_and_gives_the_skipped_step_no_loss(tmp_path):
    """tfdist train's log (tfdist/callbacks/log.py): the step logs' `skipped` count per step; the
    step that raised it has loss NaN in metrics.json (its loss is not in Keras's tracker)."""
    import keras

    from tfdist.callbacks import TrainingLog
    from tools.faults.harness import metrics
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    log = TrainingLog(str(tmp_path), tokens_per_step=8, tensorboard=False, plot=False)
    log.set_model(model)
    for loss, skipped in ((2.0, 0), (0.0, 1), (1.5, 1)):
        log.on_train_batch_begin(0)
        log.on_train_batch_end(0, {"loss": loss, "skipped": skipped})
    log.flush()
    steps = metrics(tmp_path)["steps"]
    assert [r["skipped"] for r in steps] == [0, 1, 1]
    assert steps[0]["loss"] == 2.0 and np.isnan(steps[1]["loss"]) and steps[2]["loss"] == 1.5
