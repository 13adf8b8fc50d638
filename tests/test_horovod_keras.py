"""`tfdist.horovod.keras`, the drop-in for `horovod.tensorflow.keras` on Keras 3: Horovod-style
Keras programs (tests/support/horovod_keras_mnist.py, tests/support/horovod_keras_synthetic.py)
run under `horovodrun -np 2` (the mnist example) and as the ranks of `tfdist launch
--strategy=horovod` with ranks bitwise identical and a falling loss; the same programs
with only the import line changed to Horovod's own API crash or leave the ranks apart (the
companion); arguments without effect on Keras 3 are one line, impossible ones one `ValueError`."""
import os
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, run, run_group, tagged
from tfdist.strategies.horovod import horovodrun_argv

RANKS = 2
TFDIST = "import tfdist.horovod.keras as hvd  # the Horovod Keras API"
HOROVOD = "import horovod.tensorflow.keras as hvd  # the Horovod Keras API"

pytestmark = [pytest.mark.horovod, pytest.mark.slow]


def program(name, tmp_path, api):
    """The program's text with its import line set to `api` (the only line that differs)."""
    with open(os.path.join(ROOT, "tests", "support", name)) as f:
        text = f.read()
    assert text.count(TFDIST) == 1
    path = tmp_path / f"{api}_{name}"
    path.write_text(text.replace(TFDIST, TFDIST if api == "tfdist" else HOROVOD))
    return str(path)


def write_mnist(path, n=600, seed=0):
    """A small learnable stand-in for mnist.npz: 10 noisy class templates, 28x28 uint8."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(10, 28, 28))
    y = rng.integers(0, 10, size=n)
    x = np.clip(templates[y] + rng.normal(0, 40, size=(n, 28, 28)), 0, 255).astype(np.uint8)
    np.savez(path, x_train=x, y_train=y.astype(np.uint8))


def horovodrun(argv, timeout=300):
    """A Horovod Keras program under Horovod's own launcher (`tfdist.launch.horovodrun`)."""
    p = run_group(horovodrun_argv(RANKS, [sys.executable, *argv]), timeout)
    # horovodrun's prefix, on each write: a rank's line may follow another's progress bar
    found = tagged(p.stdout, "RESULT", prefix=r".*?\[(\d+)\]<stdout>:")
    return p, found


def ranks(argv, timeout=300):
    """The same program as ranks of `tfdist launch --strategy=horovod` (started warm)."""
    p = run_group([sys.executable, "-m", "tfdist", "launch", "--strategy=horovod",
                   f"--workers={RANKS}", "--max_restarts=0", "--", sys.executable, *argv],
                  timeout)
    return p, tagged(p.stdout, "RESULT", prefix=r".*?\[r(\d+)\] ")


def assert_crashed_or_apart(p, found):
    """What Horovod's own Keras API does on Keras 3: a crash, or ranks whose weights differ."""
    broken = p.returncode != 0 or len(found) != RANKS or found[0]["weights"] != found[1]["weights"]
    assert broken, "Horovod's own Keras API worked on Keras 3: the drop-in may no longer be needed"


def mnist(tmp_path, api, launch=horovodrun):
    npz = tmp_path / "mnist.npz"
    write_mnist(npz)
    out = tmp_path / api
    out.mkdir()
    return launch([program("horovod_keras_mnist.py", tmp_path, api), str(npz), str(out)])


def test_horovods_keras_mnist_example_runs_with_one_line_changed(tmp_path):
    p, found = mnist(tmp_path, "tfdist")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert set(found) == set(range(RANKS))
    assert found[0]["weights"] == found[1]["weights"]  # bitwise identical ranks
    loss = found[0]["loss"]
    assert loss == found[1]["loss"] and loss[-1] < 0.7 * loss[0], loss  # averaged, and it learns
    # LearningRateWarmupCallback: from lr/size to lr over 2 epochs, then left alone
    assert found[0]["lr"] == pytest.approx([0.0015, 0.002, 0.002, 0.002], rel=1e-5)
    assert "finished gradual learning rate warmup to 0.002" in p.stdout
    assert sorted(os.listdir(tmp_path / "tfdist")) == [f"checkpoint-{e}.keras"
                                                       for e in (1, 2, 3, 4)]


def test_with_horovods_own_keras_api_the_mnist_example_fails(tmp_path):
    """The companion: Horovod's own horovod.tensorflow.keras on Keras 3 crashes or drifts (its
    ranks started by tfdist launch)."""
    p, found = mnist(tmp_path, "horovod", launch=ranks)
    assert_crashed_or_apart(p, found)


@pytest.mark.parametrize("fp16", [  # fp16: the strategy's allreduce_gradients, as test_horovod's
    False, pytest.param(True, marks=pytest.mark.long)])  # fp16 test shows; long for time
def test_horovods_keras_synthetic_benchmark_runs_with_one_line_changed(tmp_path, fp16):
    argv = ([program("horovod_keras_synthetic.py", tmp_path, "tfdist")]
            + (["--fp16-allreduce"] * fp16))
    p, found = ranks(argv)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert found[0]["weights"] == found[1]["weights"]
    assert found[0]["loss"][-1] < found[0]["loss"][0]
    assert found[0]["img_sec"] > 0 and "img/sec per CPU" in p.stdout


def test_with_horovods_own_keras_api_the_synthetic_benchmark_fails(tmp_path):
    p, found = ranks([program("horovod_keras_synthetic.py", tmp_path, "horovod")])
    assert_crashed_or_apart(p, found)


CHECKS = r'''
import sys, keras
import tfdist.horovod.keras as hvd
hvd.init()
hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), device_dense="/gpu:0")
hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), device_dense="/gpu:0")  # said once
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=4)
assert opt.gradient_accumulation_steps == 4
for bad in (dict(op=hvd.Sum, gradient_predivide_factor=2.0), dict(op="adasum")):
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **bad)
    except ValueError as e:
        print("ValueError:", e)
try:
    hvd.DistributedOptimizer(opt)  # a second wrap
except ValueError as e:
    print("ValueError:", e)
'''


def test_arguments_without_effect_are_one_line_and_impossible_ones_raise():
    p = run([sys.executable, "-c", CHECKS], timeout=120)
    notes = [line for line in p.stderr.splitlines() if line.startswith("tfdist.horovod.keras:")]
    assert notes == ["tfdist.horovod.keras: DistributedOptimizer(device_dense='/gpu:0') has no "
                     "effect on Keras 3 (tfdist reduces all gradients in one group on their own "
                     "devices)"], p.stderr[-2000:]
    errors = [line for line in p.stdout.splitlines() if line.startswith("ValueError:")]
    assert errors == ["ValueError: gradient_predivide_factor needs op=hvd.Average (as in Horovod)",
                      "ValueError: DistributedOptimizer: only op=hvd.Average or hvd.Sum is "
                      "supported (Adasum is not, on Keras 3)",
                      "ValueError: the optimizer's gradient reduction is already set "
                      "(wrap it once)"]
