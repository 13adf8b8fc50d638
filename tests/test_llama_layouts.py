"""The Llama architecture on tfdist's parallel axes: a small Llama (grouped-query attention,
SwiGLU, rotary embeddings, RMSNorm, no biases, an untied head) trained under Horovod with ZeRO-3
over 2 ranks, and split into 2 pipeline stages x 2 tensor-parallel shards with sequence
parallelism and the 1F1B schedule, gives its single-process run's per-step losses within 1e-5
(the issue's bound; the split model sums its microbatches in another order, float32 rounding
that the optimizer does not amplify)."""
import os

import pytest

from tests.helpers import driver, driver_group, losses, max_diff, weights

STEPS = 10
LLAMA = {"model.arch": "llama", "model.n_layer": 4, "model.n_head": 4, "model.n_kv_head": 2,
         "model.n_embd": 32, "model.bias": False, "model.tie_embeddings": False,
         "model.rope_theta": 500000.0}


def options(data_dir, **extra):
    return {"data.data_dir": data_dir, "train.steps": STEPS, "train.steps_per_epoch": 5,
            "train.batch_size": 16, "train.deterministic": True, "backup.every_steps": 5,
            **LLAMA, **extra}


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("llama-single")
    driver(d, options(data_dir, **{"strategy.name": "single"}), "--dump-weights")
    return d


def assert_losses_equal(run, reference):
    a, b = losses(reference), losses(run)
    assert len(a) == len(b) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    assert a[-1] < a[0]  # it trained


@pytest.mark.slow
@pytest.mark.horovod
def test_llama_under_horovod_with_zero3_equals_its_single_run(tmp_path, data_dir, single):
    """2 Horovod ranks, each holding half the weights (ZeRO-3): the single run's losses, and
    both ranks end with the single run's weights."""
    driver_group(tmp_path, options(data_dir, **{"strategy.name": "horovod", "zero.stage": 3}),
                 "--dump-weights", ranks=2)
    assert_losses_equal(tmp_path, single)
    for rank in (0, 1):
        assert max_diff(weights(tmp_path, rank), weights(single, 0)) <= 1e-5


@pytest.mark.slow
def test_llama_in_stages_and_shards_with_sequence_parallelism_and_1f1b_equals_single(
        tmp_path, data_dir, single):
    """2 stages x 2 tensor-parallel shards (query heads 2 and key/value heads 1 per shard),
    sequence parallelism, 1F1B over 2 microbatches: the single run's losses."""
    p, _ = driver(tmp_path, options(data_dir, **{
        "strategy.name": "single", "pipeline.stages": 2, "pipeline.microbatches": 2,
        "pipeline.schedule": "1f1b", "tensor.parallel": 2, "tensor.sequence_parallel": True,
        "train.inter_op_threads": 2}))
    assert "tensor parallel over 2 devices per stage, sequence parallel, 1F1B" in p.stdout
    assert_losses_equal(tmp_path, single)
    assert os.path.exists(tmp_path / "model.keras")


@pytest.mark.slow
def test_a_killed_llama_run_resumes_at_its_backup_with_the_same_losses(tmp_path, data_dir,
                                                                        single):
    """SIGKILLed after step 5 (its backup written), the same command resumes at step 5 and ends
    with the uninterrupted run's losses and weights."""
    o = options(data_dir, **{"strategy.name": "single"})
    p, _ = driver(tmp_path, o, "--kill-at-step", "5", check=False)
    assert p.returncode == -9
    p, _ = driver(tmp_path, o, "--dump-weights")
    assert f"at step 5 of {STEPS}" in p.stdout
    assert_losses_equal(tmp_path, single)
    assert max_diff(weights(tmp_path, 0), weights(single, 0)) <= 1e-5


@pytest.mark.slow
@pytest.mark.bf16
def test_llama_trains_in_mixed_bfloat16_near_its_float32_losses(tmp_path, data_dir, single):
    """bfloat16 compute (float32 norms, softmax, rotary angles and logits): each step's loss
    within 0.05 of float32's (bfloat16 keeps 8 bits of mantissa: its losses differ by ~1e-2)."""
    driver(tmp_path, options(data_dir, **{"strategy.name": "single",
                                          "train.precision": "mixed_bfloat16"}))
    a, b = losses(single), losses(tmp_path)
    assert len(b) == STEPS and all(x == x for x in b)  # no NaN
    assert max(abs(x - y) for x, y in zip(a, b)) <= 0.05, (a, b)
