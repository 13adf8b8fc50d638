"""tfdist/compat.py is the one place that touches Keras's and TensorFlow's private internals."""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tfdist")
COMPAT = os.path.join(PACKAGE, "compat.py")
PRIVATE_MODULES = ("keras.src", "tensorflow.python")


def sources():
    for d, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    yield path, ast.parse(fh.read())


def own_attributes(trees):
    """Names tfdist itself defines on its own classes and objects (methods, class attributes,
    `self.x = ...`): a `self._x` among them is tfdist's own private state, not upstream's."""
    own = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                for b in n.body:
                    if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        own.add(b.name)
                    elif isinstance(b, ast.Assign):
                        own.update(t.id for t in b.targets if isinstance(t, ast.Name))
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                own.add(n.attr)
    return own


def private_uses(path, tree, own):
    """`obj._name` on anything but tfdist's own objects and modules (and os/sys), and imports
    of keras.src / tensorflow.python."""
    tfdist_names = {a.asname or a.name.split(".")[-1] for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tfdist")
                    for a in n.names}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            v = n.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls") and n.attr in own:
                continue
            if isinstance(v, ast.Name) and v.id in {"os", "sys"} | tfdist_names:
                continue
            found.append(f"{os.path.relpath(path, ROOT)}:{n.lineno}: {ast.unparse(n)}")
        modules = ([n.module] if isinstance(n, ast.ImportFrom) and n.module else
                   [a.name for a in n.names] if isinstance(n, ast.Import) else [])
        for m in modules:
            if m.startswith(PRIVATE_MODULES):
                found.append(f"{os.path.relpath(path, ROOT)}:{n.lineno}: import {m}")
    return found


def test_private_internals_are_used_only_in_compat():
    trees = dict(sources())
    own = own_attributes(trees.values())
    outside = [u for p, t in trees.items() if p != COMPAT for u in private_uses(p, t, own)]
    assert outside == [], "move these into tfdist/compat.py:\n" + "\n".join(outside)
    assert private_uses(COMPAT, trees[COMPAT], own), "the scan finds compat's own uses"


def test_the_scan_finds_a_private_use_outside_compat():
    """The companion: the same scan flags upstream privates in any other module."""
    tree = ast.parse("import keras\nfrom keras.src import tree\n"
                     "def f(optimizer, model):\n"
                     "    optimizer._all_reduce_sum_gradients = None\n"
                     "    return model._loss_tracker\n")
    found = private_uses(os.path.join(PACKAGE, "x.py"), tree, own_attributes([tree]))
    assert [f.split(": ", 1)[1] for f in found] == [
        "import keras.src", "optimizer._all_reduce_sum_gradients", "model._loss_tracker"]


def test_modules_that_need_no_patch_import_nothing_from_compat():
    for path, tree in sources():
        if path == COMPAT:
            continue
        imports = any(isinstance(n, ast.ImportFrom) and n.module == "tfdist"
                      and any(a.name == "compat" for a in n.names) for n in ast.walk(tree))
        uses = any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id == "compat" for n in ast.walk(tree))
        assert imports == uses, f"{path}: imports compat without using it (or the reverse)"


def test_every_patch_names_its_issue_and_a_test_that_exists():
    from tfdist import compat
    for name, (issue, what, test) in compat.PATCHES.items():
        assert issue and what, name
        path, _, func = test.partition("::")
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        assert f"def {func.split('[')[0]}(" in text, (name, test)


def test_a_version_other_than_the_pinned_one_is_named():
    from tfdist import compat
    line = compat.version_warning({"keras": "3.16.0", "tensorflow": "2.21.0"})
    assert "keras 3.16.0 (written for 3.15.1)" in line and "tensorflow" not in line.split(":")[1]
    assert compat.version_warning(dict(compat.PINNED)) is None
    # the installed versions are the pinned ones: importing compat says nothing
    p = subprocess.run([sys.executable, "-c", "import tfdist.compat"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert p.returncode == 0 and "tfdist: warning" not in p.stderr


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
