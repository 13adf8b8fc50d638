"""The package's structure (tools/structure.py): its layers are its folders, no import cycle
between files, no import from a lower layer to a higher one, at most 10 modules directly in
tfdist/, no function over 100 lines, and docs/design.md's tree is the package's; each check fails
on a copy of the package changed to break it."""
import os
import re
import shutil

from tools import structure


def test_the_package_keeps_its_structure():
    r = structure.report()
    assert r["cycles"] == [], r["cycles"]
    assert r["upward"] == [], "a lower layer imports a higher one: " + repr(r["upward"])
    assert r["functions_over_limit"] == [], r["functions_over_limit"]
    assert r["longest_function"][1] <= structure.MAX_FUNCTION_LINES
    assert len(r["top_modules"]) <= structure.MAX_TOP_MODULES, r["top_modules"]


def test_the_layers_are_the_folders():
    """Every folder of the package and every file directly in it is in exactly one layer, and a
    layer names nothing else (no file inside a folder: a folder's files share its layer)."""
    r = structure.report()
    assert r["unlayered"] == [] and r["layers_without_entry"] == [], r
    named = [e for _, es in structure.LAYERS for e in es]
    assert len(named) == len(set(named))
    assert all(e.count("/") == (1 if e.endswith("/") else 0) for e in named), named


def design_tree():
    """The package tree in docs/design.md (the block after its "Module layout" heading): the
    paths of its folders and modules, from the indentation of each line's first word."""
    with open(os.path.join(structure.ROOT, "docs", "design.md")) as f:
        text = f.read()
    block = text.split("<!-- tree -->")[1]
    paths, stack = [], []
    for line in block.strip().strip("`").strip().splitlines():
        name = line.split()[0] if line.strip() else ""
        if not re.fullmatch(r"[\w]+\.py|[\w]+/", name):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        stack[depth:] = [name]
        paths.append("".join(stack))
    return paths


def test_design_md_shows_the_package_as_it_is():
    """docs/design.md's tree lists every folder and module of the package, and only those
    (regenerate its names with `python tools/structure.py --tree`)."""
    package = ["".join(p) for p in _tree_paths(structure.tree())]
    assert design_tree() == package


def _tree_paths(lines):
    stack = []
    for line in lines:
        depth = (len(line) - len(line.lstrip())) // 2
        stack[depth:] = [line.strip()]
        yield list(stack)


def test_each_check_fails_on_a_package_that_breaks_it(tmp_path):
    """The companion: in a copy of the package, config imports the layout (which imports config:
    a cycle, and a lower layer reaching a higher one), a function gets 101 lines, a new folder
    has no layer, and the top of the package holds 11 modules; design.md's tree then misses a
    module."""
    copy = tmp_path / "tfdist"
    shutil.copytree(os.path.join(structure.ROOT, "tfdist"), copy)
    with open(copy / "config.py", "a") as f:
        f.write("\n\ndef _judge(c, plugin):\n    from tfdist.parallel import layout\n"
                "    return layout.Layout.from_config(c, plugin)\n")
    with open(copy / "errors.py", "a") as f:
        f.write("\n\ndef long():\n" + "    x = 1\n" * 100)
    os.makedirs(copy / "extra")
    (copy / "extra" / "__init__.py").write_text("")
    loose = [f"loose{i}.py" for i in range(11 - len(structure.top_modules(
        structure.files(str(copy)))))]
    for name in loose:
        (copy / name).write_text("")
    r = structure.report(str(copy))
    # (a cycle through both: config -> layout -> config, or through tfdist.parallel.dp)
    assert any({"config.py", "parallel/layout.py"} <= set(c) for c in r["cycles"]), r["cycles"]
    assert ("config.py", "parallel/layout.py") in r["upward"]
    assert ("errors.py:long", 101) in r["functions_over_limit"]
    assert r["unlayered"] == ["extra/"] + loose
    assert len(r["top_modules"]) == 11 > structure.MAX_TOP_MODULES
    package = ["".join(p) for p in _tree_paths(structure.tree(str(copy)))]
    assert design_tree() != package and "tfdist/extra/__init__.py" in package


def test_an_old_import_path_is_one_line_naming_the_new_one():
    """`tfdist.MOVED`: a module that moved when the package took its folders gives one line and
    exit status 2 (a user's program importing it); `from tfdist import zero3` too. The companion:
    a name that never existed is Python's own ModuleNotFoundError, with its traceback."""
    import subprocess
    import sys

    def python(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, cwd=structure.ROOT)

    for code, old, new in (
            ("import tfdist.zero", "tfdist.zero", "tfdist.parallel.zero"),
            ("from tfdist import zero3", "tfdist.zero3", "tfdist.parallel.zero"),
            ("from tfdist.layout import Layout", "tfdist.layout", "tfdist.parallel.layout"),
            ("import tfdist.launch.cli", "tfdist.launch.cli", "tfdist.cli.launch")):
        p = python(code)
        assert p.returncode == 2 and p.stdout == "", (code, p.stderr)
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"tfdist: error: {old} moved to {new}")
        assert lines[0].endswith("in tfdist 0.2; import that instead"), lines
    p = python("import tfdist.no_such_module")
    assert p.returncode == 1 and "ModuleNotFoundError: No module named 'tfdist.no_such_module'" \
        in p.stderr
