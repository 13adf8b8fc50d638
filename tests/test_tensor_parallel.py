"""Tensor parallelism (Megatron-LM) and the 1F1B schedule: gradients and losses equal the unsplit
GPT's, every shard's variables and matmuls are on its device (read from the executed graphs), a
t-way block holds 1/t of its matmul weights per device, 2 processes of K = 2 x t = 2 under 1F1B stay
identical, a backup of t = 2 restores into t = 1 and into K = 2 x t = 2, 1F1B's gradients equal
GPipe's, and bad configs are one line."""
import os
import re

import keras
import numpy as np
import pytest

from tests.helpers import (
    assert_usage_error,
    driver,
    driver_group,
    final_weights,
    first_fast,
    max_diff,
    metrics,
    tfdist,
    weights,
)
from tests.test_pipeline import common, probe


@pytest.mark.parametrize("k,t", first_fast([(1, 2), pytest.param(1, 4, marks=pytest.mark.long),
                                            (2, 2)]))  # (t = 4: long, for time)
def test_gradients_equal_the_unsplit_model(k, t):
    r = probe("grads", k, 4, f"t={t}")
    assert r["n"] == 52  # every weight of the unsplit 4-block GPT, its shards joined
    assert r["shards"] == 52 + 4 * 6 * (t - 1)  # 6 split variables per block, t shards each
    assert r["loss_diff"] <= 1e-5
    assert r["max_grad_diff"] <= 1e-5, r
    assert r["max_grad"] > 1e-2  # the gradients compared are not all ~0


@pytest.mark.slow
def test_losses_over_ten_steps_equal_the_unsplit_model():
    """10 SGD steps: the split model sums its microbatches' losses in another order than the
    unsplit one, a difference of float32 rounding that SGD does not amplify: the losses (about
    5.5, whose float32 spacing is 4.8e-7) agreed within 2 spacings on an AMD EPYC; the bound,
    1e-5, is 21."""
    r = probe("losses", 2, 4, "t=2")
    assert len(r["plain"]) == len(r["pipeline"]) == 10
    assert r["max_diff"] <= 1e-5, r
    assert r["plain"][-1] != r["plain"][0]  # it trained


def test_one_f_one_b_gradients_equal_gpipes():
    r = probe("schedules", 2, 4, "t=2")  # 2 stages of 2 shards, 4 microbatches
    assert r["n"] == 52
    assert r["loss_diff"] <= 1e-6 and r["max_grad_diff"] <= 1e-6, r


def test_every_shard_runs_on_its_device_and_holds_one_t_th_of_the_matmul_weights():
    r = probe("tensor_placement", 2, 2, "t=2")
    want = r["want"]  # "block/shard" -> device index (stage s's devices for its blocks)
    assert sorted(want) == [f"{b}/{s}" for b in range(4) for s in range(2)]
    # the devices each shard's matmuls ran on, forward and backward, from the executed graph
    for key, device in want.items():
        for direction in ("forward", "backward"):
            assert r["ran"][f"{key}/{direction}"] == [device], (key, direction, r["ran"])
    # Companion: the same check with two shards' devices swapped finds them out of place.
    swapped = {**want, "0/0": want["0/1"], "0/1": want["0/0"]}
    assert any(r["ran"][f"{key}/forward"] != [d] for key, d in swapped.items())
    # each device holds 1/t of each of its blocks' matmul weights (counted from the variables)
    for key, nbytes in r["matmul_bytes"].items():
        block, device = map(int, key.split("/"))
        assert device in (want[f"{block}/0"], want[f"{block}/1"])
        assert nbytes == r["unsplit_block_matmul_bytes"] // 2, (key, nbytes)
    # the memory estimate: one row per device; the shard-1 devices hold no embedding or norms
    rows = {(row["stage"], row["shard"]): row for row in r["memory"]}
    assert sorted(rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rows[(0, 1)]["params"] < rows[(0, 0)]["params"]
    assert rows[(0, 1)]["activation_bytes"] < rows[(0, 0)]["activation_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [  # MWMS: long, for time (horovod shows the layout)
    "horovod", pytest.param("multi_worker_mirrored", marks=pytest.mark.long)])
def test_data_x_pipeline_x_tensor_parallel_processes_stay_identical(tmp_path, data_dir, strategy):
    """3D: 2 processes (data parallel), each K = 2 stages x t = 2 shards under 1F1B; the
    gradients all-reduced in buckets (0.1 MiB: several)."""
    o = common(data_dir, **{"strategy.name": strategy, "strategy.bucket_mb": 0.1,
                            "pipeline.stages": 2, "pipeline.microbatches": 2,
                            "pipeline.schedule": "1f1b",
                            "tensor.parallel": 2, "backup.enabled": False})
    p = driver_group(tmp_path, o, "--dump-weights", max_restarts=0)
    assert ("pipeline of 2 stages, 2 microbatch(es), tensor parallel over 2 devices per stage, "
            "1F1B schedule") in p.stdout
    assert re.search(r"gradients: \d+ bucket\(s\) of <= 0.1 MiB", p.stdout), p.stdout[-3000:]
    w0, w1 = weights(tmp_path, 0), weights(tmp_path, 1)
    assert len(w0) > 52  # the shards
    assert max_diff(w0, w1) == 0.0
    log = metrics(tmp_path)["steps"]
    assert len(log) == o["train.steps"] and log[-1]["loss"] < log[0]["loss"]


@pytest.mark.slow
@pytest.mark.long  # time; test_zero's ZeRO + tensor-parallel test resumes t = 2 as t = 1
def test_a_backup_of_two_shards_restores_into_one_and_into_two_stages_of_two(tmp_path, data_dir):
    o = common(data_dir, **{"backup.every_steps": 1, "tensor.parallel": 2})
    driver(tmp_path / "ref", o)
    reference = final_weights(tmp_path / "ref")
    # model.keras is the plain GPT: Dense layers, no shards
    import tfdist.models.gpt  # noqa: F401
    plain = keras.saving.load_model(tmp_path / "ref" / "model.keras", compile=False)
    assert type(plain.blocks[0].c_fc).__name__ == "Dense" and len(plain.weights) == 52
    kill_at, steps = 5, o["train.steps"]
    for name, resume in (("plain", {"tensor.parallel": 1}),
                         ("stages", {"pipeline.stages": 2, "tensor.parallel": 2})):
        p, _ = driver(tmp_path / name, o, "--kill-at-step", str(kill_at), check=False)
        assert p.returncode == -9  # killed after step 5, its backup written
        p, res = driver(tmp_path / name, {**o, **resume})
        assert f"at step {kill_at} of {steps}" in p.stdout, p.stdout[-2000:]
        assert res["steps_run"] == steps - kill_at
        assert max_diff(final_weights(tmp_path / name), reference) <= 1e-5, name


@pytest.mark.parametrize("flags,needle", first_fast([
    (["--config.tensor.parallel=3"], "must divide model.n_head"),
    (["--config.tensor.parallel=2", "--config.pipeline.stages=2",
      "--config.pipeline.devices=/cpu:0,/cpu:1,/cpu:2,/cpu:3"], "more than the devices"),
    (["--config.tensor.parallel=2", "--strategy=mirrored", "--devices=2"],
     "one replica per process"),
    (["--config.pipeline.stages=2", "--config.pipeline.microbatches=1",
      "--config.pipeline.schedule=1f1b"], "at least as many microbatches as stages"),
    (["--config.tensor.sequence_parallel=True"], "and tensor.parallel is 1"),
    (["--config.tensor.parallel=2", "--config.tensor.sequence_parallel=True",
      "--config.model.block_size=33"], "model.block_size (33) must be divisible by 2"),
]))
def test_bad_tensor_parallel_configs_are_one_line(tmp_path, flags, needle):
    p = tfdist("train", "--config=configs/gpt_nano.py", f"--workdir={tmp_path}",
               "--config.train.batch_size=8", "--config.model.n_head=4", *flags, check=False)
    assert_usage_error(p, needle)
    assert not os.listdir(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("k,m", [(1, 1), (2, 2)])
def test_sequence_parallel_losses_equal_tensor_parallels(k, m):
    """Sequence parallelism (t = 2), without and with pipeline stages: 10 SGD steps' losses equal
    the same tensor-parallel pipeline's without it (and the unsplit GPT's)."""
    r = probe("losses", k, m, "t=2", "sp")
    assert "sequence parallel" in r["describe"]
    assert r["sp_vs_tensor"] < 1e-5 and r["max_diff"] < 1e-5, r


@pytest.mark.slow
def test_the_sequence_parallel_check_fails_without_the_reduce_scatter():
    """Companion: with each chunk keeping only its own device's partial output (no sum over the
    shards), the check above fails."""
    r = probe("losses", 1, 1, "t=2", "sp", "without_reduce_scatter")
    assert r["sp_vs_tensor"] > 1e-4, r


def test_sequence_parallel_activation_memory_is_the_papers_formula():
    """Korthikanti et al. 2022: per layer s b h (10 + 24/t + 5 a s / (h t)) values with tensor
    parallelism alone (eq. 3), s b h (34/t + 5 a s / (h t)) with sequence parallelism (eq. 4), at
    2 bytes a value with dropout masks (the paper's GPT)."""
    from tfdist.models.arithmetic import Transformer
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B's shape, t = 8
    arch = Transformer(n_layer=96, n_embd=h, n_head=a, vocab_size=51200, seq_len=s, dropout=True)
    tensor = arch.activation_bytes_per_layer(s * b, "mixed", tp=t)
    sequence = arch.activation_bytes_per_layer(s * b, "mixed", tp=t, sp=True)
    assert tensor == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert sequence == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)))


def test_the_planner_recommends_a_runnable_tensor_parallel_layout():
    from tfdist import plan
    # GPT-2 large: its 20 heads split over t = 2 (GPT-2 XL's 25 would not: the layout refuses t=2)
    c = plan.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "gpt2_large.py"))
    model = plan.model_from_config(c, "gpt2_large")
    cluster = plan.Cluster(plan.DEVICES["a100-40gb"], 8)
    # (a batch of 4 sequences: one per replica; and 64: 16 batches accumulated per update)
    opts = plan.calibrated_options()
    p = plan.evaluate(model, cluster, plan.planned(4, 4, tp=2), opts)
    assert plan.runnable(p, cluster)
    accumulating = plan.evaluate(model, cluster, plan.planned(64, 4, tp=2), opts)
    assert plan.runnable(accumulating, cluster) and "--config.train.grad_accum_steps=16" in (
        plan.tfdist_command(accumulating, cluster, "--config=configs/gpt2_large.py", "mixed"))
    cmd = plan.tfdist_command(p, cluster, "--config=configs/gpt2_large.py", "mixed")
    assert "--config.tensor.parallel=2" in cmd and cmd.startswith("tfdist launch --workers 4 ")
    # tfdist keeps the embedding and head whole: a layout that fits only when they are split
    # over the tensor-parallel ranks (Megatron's vocabulary-parallel head) is not runnable
    whole = plan.memory(model, plan.planned(64, 4, tp=2), plan.Options(vocab_parallel=False))
    split = plan.memory(model, plan.planned(64, 4, tp=2), plan.Options())
    assert whole["weights"] > split["weights"]
    # ZeRO composes with t
    z = plan.evaluate(model, cluster, plan.planned(4, 4, tp=2, zero=1), opts)
    assert plan.runnable(z, cluster) and "--config.zero.stage=1" in plan.tfdist_command(
        z, cluster, "--config=configs/gpt2_large.py", "mixed")
    np.testing.assert_equal(p.tfdist_fits, True)
