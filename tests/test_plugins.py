"""A strategy plugin owns its strategy: nothing outside tfdist/strategies/ compares strategy
names, and a new plugin is its own file plus one registry entry."""
import ast
import os
import textwrap

import pytest

from tests.helpers import ROOT, tfdist


def run_cli(args, env=None):
    return tfdist(*args, env=env, check=False, timeout=600)

PACKAGE = os.path.join(ROOT, "tfdist")
STRATEGY_NAMES = {"single", "mirrored", "multi_worker_mirrored", "parameter_server", "horovod",
                  "tpu"}


def name_comparisons(tree):
    """Comparisons (==, !=, in) against a strategy name, and startswith("tpu")-style checks."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            for c in [n.left, *n.comparators]:
                if isinstance(c, ast.Constant) and c.value in STRATEGY_NAMES:
                    found.append((n.lineno, ast.unparse(n)))
                if isinstance(c, (ast.Tuple, ast.List, ast.Set)) and any(
                        isinstance(e, ast.Constant) and e.value in STRATEGY_NAMES for e in c.elts):
                    found.append((n.lineno, ast.unparse(n)))
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "startswith" and n.args and isinstance(n.args[0], ast.Constant)
                and n.args[0].value in STRATEGY_NAMES):
            found.append((n.lineno, ast.unparse(n)))
    return found


def test_no_code_outside_the_plugins_compares_strategy_names():
    found = []
    for d, _, files in os.walk(PACKAGE):
        if os.path.join(PACKAGE, "strategies") in d:
            continue
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    found += [(os.path.relpath(path, ROOT), *x)
                              for x in name_comparisons(ast.parse(fh.read()))]
    assert found == [], found


def test_the_scan_finds_a_name_comparison():
    tree = ast.parse('if c.strategy.name == "mirrored": pass\n'
                     'if name in ("horovod", "x"): pass\n'
                     'if device.name.startswith("tpu"): pass\n')
    assert [line for line, _ in name_comparisons(tree)] == [1, 2, 3]


TOY = '''
"""`toy`: one device, with an option and a recommendation of its own (a test's plugin)."""
from tfdist.strategies.base import Launch
from tfdist.strategies.single import SingleDevice


class Toy(SingleDevice):
    name = "toy"
    options = {"toy_level": (3, lambda v: isinstance(v, int) and 1 <= v <= 9,
                             "an integer in [1, 9]")}
    recommended = {"train.log_every_steps": 2}
    launch = Launch()

    def __init__(self, toy_level=3, **options):
        super().__init__(**options)
        self.level = toy_level

    def describe(self):
        return f"toy: level {self.level}"
'''


@pytest.fixture
def toy_env(tmp_path):
    """The plugin's file, and its registry entry: nothing else is touched."""
    (tmp_path / "toy_strategy.py").write_text(textwrap.dedent(TOY))
    return {"TFDIST_PLUGINS": "toy=toy_strategy:Toy",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_an_eighth_strategy_is_its_file_and_a_registry_entry(tmp_path, toy_env, data_dir):
    flags = ["--config=configs/gpt_nano.py", f"--config.data.data_dir={data_dir}",
             "--config.train.steps=4", "--config.train.steps_per_epoch=2",
             "--config.train.warmup_steps=1"]
    p = run_cli(["train", *flags, "--strategy=toy", "--config.strategy.toy_level=7",
                 f"--workdir={tmp_path / 'run'}"], env=toy_env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "tfdist: toy: level 7" in p.stdout
    assert "tfdist: toy: train.log_every_steps=2 (recommended" in p.stdout
    assert "done: 4 steps run" in p.stdout

    bad = run_cli(["train", *flags, "--strategy=toy", "--config.strategy.toy_level=12",
                   f"--workdir={tmp_path / 'bad'}"], env=toy_env)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == ["tfdist: error: config key 'strategy.toy_level' must be an "
                                       "integer in [1, 9] for strategy toy, got 12"]

    launched = run_cli(["launch", "--strategy=toy", "--workers=1", "--max_restarts=0", "--",
                        *flags, f"--workdir={tmp_path / 'launched'}"], env=toy_env)
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    assert "[w0] tfdist: toy: level 3" in launched.stdout


@pytest.mark.slow
def test_launch_refuses_a_strategy_without_a_launch_spec():
    p = run_cli(["launch", "--strategy=mirrored", "--", "--config=configs/gpt_nano.py"])
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        "tfdist: error: tfdist launch cannot start strategy 'mirrored'; "
        "it starts: horovod, multi_worker_mirrored, parameter_server"]
