"""The structure of the `tfdist` package, read from its source (nothing is imported): the import
graph between its files (imports inside functions count), its cycles, the imports that reach from
a lower layer to a higher one, files over 400 lines and functions over 80.

    python tools/structure.py            # prints the figures; exit 1 if any rule is broken

The layers, lowest first. A file may import files of its own layer and of the layers below:

    base        errors, lazy, console, progress, buckets, gradients, models/arithmetic
    config      the config schema (the strategy plugins register their options into it)
    runtime     cluster, lock, early, preemption, profiling, optimizers, host, data/, compat/
    models      the GPT, its pipeline and tensor-parallel forms, their layout-free state
    layout      the layout object, ZeRO
    callbacks   backup, log, the strategies' callbacks
    strategies  the plugins and their registry
    step        the training step
    commands    train, sample, prepare, launch/, plan/, cli, the Horovod Keras API, the package

Functions longer than 80 lines are allowed only where they are declarative tables (`TABLES`).
`tests/test_structure.py` runs these checks, and shows each failing on a change that breaks it.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
LAYERS = [
    ("base", ["errors.py", "lazy.py", "console.py", "progress.py", "buckets.py", "gradients.py",
              "models/arithmetic.py"]),
    ("config", ["config.py"]),
    ("runtime", ["cluster.py", "lock.py", "early.py", "preemption.py", "profiling.py",
                 "optimizers.py", "host.py", "data/", "compat/"]),
    ("models", ["models/"]),
    ("layout", ["layout.py", "zero.py", "zero3.py", "zero3_scope.py"]),
    ("callbacks", ["callbacks/"]),
    ("strategies", ["strategies/"]),
    ("step", ["step.py"]),
    ("commands", ["train.py", "sample.py", "prepare.py", "launch/", "plan/", "cli.py",
                  "__main__.py", "__init__.py", "horovod/"]),
]
#: Functions over the limit that are declarative tables, with why.
TABLES = {"config.py:default_config": "the config schema: one line per key, with its comment"}


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
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

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


def layer_of(path):
    """The index in LAYERS of the file's layer (the most specific prefix); None if none names it."""
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if path == p or (p.endswith("/") and path.startswith(p)):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    return None if best is None else best[0]


def upward(edges):
    """[(file, imported file)] where a file imports one of a higher layer, or one of no layer."""
    out = []
    for path, targets in sorted(edges.items()):
        for t in sorted(targets):
            a, b = layer_of(path), layer_of(t)
            if a is None or b is None or b > a:
                out.append((path, t))
    return out


def sizes(sources):
    """([(file, lines)] over MAX_FILE_LINES, [(file:function, lines)] over MAX_FUNCTION_LINES
    that are not TABLES, the longest function as (file:function, lines))."""
    big, long, longest = [], [], ("", 0)
    for path, src in sorted(sources.items()):
        n = len(src.splitlines())
        if n > MAX_FILE_LINES:
            big.append((path, n))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name, length = f"{path}:{node.name}", node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and name not in TABLES:
                    long.append((name, length))
                if name not in TABLES and length > longest[1]:
                    longest = (name, length)
    return big, long, longest


def report(package=os.path.join(ROOT, "tfdist")):
    sources = files(package)
    edges = imports(sources, os.path.basename(package))
    big, long, longest = sizes(sources)
    return {"cycles": cycles(edges), "upward": upward(edges), "files_over_limit": big,
            "functions_over_limit": long, "longest_function": longest}


def main():
    r = report()
    print(f"import cycles: {len(r['cycles'])} {r['cycles'] or ''}")
    print(f"imports from a lower layer to a higher one: {len(r['upward'])} {r['upward'] or ''}")
    print(f"files over {MAX_FILE_LINES} lines: {len(r['files_over_limit'])} "
          f"{r['files_over_limit'] or ''}")
    print(f"functions over {MAX_FUNCTION_LINES} lines (tables aside): "
          f"{len(r['functions_over_limit'])} {r['functions_over_limit'] or ''}")
    print(f"longest function: {r['longest_function'][0]} ({r['longest_function'][1]} lines)")
    broken = r["cycles"] or r["upward"] or r["files_over_limit"] or r["functions_over_limit"]
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
