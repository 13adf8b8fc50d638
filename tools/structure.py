"""The structure of the `tfdist` package, read from its source (nothing is imported): its layers
(the folders), the import graph between its files (imports inside functions count), its cycles,
the imports that reach from a lower layer to a higher one, the modules directly in `tfdist/`, and
the functions over 100 lines.

    python tools/structure.py            # prints the figures; exit 1 if any rule is broken
    python tools/structure.py --tree     # the package's tree (docs/design.md holds it)

The layers, lowest first. Each is folders of the package (or, at the bottom and the top, a few
files directly in it); a file may import files of its own layer and of the layers below:

    base        errors.py, the exception and exit statuses every layer uses
    config      config.py, the config schema (the strategy plugins register their options into it)
    compat      compat/, every patch of Keras's and TensorFlow's internals
    runtime     runtime/, the process: cluster, lock, signals, profiling, console, lazy imports
    data        data/, tokenizers, sources, the token store, the input pipeline
    models      models/ and optimizers.py, the GPT, its split forms, its state, its optimizer
    parallel    parallel/, the layout and each parallel axis: buckets, gradients, ZeRO
    callbacks   callbacks/, backup, log, the strategies' callbacks
    strategies  strategies/, the plugins and their registry
    step        step.py, the training step
    train       train.py, a training run
    commands    cli/ (every command line), launch/, plan/, horovod/, the package and __main__.py

A file is one concept; its size is no reason to split it (or to squeeze it). A function is at
most 100 lines (the config schema is one function per section). Lines are ruff's
(pyproject.toml). `tests/test_structure.py` runs these checks, and shows each failing on a change
that breaks it.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FUNCTION_LINES = 100
MAX_TOP_MODULES = 10  # modules directly in tfdist/ (its __init__.py aside)
LAYERS = [
    ("base", ["errors.py"]),
    ("config", ["config.py"]),
    ("compat", ["compat/"]),
    ("runtime", ["runtime/"]),
    ("data", ["data/"]),
    ("models", ["models/", "optimizers.py"]),
    ("parallel", ["parallel/"]),
    ("callbacks", ["callbacks/"]),
    ("strategies", ["strategies/"]),
    ("step", ["step.py"]),
    ("plan", ["plan/"]),
    ("train", ["train.py"]),
    ("commands", ["cli/", "launch/", "horovod/", "__init__.py", "__main__.py"]),
]


def files(package):
    """{path relative to the package: source} of every .py file in it."""
    out = {}
    for d, _, names in os.walk(package):
        for n in sorted(names):
            if n.endswith(".py"):
                path = os.path.join(d, n)
                with open(path) as f:
                    out[os.path.relpath(path, package)] = f.read()
    return out


def _module_file(module, pkg, sources):
    """tfdist.a.b -> "a/b.py" or "a/b/__init__.py", if that file is in `sources`."""
    parts = module.split(".")
    if parts[0] != pkg:
        return None
    base = os.path.join(*parts[1:]) if len(parts) > 1 else ""
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if candidate.lstrip(os.sep) in sources:
            return candidate.lstrip(os.sep)
    return None


def imports(sources, pkg="tfdist"):
    """{file: {files it imports}} (anywhere in the file; `from pkg.a import b` imports a/b.py if
    it is a module, else a.py)."""
    edges = {path: set() for path in sources}
    for path, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if _module_file(t, pkg, sources)]
                if len(targets) < len(subs):
                    targets.append(node.module)
            for t in targets:
                f = _module_file(t, pkg, sources)
                if f and f != path:
                    edges[path].add(f)
    return edges


def cycles(edges):
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index = {}
    low = {}
    stack = []
    on = set()
    found = []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def entry_of(path):
    """The package entry a file belongs to: its top folder ("cli/"), or the file itself when it
    is directly in the package ("step.py")."""
    head = path.split(os.sep, 1)
    return head[0] + "/" if len(head) > 1 else path


def layer_of(path):
    """The index in LAYERS of the file's layer (the one naming its entry); None if none does."""
    for i, (_, entries) in enumerate(LAYERS):
        if entry_of(path) in entries:
            return i
    return None


def entries(sources):
    """The package's top folders and the files directly in it: what LAYERS must name."""
    return sorted({entry_of(p) for p in sources})


def upward(edges):
    """[(file, imported file)] where a file imports one of a higher layer, or one of no layer."""
    out = []
    for path, targets in sorted(edges.items()):
        for t in sorted(targets):
            a, b = layer_of(path), layer_of(t)
            if a is None or b is None or b > a:
                out.append((path, t))
    return out


def long_functions(sources):
    """([(file:function, lines)] over MAX_FUNCTION_LINES, the longest function as
    (file:function, lines))."""
    long = []
    longest = ("", 0)
    for path, src in sorted(sources.items()):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{path}:{node.name}"
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append((name, length))
                if length > longest[1]:
                    longest = (name, length)
    return long, longest


def top_modules(sources):
    """The modules directly in the package (its __init__.py aside)."""
    return sorted(p for p in sources if os.sep not in p and p != "__init__.py")


def tree(package=None):
    """The package's folders and modules, one per line, indented by depth (docs/design.md);
    `package` defaults to tfdist/."""
    if package is None:
        package = os.path.join(ROOT, "tfdist")
    lines = [os.path.basename(package) + "/"]
    for d, dirs, names in os.walk(package):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        depth = os.path.relpath(d, package).count(os.sep) + (d != package)
        if d != package:
            lines.append("  " * depth + os.path.basename(d) + "/")
        modules = sorted(n for n in names if n.endswith(".py"))
        # (files before folders, as os.walk lists a folder's files first)
        lines += ["  " * (depth + 1) + n for n in modules]
    return lines


def report(package=None):
    if package is None:
        package = os.path.join(ROOT, "tfdist")
    sources = files(package)
    edges = imports(sources, os.path.basename(package))
    long, longest = long_functions(sources)
    named = sorted(e for _, es in LAYERS for e in es)
    return {"cycles": cycles(edges), "upward": upward(edges), "functions_over_limit": long,
            "longest_function": longest, "top_modules": top_modules(sources),
            "unlayered": sorted(set(entries(sources)) - set(named)),
            "layers_without_entry": sorted(set(named) - set(entries(sources)))}


def main():
    if sys.argv[1:] == ["--tree"]:
        print("\n".join(tree()))
        return
    r = report()
    print(f"import cycles: {len(r['cycles'])} {r['cycles'] or ''}")
    print(f"imports from a lower layer to a higher one: {len(r['upward'])} {r['upward'] or ''}")
    print(f"modules directly in tfdist/: {len(r['top_modules'])} (at most {MAX_TOP_MODULES}) "
          f"{' '.join(r['top_modules'])}")
    print(f"folders and files no layer names: {r['unlayered'] or 'none'}; layer entries that "
          f"are not in the package: {r['layers_without_entry'] or 'none'}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: "
          f"{len(r['functions_over_limit'])} {r['functions_over_limit'] or ''}")
    print(f"longest function: {r['longest_function'][0]} ({r['longest_function'][1]} lines)")
    broken = (r["cycles"] or r["upward"] or r["functions_over_limit"] or r["unlayered"]
              or r["layers_without_entry"] or len(r["top_modules"]) > MAX_TOP_MODULES)
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
