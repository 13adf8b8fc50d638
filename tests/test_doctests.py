"""Every module docstring's example is a doctest, and runs and gives what it shows.

The examples run in one fresh process (`python tests/test_doctests.py MODULE...`), split into two
logical CPUs before TensorFlow starts, as a user's program would be: the pytest process has
initialised TensorFlow long before, and the mirrored and pipeline examples need two devices.
A module whose example cannot run on this machine (Horovod, parameter server, TPU) says
"Usage (not run as a doctest: why)" instead of "Example".
"""
import ast
import doctest
import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_docstrings():
    found = {}
    for d, _, files in os.walk(os.path.join(ROOT, "tfdist")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    doc = ast.get_docstring(ast.parse(fh.read()), clean=False) or ""
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = doc
    return found


def modules_with_examples():
    return sorted(name for name, doc in module_docstrings().items() if ">>>" in doc)


def test_every_module_example_is_a_doctest():
    docs = module_docstrings()
    prose = [name for name, doc in docs.items() if "Example" in doc and ">>>" not in doc]
    assert not prose, f"examples that are not doctests (write them with >>>, or say Usage): {prose}"
    assert {"tfdist", "tfdist.compat", "tfdist.models.gpt", "tfdist.strategies.base",
            "tfdist.data.store", "tfdist.callbacks"} <= set(modules_with_examples())


def test_the_scan_sees_a_prose_example(monkeypatch):
    """The companion: an example without >>> is caught."""
    docs = {"tfdist.x": "Example:\n\n    import tfdist\n"}
    monkeypatch.setattr(sys.modules[__name__], "module_docstrings", lambda: docs)
    try:
        test_every_module_example_is_a_doctest()
    except AssertionError as e:
        assert "tfdist.x" in str(e)
    else:
        raise AssertionError("the scan missed a prose example")


def test_module_examples_run():
    from tests.helpers import run
    names = modules_with_examples()
    p = run([sys.executable, os.path.abspath(__file__), *names], timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    for name in names:  # each module's examples ran: none was skipped by a bad import
        assert f"{name}: ok" in p.stdout, p.stdout


def main(names):
    from tfdist.parallel.layout import configure_logical_cpus
    configure_logical_cpus(2)
    failed = 0
    for name in names:
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        ok = result.attempted > 0 and result.failed == 0
        print(f"{name}: {'ok' if ok else 'FAILED'} ({result.attempted} examples, "
              f"{result.failed} failed)", flush=True)
        failed += not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1:])
