"""This host's step, measured here (`tfdist train --probe`, tfdist/plan/probe.py): what `tfdist
train` recommends comes from this host's probe of the model's own step, never another
machine's; without one it says so and how to get one."""
import json
import re

import pytest

from tests.helpers import load_config, tfdist
from tfdist import config
from tfdist.plan import probe
from tfdist.runtime import cpu
from tfdist.runtime.host import this_cpu


def train(tmp_path, data_dir, name, *extra):
    p = tfdist("train", "--config=configs/gpt_nano.py", f"--workdir={tmp_path / name}",
               f"--config.data.data_dir={data_dir}", "--config.train.steps=4",
               "--config.train.steps_per_epoch=2", "--config.train.warmup_steps=1",
               "--config.train.eval_steps=1", "--config.backup.enabled=False", *extra,
               env={"XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=300)
    return p.stdout + p.stderr


def cache_file(tmp_path):
    (path,) = (tmp_path / "cache" / "tfdist").glob("step-*.json")
    return path


@pytest.mark.slow
def test_recommendations_are_this_hosts_probe_or_say_not_measured(tmp_path, data_dir):
    """No probe: "not measured here" and how to measure, no recommendation. `--probe`: the step
    timed here, cached for this CPU and model. The lines print the cache file's values (set to
    known ones: bfloat16 2.00x, XLA 1.25x); a cache file written for another CPU model is not
    used ("not measured here" again)."""
    out = train(tmp_path, data_dir, "none")
    assert "not measured here" in out and "--probe" in out and "recommended here" not in out
    out = train(tmp_path, data_dir, "probed", "--probe")
    path = cache_file(tmp_path)
    saved = json.loads(path.read_text())
    assert [saved["cpu"], saved["cores"]] == list(this_cpu())
    assert saved["seconds"]["float32"] > 0 and saved["seconds"]["xla"] > 0
    assert "not measured here" not in out
    for ratio in re.findall(r"ran (\d+\.\d\d)x faster", out):  # whatever it found, from the file
        s = saved["seconds"]
        assert float(ratio) in {round(s["float32"] / s[v], 2) for v in ("xla", "bfloat16")
                                if s[v]}, (ratio, s)
    saved["seconds"] = {"float32": 1.0, "xla": 0.8, "bfloat16": 0.5}
    path.write_text(json.dumps(saved))
    out = train(tmp_path, data_dir, "known")
    lines = [line for line in out.splitlines() if "recommended here" in line]
    want = ([] if cpu.bf16_blocked() else ["2.00x faster in bfloat16"]) + ["1.25x faster in "
                                                                          "float32 with XLA"]
    assert len(lines) == len(want) and all(w in line for w, line in zip(want, lines)), lines
    assert all(str(path) in line for line in lines)
    # another CPU's file: train's two calls (here in this process; the first run above showed
    # what train says when they find nothing)
    c = config.validate(load_config("configs/gpt_nano.py"))  # (train's: its defaults resolved)
    assert probe.cached_steps(c, cache=str(path.parent))["path"] == str(path)  # (this CPU's)
    saved["cpu"] = "Another CPU"
    path.write_text(json.dumps(saved))
    probed = probe.cached_steps(c, cache=str(path.parent))
    assert probed is None and cpu.recommendations(c, probed, device="cpu") == []
    assert "not measured here" in cpu.not_measured(c, "cpu")
