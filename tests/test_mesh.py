"""Keras's own model-parallel API on TensorFlow (`tfdist.parallel.mesh`): keras-hub's Llama
sharded by its `get_layout_map`, and a plain functional model by a two-entry map, on meshes of
logical CPU devices of one process and of two; each run against the same program on one device
(tfdist's `single` strategy: the same Keras corrections, tests/support/mesh_probe.py).

Each test runs its program in a process of its own (DTensor starts once per process)."""
import json
import os
import sys

import pytest

from tests.helpers import ROOT, assert_usage_error, run, run_group, tf_noise

PROBE = os.path.join(ROOT, "tests", "support", "mesh_probe.py")
BAD = os.path.join(ROOT, "tests", "support", "mesh_bad.py")
TOLERANCE = 1e-5
TIMEOUT = 300


def probe(tmp_path, *args, workers=0, check=True):
    """The probe's result (tests/support/mesh_probe.py), in one process or `workers`."""
    out = tmp_path / "result.json"
    argv = [sys.executable, PROBE, *args, f"--out={out}"]
    if workers:
        argv = [sys.executable, "-m", "tfdist", "launch", f"--workers={workers}",
                "--max_restarts=1", "--"] + argv
    p = run_group(argv, TIMEOUT)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()) if out.exists() else None


def assert_equal_to_one_device(result, generate=True):
    """Per-step losses, predictions, greedy tokens and the logits of the model saved on the mesh
    and loaded on one device, against one device."""
    mesh, one = result["mesh_losses"], result["reference_losses"]  # 5 steps, then evaluate
    assert len(mesh) == len(one) == 6
    assert max(abs(a - b) for a, b in zip(mesh, one)) < TOLERANCE, (mesh, one)
    assert one[-2] < one[0] - 0.1  # it trained
    assert result["predict_difference"] < TOLERANCE
    assert result["loaded_difference"] < TOLERANCE
    if generate:
        assert result["generate_equal"]


def assert_sharded(result, shape):
    """Each device holds its layout's share of every variable: a kernel sharded over the model
    axis (and the batch axis) holds 1/model (1/(batch*model)) of its bytes on each device, read
    from the variable's shards; the mesh's kernels are not whole."""
    sizes = dict(zip(("batch", "model"), shape))
    sharded = 0
    for path, v in result["sharding"].items():
        split = 1
        for axis in v["spec"]:
            split *= sizes.get(axis, 1)
        assert v["expected"] * split == v["whole"], (path, v)
        assert set(v["devices"].values()) == {v["expected"]}, (path, v)
        sharded += "model" in v["spec"] and path.endswith(("kernel", "embeddings"))
    assert sharded, "every kernel is whole on every device"


@pytest.mark.slow
@pytest.mark.parametrize("shape", [  # ((1, 2): long, the suite's time; (2, 2) splits it too)
    pytest.param((1, 2), marks=pytest.mark.long), (2, 2)], ids=["1x2", "2x2"])
def test_llama_on_a_mesh_equals_one_device(tmp_path, shape):
    """keras-hub's Llama (GQA, random weights) with LlamaBackbone.get_layout_map on a mesh of
    logical CPUs in one process: 5 steps of fit, predict, greedy generate, save on the mesh and
    load on one device."""
    result = probe(tmp_path, "llama", f"--mesh={shape[0]}x{shape[1]}")
    assert result["devices"] == [f"cpu:{i}" for i in range(shape[0] * shape[1])]
    assert_sharded(result, shape)
    assert_equal_to_one_device(result)


@pytest.mark.slow
def test_llama_on_two_processes_equals_one_device(tmp_path):
    """A (2, 2) mesh over 2 processes of 2 logical CPUs each (`tfdist launch --workers 2`)."""
    result = probe(tmp_path, "llama", "--mesh=2x2", workers=2)
    assert result["devices"] == [f"cpu:{i}" for i in range(4)]
    assert all("/task:0/" in d for v in result["sharding"].values() for d in v["devices"])
    assert_sharded(result, (2, 2))
    assert_equal_to_one_device(result)


@pytest.mark.slow
def test_a_users_functional_model_with_a_two_entry_map(tmp_path):
    """A plain functional model: "up/kernel" sharded by columns, "down/kernel" by rows (the
    Megatron pair), on a (2, 2) mesh; `keras.distribution.distribute_tensor` puts a tensor's rows
    over the model axis."""
    result = probe(tmp_path, "plain", "--mesh=2x2")
    assert_sharded(result, (2, 2))
    assert result["sharding"]["up/kernel"]["spec"] == ["unsharded", "model"]
    assert_equal_to_one_device(result, generate=False)
    placed = result["distributed_tensor"]
    assert placed["whole"] and set(placed["devices"].values()) == {8 * 4 * 4 // 2}


@pytest.mark.slow
def test_data_parallel_over_four_devices(tmp_path):
    """`keras.distribution.DataParallel` over 4 logical CPUs: every weight whole on each device,
    each batch split 4 ways, one device's losses."""
    result = probe(tmp_path, "plain", "--mesh=1x4", "--data-parallel")
    assert all(set(v["devices"].values()) == {v["whole"]} and len(v["devices"]) == 4
               for v in result["sharding"].values())
    assert_equal_to_one_device(result, generate=False)


@pytest.mark.slow
def test_tfdists_llama_with_its_own_layout_map(tmp_path):
    """tfdist's own GPT (architecture llama, GQA) sharded by `tfdist.models.gpt.layout_map` on a
    (2, 2) mesh; its architecture gpt2 is refused in one line (DTensor crashes in its step)."""
    result = probe(tmp_path, "gpt_llama", "--mesh=2x2")
    assert_sharded(result, (2, 2))
    assert result["sharding"]["gpt/h_0/c_fc/kernel"]["spec"] == ["model", "unsharded"]
    assert_equal_to_one_device(result, generate=False)
    p = run([sys.executable, PROBE, "gpt2", "--mesh=1x2", f"--out={tmp_path / 'gpt2.json'}"],
            timeout=120, check=False)
    assert_usage_error(p, "architecture gpt2 does not run on a DTensor mesh")


@pytest.mark.slow
def test_the_example_program_runs(tmp_path):
    """launchers/examples/keras_hub_llama_mesh.py, as docs/parallelism.md shows it: on a (2, 2)
    mesh the query kernel's first device holds a quarter of it, and it generates."""
    example = os.path.join(ROOT, "launchers", "examples", "keras_hub_llama_mesh.py")
    p = run([sys.executable, example, "--mesh=2x2", "--steps=2"], timeout=TIMEOUT)
    assert "query/kernel" in p.stdout and "1024/4096 of its values" in p.stdout, p.stdout[-2000:]
    assert "generated [" in p.stdout


KERAS_ALONE = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), keras.distribution.list_devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["up/kernel"] = (None, "model")
keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                     batch_dim_name="batch"))
inputs = keras.Input((4,))
model = keras.Model(inputs, keras.layers.Dense(16, name="up")(inputs))
kernel = model.weights[0].value
print(type(kernel).__name__, kernel.device, tuple(kernel.shape))
"""


def test_without_tfdist_keras_leaves_every_variable_whole():
    """What tfdist's line is for (and cannot change where tfdist is not imported; the docs and
    the patch table say so): Keras 3.15 on TensorFlow takes ModelParallel without a word and
    leaves the kernel a whole variable on one device. When this fails, Keras's own TF backend
    shards: see whether `tfdist.parallel.mesh` is still needed."""
    p = run([sys.executable, "-c", KERAS_ALONE], timeout=120)
    kind, device, shape = p.stdout.split(" ", 2)
    assert kind == "ResourceVariable" and device.endswith("CPU:0"), p.stdout
    assert shape.strip() == "(4, 16)"  # whole
    said = [line for line in p.stderr.splitlines() if line.strip() and not tf_noise(line)]
    assert not any("distribut" in line.lower() for line in said), said  # not a word


@pytest.mark.slow
def test_a_layout_map_that_matches_nothing_leaves_kernels_whole(tmp_path):
    """The companion of the sharding check: a map whose one key matches no weight leaves every
    kernel whole on every device (what Keras does, on any backend), and the check sees it."""
    result = probe(tmp_path, "plain_nomatch", "--mesh=1x2", "--no-reference")
    with pytest.raises(AssertionError, match="whole"):
        assert_sharded(result, (1, 2))


@pytest.mark.slow
def test_the_step_in_one_function_loses_its_update(tmp_path):
    """Why tfdist's step is two DTensor functions (tfdist/parallel/mesh/step.py): Keras's own
    train_step as one function, on the same batch on the mesh, moves no weight (DTensor, TF 2.21,
    reads Adam's moments before their update), where tfdist's two functions train. When this
    fails, DTensor keeps the order, and the step could be one function again."""
    result = probe(tmp_path, "llama", "--mesh=1x2", "--no-reference", "--steps=1",
                   "--one-function")
    assert result["one_function_moved"] == 0.0
    assert result["mesh_losses"]


@pytest.mark.slow
def test_a_killed_worker_resumes_at_its_backup(tmp_path):
    """SIGKILL of worker 1 at the end of step 3 of 5 on the 2-process mesh (epochs of one step):
    the group restarts from Keras's BackupAndRestore (each epoch's, the weights gathered from
    their shards, written by process 0 alone and whole) and runs steps 3 to 5 with the losses of
    an uninterrupted run."""
    backup = tmp_path / "backup"
    result = probe(tmp_path, "llama", "--mesh=2x2", f"--backup={backup}", "--die-after=3",
                   workers=2)
    assert (tmp_path / "killed-once").exists()  # it was killed
    resumed, whole = result["mesh_losses"][:-1], result["reference_losses"][:-1]  # (evaluate's)
    assert len(resumed) == 3, resumed  # steps 3 to 5: it resumed at its backup (after step 2)
    assert max(abs(a - b) for a, b in zip(resumed, whole[2:])) < TOLERANCE, (resumed, whole)


@pytest.mark.slow
def test_a_backup_within_an_epoch_is_said_to_resume_at_its_start(tmp_path):
    """Keras's BackupAndRestore resumes a backup made within an epoch at the epoch's start (on
    every backend); on the mesh process 0 says so in one line at the start of fit."""
    out = tmp_path / "result.json"
    p = run([sys.executable, PROBE, "plain", "--mesh=1x2", "--no-reference", "--steps=1",
             f"--backup={tmp_path / 'backup'}", "--save-freq=1", f"--out={out}"], timeout=TIMEOUT)
    said = [line for line in p.stderr.splitlines() if line.startswith("tfdist: warning:")]
    assert len(said) == 1 and "resumes a backup made within an epoch" in said[0], p.stderr[-2000:]


@pytest.mark.parametrize("case, needle", [
    ("larger_mesh", "Shape does not match the number of devices"),
    ("missing_device", "names device 7, but there are 2"),
    ("not_dividing", "of up/kernel (shape (4, 16)) shards its dimension 1 (16)"),
    pytest.param("with_zero", "do not compose", marks=pytest.mark.horovod),
])
def test_bad_input_is_one_line(case, needle):
    """A mesh larger than the devices (Keras's own check, as one line), a device that is not
    there, a layout that does not divide a dimension, and the mesh under tfdist's ZeRO-3."""
    p = run([sys.executable, BAD, case], timeout=120, check=False)
    assert_usage_error(p, needle)
    assert "Traceback" not in p.stderr
