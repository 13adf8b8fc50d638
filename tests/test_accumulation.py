"""Gradient accumulation under every strategy (`train.grad_accum_steps`, tfdist.step): K batches
of B rows per update train as one batch of K x B rows does (per-update losses and final weights
within 1e-5) on one device, under mirrored (2 devices), multi_worker_mirrored (2 workers),
Horovod (2 ranks), multi_worker_mirrored with ZeRO-2 and ZeRO-3 (each replica keeping its share
of the sums), and a GPT split into 2 pipeline stages x 2 tensor-parallel shards; without the sums
the test fails. A run killed inside an update's window
resumes bitwise at the update's start. A user's Keras program accumulates with Keras's own
`gradient_accumulation_steps`, which tfdist's step runs where Keras's cannot. What is refused is
one line, exit 2, before any worker starts. (The parameter server's accumulated updates: its
killed-worker test in test_parameter_server.py.)"""
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    OVERLAP_BUCKET_MB,
    ROOT,
    assert_usage_error,
    driver,
    driver_group,
    final_weights,
    hashes,
    losses,
    max_diff,
    metrics,
    run,
    run_group,
    tfdist,
    weights,
)

K, B, UPDATES = 4, 4, 4  # batches per update, rows per batch, updates per run


def reference(data_dir):
    """One device, one batch of K x B rows per update: what every accumulating run equals."""
    return {"data.data_dir": data_dir, "train.steps": UPDATES, "train.steps_per_epoch": 2,
            "train.batch_size": K * B, "train.warmup_steps": 2, "train.deterministic": True,
            "backup.enabled": False, "strategy.name": "single"}


def accumulating(data_dir, strategy, **extra):
    """K batches of B rows per update, a backup at each update's end (the warmup in batches)."""
    return {**reference(data_dir), "train.steps": UPDATES * K, "train.steps_per_epoch": 2 * K,
            "train.batch_size": B, "train.warmup_steps": 2 * K, "train.grad_accum_steps": K,
            "backup.enabled": True, "backup.every_steps": K, "strategy.name": strategy, **extra}


def per_update(run_losses, k=K):
    """The mean logged loss of each update's k batches (equal batches: the update's loss)."""
    assert len(run_losses) % k == 0
    return [float(np.mean(run_losses[i:i + k])) for i in range(0, len(run_losses), k)]


def assert_equals_one_larger_batch(run_dir, ref_dir, replicas):
    a, b = losses(ref_dir), per_update(losses(run_dir))
    assert len(a) == len(b) == UPDATES
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    # (the saved GPT's: a split model's stages and shards joined)
    assert max_diff(final_weights(run_dir), final_weights(ref_dir)) <= 1e-5
    if replicas == 2 and os.path.exists(os.path.join(run_dir, "weight_hashes-w1.txt")):
        assert hashes(run_dir, 0) == hashes(run_dir, 1)  # bitwise identical after every step


# -- one device, in this process: the arithmetic, and the test failing without the sums --------

def fit(accumulate, batch, skip_sums=False):
    """(per-update losses, weights) of a small GPT trained for 3 updates by tfdist's step."""
    import tfdist.strategies
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep
    strategy = tfdist.strategies.get("single")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = GPT(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
        model.build()
        model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss=loss_fn())
        step = TrainStep(model, strategy, Layout(accumulate=accumulate), clipnorm=1.0).install()
    if skip_sums:
        step.accumulate_gradients = lambda grads_and_vars: None
    tokens = tf.random.stateless_uniform((3 * K * B, 17), (1, 2), maxval=64, dtype=tf.int32)
    data = tf.data.Dataset.from_tensor_slices((tokens[:, :-1], tokens[:, 1:])).batch(batch)
    history = model.fit(data, epochs=3, steps_per_epoch=accumulate, verbose=0, shuffle=False)
    return history.history["loss"], [w.numpy() for w in model.trainable_weights]


def test_k_batches_per_update_equal_one_k_times_larger_batch_and_fail_without_the_sums():
    a, wa = fit(1, K * B)
    b, wb = fit(K, B)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    assert max_diff(wa, wb) <= 1e-5
    _, wc = fit(K, B, skip_sums=True)  # only each window's last batch: not the larger batch
    assert max_diff(wa, wc) > 1e-3


def test_a_model_compiled_with_several_steps_per_call_is_refused():
    """Keras's steps_per_execution runs several batches in one call: the step of each could not be
    chosen on the host. Refused, naming both, when the step is installed."""
    import tfdist.strategies
    from tfdist.errors import UsageError
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep
    strategy = tfdist.strategies.get("single")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
        step = TrainStep(model, strategy, Layout(accumulate=2))
    with pytest.raises(UsageError, match="steps_per_execution=2 runs several batches"):
        step.install()


# -- the strategies, through the fault driver ---------------------------------------------------

@pytest.fixture(scope="module")
def single_larger_batch(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("accumulation-reference")
    driver(d, reference(data_dir), "--dump-weights")
    return d


@pytest.fixture(scope="module")
def mwms(tmp_path_factory, data_dir):
    """multi_worker_mirrored, 2 workers, uninterrupted: the equality run and the resume's
    reference."""
    d = tmp_path_factory.mktemp("accumulation-mwms")
    driver_group(d, accumulating(data_dir, "multi_worker_mirrored"), "--dump-weights",
                 "--hash-weights")
    return d


#: one process split 2 x 2: pipeline stages (1F1B, 2 microbatches) x tensor-parallel shards
SPLIT = {"pipeline.stages": 2, "pipeline.microbatches": 2, "pipeline.schedule": "1f1b",
         "tensor.parallel": 2, "tensor.sequence_parallel": True}


@pytest.mark.slow
@pytest.mark.parametrize("strategy,zero,split", [
    # (MWMS plain: long, the suite's time; its ZeRO-3 case below and Horovod's plain one show it)
    ("mirrored", 0, False), pytest.param("multi_worker_mirrored", 0, False, marks=pytest.mark.long),
    pytest.param("horovod", 0, False, marks=pytest.mark.horovod),
    # (ZeRO-2: long, the suite's time; ZeRO-3's case shows the sharded sums)
    pytest.param("multi_worker_mirrored", 2, False, marks=pytest.mark.long),
    ("multi_worker_mirrored", 3, False),
    ("single", 0, True)])
def test_accumulation_equals_one_larger_batch(tmp_path, data_dir, single_larger_batch, request,
                                              strategy, zero, split):
    if strategy == "mirrored":  # one process, 2 logical devices
        driver(tmp_path, accumulating(data_dir, strategy, **{"strategy.devices": 2}),
               "--dump-weights")
    elif split:  # one process, the GPT split over 4 logical devices
        driver(tmp_path, accumulating(data_dir, strategy, **SPLIT), "--dump-weights")
    elif strategy == "multi_worker_mirrored" and not zero:
        tmp_path = request.getfixturevalue("mwms")
    else:  # (Horovod's gradients in 4 buckets of 0.1 MiB: reduced only on an update's batch)
        extra = {"zero.stage": zero}
        if strategy == "horovod":
            extra["strategy.bucket_mb"] = OVERLAP_BUCKET_MB
        p = driver_group(tmp_path, accumulating(data_dir, strategy, **extra), "--dump-weights",
                         "--hash-weights")
        assert strategy != "horovod" or "horovod: gradients: 4 bucket(s)" in p.stdout
    assert_equals_one_larger_batch(tmp_path, single_larger_batch, replicas=2)
    if zero:  # each replica keeps the sums of its share of the weights: about half of them
        plain = request.getfixturevalue("mwms")
        full = json.load(open(plain / "optimizer-w0.json"))["accumulator_bytes"]
        for rank in (0, 1):
            mine = json.load(open(tmp_path / f"optimizer-w{rank}.json"))
            imbalance = float(mine["zero"].rsplit(" ", 1)[1])
            assert 0 < mine["accumulator_bytes"] <= full / 2 * (imbalance + 0.005), (mine, full)


@pytest.mark.slow
def test_a_run_killed_inside_an_update_resumes_bitwise_at_its_start(tmp_path, data_dir, mwms):
    """Worker 1 SIGKILLed after step 6, the middle of the second update (steps 5-8): backups fall
    on update boundaries, so the group resumes at step 4, and from there every step is the
    uninterrupted run's, bitwise."""
    p = driver_group(tmp_path, accumulating(data_dir, "multi_worker_mirrored"), "--dump-weights",
                     "--kill-at-step", "6", "--kill-worker", "1")
    assert "at step 4 of 16" in p.stdout, p.stdout[-3000:]
    resumed = [r["loss"] for r in metrics(tmp_path)["steps"] if r["step"] > 4]
    assert resumed == [r["loss"] for r in metrics(mwms)["steps"] if r["step"] > 4]
    for rank in (0, 1):
        assert max_diff(weights(tmp_path, rank), weights(mwms, rank)) == 0.0


# -- a user's Keras program --------------------------------------------------------------------

USER_PROGRAM = os.path.join(ROOT, "tests", "support", "keras_accumulation.py")


def user_program(strategy, k, batch, out, *extra):
    return run([sys.executable, USER_PROGRAM, strategy, str(k), str(batch), str(UPDATES),
                str(out), *extra], timeout=300)


def saved(path):
    with np.load(path) as f:
        return ([f[k] for k in sorted((k for k in f.files if k.startswith("arr_")),
                                      key=lambda k: int(k[4:]))],
                list(f["losses"]), int(f["updates"]))


@pytest.mark.slow
def test_a_users_keras_accumulation_runs_under_mirrored_as_one_larger_batch(tmp_path):
    """Keras's `gradient_accumulation_steps` under MirroredStrategy calls merge_call in a cond
    (keras-team/keras#20582); tfdist's step takes the model's updates: the epochs' losses and the
    weights of one device's K x B batches."""
    user_program("single", 1, K * B, tmp_path / "reference.npz")
    user_program("mirrored", K, B, tmp_path / "mirrored.npz", "2")
    (wa, la, ua), (wb, lb, ub) = saved(tmp_path / "reference.npz"), saved(tmp_path / "mirrored.npz")
    assert ua == ub == UPDATES
    assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-5, (la, lb)
    assert max_diff(wa, wb) <= 1e-5


@pytest.mark.slow
@pytest.mark.long  # time: the same path as mirrored's, in processes of tfdist launch
@pytest.mark.parametrize("strategy", ["multi_worker_mirrored", "parameter_server"])
def test_a_users_keras_accumulation_runs_under_the_multi_process_strategies(tmp_path, strategy):
    """multi_worker_mirrored: one device's K x B batches; the parameter server (asynchronous):
    its UPDATES updates, each of K batches, and a lower loss."""
    user_program("single", 1, K * B, tmp_path / "reference.npz")
    flags = ["--workers=2"] + (["--strategy=parameter_server", "--ps=1"]
                               if strategy == "parameter_server" else [])
    p = run_group([sys.executable, "-m", "tfdist", "launch", *flags, "--max_restarts=0", "--",
                   sys.executable, USER_PROGRAM, strategy, str(K), str(B), str(UPDATES),
                   str(tmp_path / "run.npz")], 300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    (wa, la, _), (wb, lb, updates) = saved(tmp_path / "reference.npz"), saved(tmp_path / "run.npz")
    assert updates == UPDATES
    if strategy == "parameter_server":
        assert lb[-1] < lb[0], lb
    else:
        assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-5, (la, lb)
        assert max_diff(wa, wb) <= 1e-5


# -- what is refused -----------------------------------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (["--config.train.grad_accum_steps=3"],
     "train.grad_accum_steps (3) must divide train.steps_per_epoch (20)"),
    (["--config.train.grad_accum_steps=4", "--config.backup.every_steps=10"],
     "backup.every_steps (10) must be a multiple of train.grad_accum_steps (4)"),
    (["--config.train.grad_accum_steps=2", "--config.train.steps_per_execution=2"],
     "train.steps_per_execution (2) runs several batches in one call"),
])
def test_what_accumulation_refuses_is_one_line_before_any_worker_starts(tmp_path, flags, needle):
    p = tfdist("launch", "--workers=2", "--", "--config=configs/gpt_nano.py",
               f"--workdir={tmp_path}", *flags, check=False)
    assert_usage_error(p, needle)
    assert "started" not in p.stdout + p.stderr  # (the launcher's "started 2 worker(s)")
