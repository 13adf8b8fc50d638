"""Pipeline (GPipe) model parallelism: gradients and losses equal the unsplit GPT's, every stage's
variables and ops are on its device, a backup restores into another split and into the plain
model, bad pipeline configs are one line, and the CPU is split before MultiWorkerMirrored starts.
(Pipeline stages under data parallelism across 2 processes: tests/test_tensor_parallel.py's 3D
test.)"""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import (
    ROOT,
    assert_usage_error,
    driver,
    final_weights,
    first_fast,
    free_port,
    max_diff,
    run,
    tfdist,
    weights,
)

PROBE = os.path.join(ROOT, "tests", "support", "pipeline_probe.py")


def probe(*args):
    p = run([sys.executable, PROBE, *map(str, args)], timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("PROBE ")][-1]
    return json.loads(line[len("PROBE "):])


@pytest.mark.parametrize("k,m,extra", first_fast([(2, 4, ""), (4, 4, ""), (2, 4, "recompute")]))
def test_gradients_equal_the_unsplit_model(k, m, extra):
    r = probe("grads", k, m, *([extra] if extra else []))
    assert r["n"] == 52  # every trainable variable of the 4-block GPT has a gradient
    assert r["loss_diff"] <= 1e-5
    assert r["max_grad_diff"] <= 1e-5, r
    assert r["max_grad"] > 1e-2  # the gradients compared are not all ~0


@pytest.mark.slow
def test_losses_over_ten_steps_equal_the_unsplit_model():
    """10 SGD steps: the split model sums its microbatches' losses in another order than the
    unsplit one, a difference of float32 rounding that SGD does not amplify: the losses (about
    5.5, whose float32 spacing is 4.8e-7) agreed within 2 spacings on an AMD EPYC; the bound,
    1e-5, is 21."""
    r = probe("losses", 2, 4)
    assert len(r["plain"]) == len(r["pipeline"]) == 10
    assert r["max_diff"] <= 1e-5, r
    assert r["plain"][-1] != r["plain"][0]  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.long)])  # (4: for time)
def test_every_stage_is_on_its_device(k):
    r = probe("placement", k, 4)
    stage_of_block = {b: s for s, blocks in enumerate(r["stage_blocks"]) for b in blocks}
    assert sorted(stage_of_block) == [0, 1, 2, 3]
    for path, device in r["variables"].items():  # variables
        if "/h_" in path:
            block = int(path.split("/h_")[1].split("/")[0])
            assert device == stage_of_block[block], path
        elif "wte" in path or "wpe" in path:
            assert device == 0, path
        elif "ln_f" in path:
            assert device == k - 1, path
    for path, device in r["slots"].items():  # optimizer slots live with their variables
        if "_h_" in path:
            block = int(path.split("_h_")[1].split("_")[0])
            assert device == stage_of_block[block], path
    for block, ops in r["block_ops"].items():  # forward and backward ops of each block
        want = [stage_of_block[int(block)]]
        assert ops["forward"] == want and ops["backward"] == want, (block, ops)
    assert sorted(r["update_ops"]) == [str(s) for s in range(k)]  # each device updates its own


def common(data_dir, **extra):
    return {"data.data_dir": data_dir, "train.steps": 12, "train.steps_per_epoch": 6,
            "train.batch_size": 16, "model.n_layer": 4, "train.intra_op_threads": 1,
            "train.inter_op_threads": 2, **extra}


@pytest.mark.slow
@pytest.mark.long  # tests/test_tensor_parallel.py's restore across layouts shows the same
def test_backup_restores_into_another_split_and_into_the_plain_model(tmp_path, data_dir):
    o = common(data_dir, **{"backup.every_steps": 1, "pipeline.stages": 2,
                            "pipeline.layers_per_stage": "1,3", "pipeline.microbatches": 2})
    driver(tmp_path / "ref", o, "--dump-weights")
    kill_at, steps = 5, o["train.steps"]
    p, _ = driver(tmp_path / "run", o, "--kill-at-step", str(kill_at), check=False)
    assert p.returncode == -9  # killed after step 5, its backup written
    # Resume the same run split into 4 stages: it continues at step 5 ...
    p, res = driver(tmp_path / "run", {**o, "pipeline.stages": 4, "pipeline.layers_per_stage": ""},
                    "--dump-weights")
    assert "resuming from" in p.stdout and f"at step {kill_at} of {steps}" in p.stdout
    assert res["steps_run"] == steps - kill_at
    # the run's memory report: every stage holds its own parameters
    for s in range(4):
        assert re.search(rf"stage {s} on \S+CPU:{s}: [1-9][\d,]* parameters, estimated peak",
                         p.stdout), p.stdout[-2000:]
    assert max_diff(weights(tmp_path / "run", 0), weights(tmp_path / "ref", 0)) <= 1e-5
    # ... and the plain model resumes a pipeline's backup too: it holds the GPT's names.
    p, _ = driver(tmp_path / "run2", o, "--kill-at-step", "3", check=False)
    p, res = driver(tmp_path / "run2", {**o, "pipeline.stages": 1, "pipeline.microbatches": 1,
                                        "pipeline.layers_per_stage": ""})
    assert f"at step 3 of {steps}" in p.stdout and res["steps_run"] == steps - 3
    assert max_diff(final_weights(tmp_path / "run2"), final_weights(tmp_path / "ref")) <= 1e-5


@pytest.mark.parametrize("flags,needle", first_fast([
    (["--config.pipeline.stages=3"], "cannot exceed the model's blocks"),
    (["--config.pipeline.stages=2", "--config.pipeline.microbatches=3"], "must divide the batch"),
    (["--config.pipeline.stages=2", "--config.pipeline.layers_per_stage=2,1"], "adding up to"),
    (["--config.pipeline.stages=2", "--config.pipeline.devices=/cpu:0"], "lists 1 device"),
    (["--config.pipeline.stages=2", "--strategy=mirrored", "--devices=2"],
     "one replica per process"),
    (["--config.pipeline.microbatches=0"], "pipeline.microbatches"),
]))
def test_bad_pipeline_configs_are_one_line(tmp_path, flags, needle):
    p = tfdist("train", "--config=configs/gpt_nano.py", f"--workdir={tmp_path}",
               "--config.train.batch_size=8", *flags, check=False)
    assert_usage_error(p, needle)
    assert not os.listdir(tmp_path)


_SPLIT_THEN_MWMS = """
import json, os, sys
from tfdist.parallel.layout import Layout
import tensorflow as tf
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["127.0.0.1:%d"]},
                                      "task": {"type": "worker", "index": 0}})
layout = Layout(pp=2, microbatches=2)
if sys.argv[1] == "listed first":  # the order of tfdist train before the fix
    layout.split_cpu()
    layout.place_devices()
else:  # tfdist train's order
    layout.split_cpu()
tf.distribute.MultiWorkerMirroredStrategy()
print(json.dumps(layout.place_devices()))
"""


@pytest.mark.parametrize("order", ["train's", "listed first"])
def test_a_split_cpu_leaves_tf_unstarted_for_multi_worker_mirrored(order):
    """`tfdist train` splits the CPU for a pipeline before the strategy, and lists the devices
    after it: MultiWorkerMirrored configures its collectives at TF's startup, which listing a
    device starts ("Collective ops must be configured at program startup"). Companion: listed
    first, it fails."""
    p = subprocess.run([sys.executable, "-c", _SPLIT_THEN_MWMS % free_port(), order],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    if order == "listed first":
        assert p.returncode and "Collective ops must be configured at program startup" in p.stderr
    else:
        assert p.returncode == 0, p.stderr[-2000:]
        assert [d.rsplit("/", 1)[1] for d in json.loads(p.stdout.splitlines()[-1])] == \
            ["device:CPU:0", "device:CPU:1"]
