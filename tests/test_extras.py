"""Set-up by purpose (README, Set-up): a command that needs an extra tfdist does not install by
default says which, in one line, and exits 2, in an environment without it. The environment is
this venv with the extra's packages made absent: a `sitecustomize` that fails their import as an
absent package's (what `make demo`'s venv, which holds none of them, does; measured there too:
docs/testing.md)."""
import os
import sys

import pytest

from tests.helpers import ROOT, run, tfdist


def without(tmp_path, *packages):
    """The environment of a process in which `packages` cannot be imported."""
    d = tmp_path / "without"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(
        "import sys\n"
        f"ABSENT = {packages!r}\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ABSENT:\n"
        "            raise ModuleNotFoundError(f\"No module named '{name}'\", name=name)\n"
        "sys.meta_path.insert(0, Absent())\n")
    return {"PYTHONPATH": str(d)}


def one_line(p):
    lines = [line for line in p.stderr.strip().splitlines() if "error" in line]
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr[-2000:]
    return lines[0]


def test_the_sitecustomize_makes_a_package_absent(tmp_path):
    """The companion: the same check passes with the package there, fails without it."""
    code = "import importlib.util, sys; import ray; print('present')"
    assert "present" in run([sys.executable, "-c", code], timeout=120, fresh=True).stdout
    p = run([sys.executable, "-c", code], env=without(tmp_path, "ray"), timeout=120,
            check=False, fresh=True)
    assert p.returncode != 0 and "No module named 'ray'" in p.stderr


def test_ray_engine_without_the_ray_extra(tmp_path, data_dir):
    p = tfdist("launch", "--engine=ray", "--workers=2", "--", "--config=configs/gpt_nano.py",
               f"--workdir={tmp_path / 'run'}", f"--config.data.data_dir={data_dir}",
               env=without(tmp_path, "ray"), check=False, timeout=300, fresh=True)
    assert "pip install 'tfdist[ray]'" in one_line(p)
    assert not os.path.exists(tmp_path / "run" / "backup")


@pytest.mark.slow
def test_horovod_without_its_build(tmp_path, data_dir):
    p = tfdist("train", "--config=configs/gpt_nano.py", "--strategy=horovod",
               f"--workdir={tmp_path / 'run'}", f"--config.data.data_dir={data_dir}",
               env=without(tmp_path, "horovod"), check=False, timeout=300, fresh=True)
    line = one_line(p)
    assert "strategy horovod needs Horovod" in line and "`make horovod`" in line
    assert "horovod extra" in line


def test_the_peer_benchmark_without_torch(tmp_path):
    p = run([sys.executable, os.path.join(ROOT, "tools", "bench", "peer.py"),
             f"--peer_python={sys.executable}", f"--out={tmp_path / 'peer.json'}"],
            env=without(tmp_path, "torch"), check=False, timeout=300, fresh=True)
    assert "the `hf` extra" in one_line(p)
    assert not os.path.exists(tmp_path / "peer.json")
