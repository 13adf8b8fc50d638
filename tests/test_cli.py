"""The CLI end to end, and its contract for bad input: one line, exit status 2, nothing touched."""
import hashlib
import json
import os

import pytest

from tests.conftest import ROOT, tfdist


def tree_digest(root):
    """Hash of every file's path and content under root: proves nothing on disk changed."""
    h = hashlib.sha1()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for f in sorted(filenames):
            p = os.path.join(dirpath, f)
            h.update(p.encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_dir):
    """A real nano run through `tfdist train`, kept for the checks below."""
    wd = str(tmp_path_factory.mktemp("run"))
    p = tfdist("train", f"--workdir={wd}", f"--config.data.data_dir={data_dir}",
               "--config.train.steps=20", "--config.train.steps_per_epoch=10")
    return wd, p


@pytest.mark.slow
def test_train_writes_model_metrics_tensorboard_and_plot(finished_run):
    wd, p = finished_run
    assert "Epoch 1/2" in p.stdout and "tok/s" in p.stdout  # Keras progress bar with throughput
    m = json.load(open(os.path.join(wd, "metrics.json")))
    assert [r["step"] for r in m["steps"]] == list(range(1, 21))
    assert len(m["evals"]) == 2 and m["evals"][-1]["loss"] < m["steps"][0]["loss"]
    assert os.path.getsize(os.path.join(wd, "loss.png")) > 5000
    assert any(f.startswith("events.out") for f in os.listdir(os.path.join(wd, "tensorboard")))
    assert os.path.exists(os.path.join(wd, "model.keras"))
    assert not os.path.exists(os.path.join(wd, "backup"))  # removed after success
    assert "validation loss" in p.stdout


@pytest.mark.slow
def test_sample_generates_text_from_the_saved_model(finished_run):
    wd, _ = finished_run
    p = tfdist("sample", f"--model={wd}/model.keras", "--prompt=import ", "--max_new_tokens=40")
    out = p.stdout.split("---\n", 1)[1]
    assert out.startswith("import ") and len(out.encode()) >= 40


@pytest.mark.slow
def test_mixed_precision_and_gradient_accumulation_train(tmp_path, data_dir):
    p = tfdist("train", f"--workdir={tmp_path}", f"--config.data.data_dir={data_dir}",
               "--config.train.steps=8", "--config.train.steps_per_epoch=4",
               "--config.train.warmup_steps=2", "--config.train.precision=mixed_bfloat16",
               "--config.train.grad_accum_steps=2")
    m = json.load(open(tmp_path / "metrics.json"))
    assert len(m["steps"]) == 8 and all(r["loss"] == r["loss"] for r in m["steps"])  # no NaN
    assert m["evals"][-1]["loss"] < 5.5


def bad(*args):
    return args


CASES = {
    "unknown strategy": (bad("train", "--strategy=nccl"), "unknown strategy 'nccl'"),
    "unknown config key": (bad("train", "--config.model.n_layr=4"), "n_layr"),
    "ill-typed config value": (bad("train", "--config.model.n_layer=four"), "n_layer"),
    "non-positive batch": (bad("train", "--config.train.batch_size=0"), "train.batch_size"),
    "heads do not divide width": (bad("train", "--config.model.n_head=3"), "divisible"),
    "bad precision": (bad("train", "--config.train.precision=fp8"), "train.precision"),
    "missing config file": (bad("train", "--config=configs/nope.py"), "nope.py"),
    "missing data path": (bad("train", "--config.data.source=/no/such/dir"), "does not exist"),
    "unprepared tfds dataset": (bad("train", "--config.data.source=tfds:no_such_ds_xyz"),
                                "not found"),
    "jit under mirrored": (bad("train", "--strategy=mirrored", "--devices=2",
                               "--config.train.jit_compile=True"), "jit_compile"),
    "batch vs replicas": (bad("train", "--strategy=mirrored", "--devices=3"), "divisible"),
    "mirrored ring": (bad("train", "--strategy=mirrored", "--config.strategy.cross_device_ops=ring"),
                      "cross_device_ops"),
    "missing model to sample": (bad("sample", "--model=/no/such/model.keras"), "not found"),
    "unknown command": (bad("trian"), "unknown command"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_one_line_exit_2_nothing_touched(name, finished_run, data_dir):
    args, needle = CASES[name]
    wd, _ = finished_run
    before = tree_digest(wd)
    extra = [f"--workdir={wd}", f"--config.data.data_dir={data_dir}"] if args[0] == "train" else []
    p = tfdist(*args, *extra, check=False, timeout=120)
    lines = [x for x in p.stderr.splitlines() if x.strip() and not _tf_noise(x)]
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("tfdist: error:"), lines
    assert needle in lines[0]
    assert tree_digest(wd) == before


@pytest.mark.slow
def test_finished_run_is_not_overwritten_without_flag(finished_run, data_dir):
    wd, _ = finished_run
    before = tree_digest(wd)
    p = tfdist("train", f"--workdir={wd}", f"--config.data.data_dir={data_dir}", check=False)
    assert p.returncode == 2 and "--overwrite" in p.stderr
    assert tree_digest(wd) == before


@pytest.mark.slow
def test_backup_from_a_different_model_config_is_refused(tmp_path, data_dir):
    from tests.conftest import driver
    o = {"data.data_dir": data_dir, "train.steps": 20, "train.steps_per_epoch": 10,
         "backup.every_steps": 5}
    p, _ = driver(tmp_path, o, "--kill-at-step", "7", check=False)
    assert p.returncode == -9
    before = tree_digest(tmp_path)
    p = tfdist("train", f"--workdir={tmp_path}", f"--config.data.data_dir={data_dir}",
               "--config.train.steps=20", "--config.train.steps_per_epoch=10",
               "--config.model.n_layer=3", check=False)
    err = [x for x in p.stderr.splitlines() if x.startswith("tfdist:")]
    assert p.returncode == 2 and len(err) == 1 and "different model" in err[0], p.stderr[-1500:]
    assert "n_layer" in err[0]
    assert tree_digest(tmp_path) == before


def _tf_noise(line):
    """TensorFlow's C++ start-up lines (oneDNN notice, absl pre-init warning) are not ours."""
    return ("oneDNN custom operations" in line or "absl::InitializeLog" in line
            or line.startswith(("I0000", "W0000", "E0000")))


def test_config_files_all_validate():
    import importlib.util
    from tfdist import config
    for f in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        spec = importlib.util.spec_from_file_location(f[:-3], os.path.join(ROOT, "configs", f))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        config.validate(mod.get_config())
