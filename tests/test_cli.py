"""The CLI end to end, and its contract for bad input: one line, exit status 2, nothing touched."""
import os
import re
import sys

import pytest

from tests.helpers import (
    ROOT,
    assert_usage_error,
    driver,
    load_config,
    metrics,
    run,
    tfdist,
    tree_digest,
)
from tfdist.runtime.lock import LOCK_NAME

STEPS, PER_EPOCH = 20, 10  # of the finished run below


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_dir):
    """A real nano run through `tfdist train`, kept for the checks below."""
    wd = str(tmp_path_factory.mktemp("run"))
    p = tfdist("train", f"--workdir={wd}", f"--config.data.data_dir={data_dir}",
               f"--config.train.steps={STEPS}", f"--config.train.steps_per_epoch={PER_EPOCH}")
    return wd, p


@pytest.mark.slow
def test_train_writes_model_metrics_tensorboard_and_plot(finished_run):
    wd, p = finished_run
    epochs = STEPS // PER_EPOCH
    # Keras progress bar with throughput
    assert f"Epoch 1/{epochs}" in p.stdout and "tok/s" in p.stdout
    m = metrics(wd)
    assert [r["step"] for r in m["steps"]] == list(range(1, STEPS + 1))
    assert len(m["evals"]) == epochs and m["evals"][-1]["loss"] < m["steps"][0]["loss"]
    assert os.path.getsize(os.path.join(wd, "loss.png")) > 5000
    assert any(f.startswith("events.out") for f in os.listdir(os.path.join(wd, "tensorboard")))
    assert os.path.exists(os.path.join(wd, "model.keras"))
    assert not os.path.exists(os.path.join(wd, "backup"))  # removed after success
    assert "validation loss" in p.stdout


#: A float printed as it is stored: a count with decimals (12119372.0000), an exponent (0.0000e+00).
UNFORMATTED = re.compile(r"\d{5,}\.\d|\d\.\d+e[+-]\d\d")


def unreadable(text):
    """What makes a run's output, written to a file, hard to read: carriage returns (a progress
    bar redrawn in place) and unformatted floats."""
    return (["carriage returns"] if "\r" in text else []) + UNFORMATTED.findall(text)


@pytest.mark.slow
def test_output_to_a_file_is_a_line_per_step_with_readable_numbers(finished_run, tmp_path):
    """`tfdist train` and `tfdist prepare` with their output going to a file (here a pipe): one
    line per log interval, numbers with thousands separators."""
    _, p = finished_run
    assert unreadable(p.stdout) == [], unreadable(p.stdout)[:5]
    lines = [x for x in p.stdout.splitlines() if x.startswith("step ")]
    assert len(lines) == STEPS and re.fullmatch(r"step 1/10 - loss: \d\.\d{4} - tok/s: [\d,]+",
                                                 lines[0]), lines[:2]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                              for i in range(40_000)))
    prep = tfdist("prepare", f"--config.data.source={corpus}",
                  f"--config.data.data_dir={tmp_path / 'data'}", "--workers=1")
    assert unreadable(prep.stdout) == [], unreadable(prep.stdout)[:5]
    assert re.search(r"tokens: \d{1,3}(,\d{3})+", prep.stdout), prep.stdout[-2000:]


@pytest.mark.slow
def test_keras_own_progress_bar_is_unreadable_in_a_file():
    """The companion: Keras's progress bar, written to a pipe, redraws with carriage returns and
    prints a count as 12119372.0000 (what tfdist's output looked like)."""
    program = ("import keras, numpy as np\n"
               "class Tokens(keras.callbacks.Callback):\n"
               "    def on_train_batch_end(self, batch, logs=None):\n"
               "        logs['tokens'] = 12119372.0\n"
               "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
               "m.compile(optimizer='sgd', loss='mse')\n"
               "m.fit(np.ones((64, 2)), np.ones((64, 1)), epochs=1, verbose=1, "
               "callbacks=[Tokens()])\n")
    p = run([sys.executable, "-c", program], timeout=300)
    problems = unreadable(p.stdout)
    assert "carriage returns" in problems and "12119372.0" in problems, problems


@pytest.mark.slow
def test_sample_generates_text_from_the_saved_model(finished_run):
    wd, _ = finished_run
    prompt, new_tokens = "import ", 40
    p = tfdist("sample", f"--model={wd}/model.keras", f"--prompt={prompt}",
               f"--max_new_tokens={new_tokens}")
    out = p.stdout.split("---\n", 1)[1]
    assert out.startswith(prompt) and len(out.encode()) >= new_tokens  # byte tokens: a byte each


@pytest.mark.slow
@pytest.mark.bf16
def test_mixed_precision_and_gradient_accumulation_train(tmp_path, data_dir):
    steps = 8
    tfdist("train", f"--workdir={tmp_path}", f"--config.data.data_dir={data_dir}",
           f"--config.train.steps={steps}", "--config.train.steps_per_epoch=4",
           "--config.train.warmup_steps=2", "--config.train.precision=mixed_bfloat16",
           "--config.train.grad_accum_steps=2")
    m = metrics(tmp_path)
    assert len(m["steps"]) == steps and all(r["loss"] == r["loss"] for r in m["steps"])  # no NaN
    assert m["evals"][-1]["loss"] < 5.5


@pytest.mark.slow
def test_bfloat16_under_a_onednn_cap_below_it_is_one_line(tmp_path, data_dir):
    """ONEDNN_MAX_CPU_ISA=AVX2 on a CPU with AVX-512: TF picks oneDNN's bfloat16 matmul from the
    CPU's flags and the capped oneDNN has none, which would crash the process (exit 139); tfdist
    train says so in one line, exit 2, before the model is built."""
    from tfdist.runtime import cpu
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    if not cpu.bf16_blocked(environ=env):
        pytest.skip("this CPU has no AVX-512: TF runs bfloat16 on Eigen under the cap, nothing to "
                    "refuse")
    p = tfdist("train", f"--workdir={tmp_path / 'run'}", f"--config.data.data_dir={data_dir}",
               "--config.train.precision=mixed_bfloat16", env=env, check=False)
    assert_usage_error(p, "train.precision=mixed_bfloat16 cannot run here: "
                          "ONEDNN_MAX_CPU_ISA=AVX2 caps oneDNN")


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
    "mirrored ring": (bad("train", "--strategy=mirrored",
                          "--config.strategy.cross_device_ops=ring"), "cross_device_ops"),
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
    assert_usage_error(p, needle)
    assert tree_digest(wd) == before


@pytest.mark.slow
def test_finished_run_is_not_overwritten_without_flag(finished_run, data_dir):
    wd, _ = finished_run
    before = tree_digest(wd)
    p = tfdist("train", f"--workdir={wd}", f"--config.data.data_dir={data_dir}", check=False)
    assert_usage_error(p, "--overwrite")
    assert tree_digest(wd) == before


@pytest.mark.slow
def test_backup_from_a_different_model_config_is_refused(tmp_path, data_dir):
    o = {"data.data_dir": data_dir, "train.steps": STEPS, "train.steps_per_epoch": PER_EPOCH,
         "backup.every_steps": 5}
    p, _ = driver(tmp_path, o, "--kill-at-step", "7", check=False)
    assert p.returncode == -9
    assert (tmp_path / LOCK_NAME).exists()  # the killed run's: the refused one takes it over
    before = tree_digest(tmp_path, exclude=[LOCK_NAME])  # and, leaving, removes it
    n_layer = load_config("configs/gpt_nano.py").model.n_layer + 1  # not the backup's model
    p = tfdist("train", f"--workdir={tmp_path}", f"--config.data.data_dir={data_dir}",
               f"--config.train.steps={STEPS}", f"--config.train.steps_per_epoch={PER_EPOCH}",
               f"--config.model.n_layer={n_layer}", check=False)
    line = assert_usage_error(p, "different model")
    assert "n_layer" in line
    assert tree_digest(tmp_path) == before and not (tmp_path / LOCK_NAME).exists()


def test_config_files_all_validate():
    from tfdist import config
    for f in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        config.validate(load_config(os.path.join("configs", f)))
