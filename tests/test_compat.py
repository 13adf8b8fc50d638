"""tfdist/compat/ is the one place that touches Keras's and TensorFlow's private internals, every
use there is a row of its patch table, and other versions are said and guarded."""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tfdist")
COMPAT = os.path.join(PACKAGE, "compat")
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.tsl", "tensorflow.core")


def sources(root=PACKAGE):
    for d, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    yield path, ast.parse(fh.read())


def _private(name):
    """A private attribute: `_x` (not a dunder), and TF's `__internal__` namespace."""
    return (name.startswith("_") and not name.endswith("__")) or name == "__internal__"


def _own_names(cls):
    """What class `cls` defines itself: its methods and class attributes, and the `self.x` it
    assigns in its methods. Only these may be read as `self._x` (no exemption by name)."""
    own = set()
    for b in cls.body:
        if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(b.name)
        elif isinstance(b, (ast.Assign, ast.AnnAssign)):
            targets = b.targets if isinstance(b, ast.Assign) else [b.target]
            own.update(t.id for t in targets if isinstance(t, ast.Name))
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)) and \
                isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
            own.add(n.attr)
    return own


def private_uses(path, tree):
    """(line, text) of every private use: an import of an upstream private module; an attribute
    `x._name` (or getattr/setattr/hasattr/delattr with a literal "_name"), unless `x` is `self` or
    `cls` in a class that defines `_name` itself, or a module of Python's standard library (whose
    documented API has such names: `os._exit`)."""
    found = []
    stdlib = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
              for a in n.names if a.name in sys.stdlib_module_names}

    def visit(node, own):
        if isinstance(node, ast.ClassDef):
            own = _own_names(node)
        modules = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                   [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found.extend((node.lineno, f"import {m}") for m in modules if m.startswith(PRIVATE_MODULES))
        name = None
        if isinstance(node, ast.Attribute):
            name, target = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name, target = node.args[1].value, node.args[0]
        if name is not None and _private(name):
            mine = isinstance(target, ast.Name) and target.id in ("self", "cls") and name in own
            if not mine and not (isinstance(target, ast.Name) and target.id in stdlib):
                found.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(tree, set())
    return [(os.path.relpath(path, ROOT), line, text) for line, text in found]


def test_private_internals_are_used_only_in_compat():
    outside = [u for p, t in sources() if not p.startswith(COMPAT + os.sep)
               for u in private_uses(p, t)]
    assert outside == [], "move these into tfdist/compat/ (a row of its table):\n" + \
        "\n".join(f"{p}:{line}: {text}" for p, line, text in outside)


def test_every_private_use_in_compat_is_in_a_function_the_table_names():
    from tfdist import compat
    listed = {f for p in compat.PATCHES.values() for f in p.functions}
    unlisted = []
    for path, tree in sources(COMPAT):
        if path.endswith("table.py"):
            continue
        lines = {line for _, line, _ in private_uses(path, tree)}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in listed:
                used = sorted(line for line in lines if node.lineno <= line <= node.end_lineno)
                if used:
                    unlisted.append(f"{os.path.relpath(path, ROOT)}:{node.name} (lines {used})")
    assert unlisted == [], "name these in a row of tfdist/compat/table.py:\n" + "\n".join(unlisted)
    assert any(private_uses(p, t) for p, t in sources(COMPAT)), "the scan finds compat's own"


def test_the_scan_finds_a_private_use_outside_compat():
    """The companion: the scan flags upstream privates, also on `self` where the class does not
    define the name (a Keras subclass reading Keras's private state), and TF's __internal__."""
    tree = ast.parse("import keras\nfrom keras.src import tree\n"
                     "class C(keras.Model):\n"
                     "    def __init__(self):\n        self._mine = 1\n"
                     "    def f(self, optimizer):\n"
                     "        optimizer._all_reduce_sum_gradients = None\n"
                     "        getattr(optimizer, '_learning_rate')\n"
                     "        return self._mine, self._loss_tracker, tf.__internal__\n")
    found = [text for _, _, text in private_uses(os.path.join(PACKAGE, "x.py"), tree)]
    assert found == ["import keras.src", "optimizer._all_reduce_sum_gradients",
                     "getattr(optimizer, '_learning_rate')", "self._loss_tracker",
                     "tf.__internal__"], found


def test_modules_that_need_no_patch_import_nothing_from_compat():
    for path, tree in sources():
        if path.startswith(COMPAT + os.sep):
            continue
        imports = any(isinstance(n, ast.ImportFrom) and n.module == "tfdist"
                      and any(a.name == "compat" for a in n.names) for n in ast.walk(tree))
        uses = any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id == "compat" for n in ast.walk(tree))
        assert imports == uses, f"{path}: imports compat without using it (or the reverse)"


def test_every_row_names_its_targets_issue_and_a_test_that_exists():
    from tfdist import compat
    defined = {n.name for _, t in sources(COMPAT) for n in t.body
               if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name, p in compat.PATCHES.items():
        assert p.issue and p.breaks and p.targets, name
        assert set(p.functions) <= defined, (name, set(p.functions) - defined)
        path, _, func = p.test.partition("::")
        with open(os.path.join(ROOT, path)) as f:
            assert f"def {func.split('[')[0]}(" in f.read(), (name, p.test)


def test_the_fingerprints_are_the_installed_versions_ones():
    """On the tested versions every row's target is the source it was written for (in a fresh
    process: the patches replace some targets once applied)."""
    code = ("from tfdist.compat import table\n"
            "print([n for n, p in table.PATCHES.items()"
            " if table.fingerprint(p.targets) != p.fingerprint])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr[-2000:]


def test_another_version_is_said_in_one_line_and_changed_targets_are_refused(monkeypatch):
    from tfdist.compat import table
    from tfdist.errors import UsageError
    line = table.version_line({"keras": "3.16.0", "tensorflow": "2.21.0"}, ["xspace"])
    assert line.startswith("tfdist: warning: keras 3.16.0 (tfdist is tested with 3.15.1): ")
    assert "xspace" in line and "refused" in line and "\n" not in line
    # a target whose source differs from the table's (a fingerprint of another version):
    monkeypatch.setattr(table, "installed", lambda: {"keras": "3.16.0", "tensorflow": "2.21.0"})
    monkeypatch.setattr(table, "refused", set())
    fake = dict(table.PATCHES)
    fake["xspace"] = table.Patch(**{**table.PATCHES["xspace"].__dict__, "fingerprint": "0" * 12})
    monkeypatch.setattr(table, "PATCHES", fake)
    table._guard()
    assert table.refused == {"xspace"}
    with pytest.raises(UsageError, match="tfdist's patch xspace relies on upstream code that "
                                         "changed in the installed keras 3.16.0"):
        table.using("xspace")
    assert table.using("slurm_tasks_per_node")  # unchanged: applies


def test_the_tested_versions_say_nothing():
    p = subprocess.run([sys.executable, "-c", "import tfdist.compat"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
                       cwd=ROOT)
    assert p.returncode == 0 and "tfdist: warning" not in p.stderr, p.stderr


def test_unknown_patch_names_are_refused():
    from tfdist import compat
    with pytest.raises(ValueError, match="unknown patch"):
        compat.disable("no_such_patch")


def test_one_gradient_reduction_per_optimizer():
    """Optimizer wrapping composes explicitly: a second wrap raises instead of stacking."""
    import keras

    from tfdist import compat
    opt = compat.set_gradient_reduction(keras.optimizers.SGD(), lambda gv: gv)
    with pytest.raises(ValueError, match="already set"):
        compat.set_gradient_reduction(opt)


def test_docs_show_the_table_as_it_is():
    """docs/upstream.md holds `table.markdown()` between its markers (regenerate it with
    `python -c "from tfdist.compat import table; print(table.markdown(), end='')"`)."""
    from tfdist.compat import table
    with open(os.path.join(ROOT, "docs", "upstream.md")) as f:
        text = f.read()
    start = text.index("<!-- the patch table: tfdist.compat.table.markdown() -->\n")
    end = text.index("<!-- end of the patch table -->")
    shown = text[start:end].split("\n", 1)[1]
    assert shown == table.markdown()
