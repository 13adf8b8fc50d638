"""The TPU plugin without a TPU: one clear line and exit 2, without waiting for a timeout that is
not the cause, for every way of not finding one (no TPU system, a closed port, an address that
accepts and never answers: there the configured timeout ends it); its Python paths
with a fake resolver; the TPU defaults; and no file access that bypasses tf.io.gfile in the
paths that checkpoints, logs and data use (so gs:// works)."""
import ast
import json
import os
import socket
import sys

import pytest

from tests.helpers import (
    ROOT,
    assert_usage_error,
    first_fast,
    free_port,
    one_error_line,
    run,
    tfdist,
)
from tfdist import config as config_lib

# No TPU hardware here: everything that needs one is marked so.
needs_tpu = pytest.mark.skip(reason="needs Cloud TPU hardware and the tensorflow-tpu package; "
                                    "this machine has neither")


# The hang guard of every `tfdist train --strategy=tpu` here. It is shorter than the default
# tpu_timeout: a run that ends under it did not wait for that timeout.
GUARD = 60


def train_tpu(tmp_path, *flags):
    """`tfdist train --strategy=tpu`; it must end by itself under GUARD seconds."""
    return tfdist("train", "--config=configs/gpt_nano.py", f"--workdir={tmp_path}",
                  "--strategy=tpu", *flags, check=False, timeout=GUARD)


def test_the_hang_guard_is_shorter_than_the_default_timeout():
    assert GUARD < config_lib.default_config().strategy.tpu_timeout


def test_no_tpu_here_is_one_line_without_waiting_for_the_timeout(tmp_path):
    p = train_tpu(tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    line = one_error_line(p)
    assert line.startswith("tfdist: error: no TPU found")  # TF's refusal, not "reached within"
    assert "within" not in line
    assert "--config.strategy.tpu=local" in line and "tpu_zone" in line  # how to point at one
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_a_closed_port_is_refused_at_once_in_one_line(tmp_path):
    from tfdist.strategies.tpu import REACH_TIMEOUT
    port = free_port()  # nothing listens there
    p = train_tpu(tmp_path, f"--config.strategy.tpu=grpc://127.0.0.1:{port}")
    assert p.returncode == 2, p.stderr[-2000:]
    # refused, not timed out: the reachability check's own timeout did not run out either
    assert (f"no TPU reachable at grpc://127.0.0.1:{port} (Connection refused within "
            f"{REACH_TIMEOUT:g} s)") in one_error_line(p)


@pytest.mark.slow
def test_an_address_that_never_answers_hits_the_timeout(tmp_path):
    """A listener that accepts TCP and never speaks: TF's connect would wait forever. The run is
    contacted there, and ends by the configured timeout (its message names it)."""
    timeout = 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        p = train_tpu(tmp_path, f"--config.strategy.tpu=grpc://127.0.0.1:{port}",
                      f"--config.strategy.tpu_timeout={timeout}")
        s.settimeout(0)
        s.accept()[0].close()  # the run did connect here (a queued connection: no BlockingIOError)
    assert p.returncode == 2, p.stderr[-2000:]
    assert (f"no TPU reached within {timeout:g} s (config.strategy.tpu_timeout)"
            in one_error_line(p))


@pytest.mark.parametrize("flag,needle", first_fast([
    ("--config.strategy.tpu_timeout=0", "strategy.tpu_timeout"),
    ("--config.strategy.tpu= ", "strategy.tpu"),
    ("--config.train.steps_per_execution=3", "must divide train.steps_per_epoch"),
    ("--config.pipeline.stages=2", "strategy tpu cannot run a pipeline"),  # supports_pipeline
]))
def test_bad_tpu_config_is_one_line(tmp_path, flag, needle):
    assert_usage_error(train_tpu(tmp_path, flag), needle)


def test_fake_resolver_builds_the_strategy_with_tpu_defaults():
    from tfdist.strategies.tpu import RECOMMENDED
    cores, per_epoch, batch, block = 8, 100, 32, 64
    code = f"""
import json, sys
sys.path.insert(0, {ROOT!r})
from tests.support.tpu_fake import FakeResolver
import tfdist.strategies
from tfdist import config as config_lib
from tfdist.data import store
from tfdist.data.pipeline import Windows
import tempfile
from tfdist.train import _apply_recommended
import numpy as np, tensorflow as tf
s = tfdist.strategies.get("tpu", resolver=FakeResolver(cores={cores}))
c = config_lib.default_config(); c.train.steps_per_epoch = {per_epoch}
said = _apply_recommended(c, s)
mine = config_lib.default_config(); mine.train.precision = "float32_explicit"
said += _apply_recommended(mine, s)
tokens = store.from_arrays(tempfile.mkdtemp(), train=np.arange(10000) % 256,
                           val=np.arange(500) % 256)
w = Windows(tokens.split("train"), {block}, {batch}, seed=0)
ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                 num_replicas_in_sync=s.num_replicas)
spec = w.dataset_fn(0, 4)(ctx).element_spec
print("FAKE " + json.dumps({{"replicas": s.num_replicas, "describe": s.describe(),
    "tf_strategy": type(s.tf_strategy).__name__, "precision": c.train.precision,
    "spe": c.train.steps_per_execution, "kept": mine.train.precision, "said": said,
    "shapes": [list(x.shape) for x in spec], "jit": s.supports_jit_compile}}))
"""
    p = run([sys.executable, "-c", code], timeout=120)
    r = json.loads([x for x in p.stdout.splitlines() if x.startswith("FAKE ")][-1][5:])
    assert r["tf_strategy"].startswith("TPUStrategy") and r["replicas"] == cores
    assert r["describe"] == f"tpu: {cores} TPU core(s) on 1 host(s)"
    assert r["precision"] == RECOMMENDED["train.precision"] and r["kept"] == "float32_explicit"
    # the largest divisor of steps_per_epoch up to the recommended steps_per_execution
    spe = max(d for d in range(1, RECOMMENDED["train.steps_per_execution"] + 1)
              if per_epoch % d == 0)
    assert r["spe"] == spe and spe > 1
    assert any(f"steps_per_execution={spe}" in s for s in r["said"])
    assert r["shapes"] == [[batch // cores, block]] * 2  # static: per replica, drop_remainder
    assert r["jit"] is True


@needs_tpu
def test_gpt_trains_on_a_real_tpu():
    """Run on a TPU VM: `tfdist train --config=configs/gpt_mini.py --strategy=tpu`."""


# -- every file access in the checkpoint, log and data paths goes through tf.io.gfile ----------
SCANNED = ["tfdist/train.py", "tfdist/cli/prepare.py", "tfdist/callbacks", "tfdist/cli/sample.py",
           "tfdist/data", "tfdist/models", "tfdist/parallel/zero/shards.py"]
FORBIDDEN = {"open", "os.open", "os.makedirs", "os.mkdir", "os.remove", "os.unlink", "os.rename",
             "os.replace", "os.listdir", "os.walk", "os.scandir", "os.path.exists",
             "os.path.isfile", "os.path.isdir", "os.path.getsize", "os.stat", "shutil.rmtree",
             "shutil.copy", "shutil.copyfile", "shutil.move", "np.save", "np.load", "np.savez",
             "pathlib.Path", "Path"}
# Local by nature, each with its reason:
ALLOWED = {
    ("tfdist/data/sources.py", "os.walk"):
        "the running Python's own standard library (default corpus)",
    ("tfdist/train.py", "open"): "/proc/self/status: this process's peak memory (VmHWM)",
    ("tfdist/data/build.py", "os.makedirs"): "the prepare lock, taken only for local stores",
    ("tfdist/data/build.py", "os.open"):
        "the prepare lock (flock of the directory), local stores only",
}


def _calls(path):
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            parts = []
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                yield ".".join([f.id] + parts[::-1]), node.lineno


def test_checkpoint_log_and_data_paths_use_gfile_only():
    files = []
    for entry in SCANNED:
        full = os.path.join(ROOT, entry)
        if os.path.isdir(full):
            files += [os.path.join(entry, f) for f in sorted(os.listdir(full)) if f.endswith(".py")]
        else:
            files.append(entry)
    assert len(files) >= 8
    found = [(f, name, line) for f in files for name, line in _calls(f)
             if name in FORBIDDEN and (f, name) not in ALLOWED]
    assert not found, f"file access bypassing tf.io.gfile (breaks gs://): {found}"
    # and the scan does see such calls where they are (the allowed ones):
    assert {(f, n) for f in files for n, _ in _calls(f) if n in FORBIDDEN} == set(ALLOWED)


def test_tpu_vm_script_issues_the_gcloud_commands(tmp_path):
    """launchers/tpu/tpu_vm.sh with a stand-in gcloud: create, install and train on every worker
    (--worker=all) with the same training flags as locally, delete."""
    log = tmp_path / "gcloud.log"
    env = {"TPU_NAME": "t1", "ZONE": "us-central2-b", "PROJECT": "p", "GCLOUD_LOG": str(log),
           "GCLOUD": os.path.join(ROOT, "tests", "support", "fake_gcloud", "gcloud")}
    script = os.path.join(ROOT, "launchers", "tpu", "tpu_vm.sh")
    for args in (["create"], ["install"],
                 ["train", "--", "--config=configs/gpt_mini.py", "--workdir=gs://b/runs/x"],
                 ["delete"]):
        run(["bash", script, *args], env=env, timeout=30)
    calls = log.read_text().splitlines()
    assert len(calls) == 4
    assert calls[0].startswith("compute tpus tpu-vm create t1 --accelerator-type=v4-8")
    assert "--zone=us-central2-b --project=p" in calls[0]
    assert "--worker=all" in calls[1] and "tensorflow-tpu==2.20.0" in calls[1]
    assert "--worker=all" in calls[2]
    assert ("tfdist train --strategy=tpu --config.strategy.tpu=local "
            "--config=configs/gpt_mini.py --workdir=gs://b/runs/x") in calls[2].replace("\\", "")
    assert calls[3].startswith("compute tpus tpu-vm delete t1")
    p = run(["bash", script, "bogus"], env=env, check=False)
    assert p.returncode == 2 and "usage" in p.stderr
    reqs = run([sys.executable, os.path.join(ROOT, "launchers", "tpu", "requirements.py")]).stdout
    assert "keras==3.15.1" in reqs and "tensorflow-cpu" not in reqs
