"""The `>>>` examples in tfdist's module docstrings run, and give what they show."""
import doctest
import importlib
import os

import pytest

from tests.helpers import ROOT


def modules_with_examples():
    found = []
    for d, _, files in os.walk(os.path.join(ROOT, "tfdist")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    if ">>>" in fh.read():
                        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                        found.append(rel[:-len(".__init__")] if rel.endswith(".__init__") else rel)
    return sorted(found)


def test_there_are_examples_to_run():
    assert {"tfdist.compat", "tfdist.models.arithmetic"} <= set(modules_with_examples())


@pytest.mark.parametrize("name", modules_with_examples())
def test_module_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
