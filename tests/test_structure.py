"""The package's structure (tools/structure.py): no import cycle between files, no import from a
lower layer to a higher one, no file over 400 lines, no function over 80 but declarative tables;
and each check fails on a copy of the package changed to break it."""
import os
import shutil

from tools import structure


def test_the_package_keeps_its_structure():
    r = structure.report()
    assert r["cycles"] == [], r["cycles"]
    assert r["upward"] == [], "a lower layer imports a higher one: " + repr(r["upward"])
    assert r["files_over_limit"] == [], r["files_over_limit"]
    assert r["functions_over_limit"] == [], r["functions_over_limit"]
    assert r["longest_function"][1] <= structure.MAX_FUNCTION_LINES


def test_every_file_has_a_layer():
    sources = structure.files(os.path.join(structure.ROOT, "tfdist"))
    assert [p for p in sources if structure.layer_of(p) is None] == []


def test_each_check_fails_on_a_package_that_breaks_it(tmp_path):
    """The companion: in a copy of the package, config imports the layout (which imports config:
    a cycle, and a lower layer reaching a higher one), and a file gets 401 lines with a function
    of 81."""
    copy = tmp_path / "tfdist"
    shutil.copytree(os.path.join(structure.ROOT, "tfdist"), copy)
    with open(copy / "config.py", "a") as f:
        f.write("\n\ndef _judge(c, plugin):\n    from tfdist import layout\n"
                "    return layout.Layout.from_config(c, plugin)\n")
    with open(copy / "lazy.py", "a") as f:
        f.write("\n\ndef long():\n" + "    x = 1\n" * 80 + "\n" * (401 - 84))
    r = structure.report(str(copy))
    assert ["config.py", "layout.py"] in r["cycles"], r["cycles"]
    assert ("config.py", "layout.py") in r["upward"]
    assert ("lazy.py", len(open(copy / "lazy.py").read().splitlines())) in r["files_over_limit"]
    assert ("lazy.py:long", 81) in r["functions_over_limit"]
