"""Counts the fresh imports of TensorFlow a command causes: every Python process of the venv that
imports `tensorflow` itself (a fork of a process that had imported it does not), by what the
process was.

    python tools/count_tf_imports.py -- make test          # the suite's count
    python tools/count_tf_imports.py -- .venv/bin/tfdist launch --workers 2 -- --config=...

How: while the command runs, a `.pth` file in the venv's site-packages (`tfdist_count_imports
.pth`, removed at the end) adds an audit hook (`sys.addaudithook`) to every Python process that
starts with `TFDIST_COUNT_IMPORTS` set; the first `import tensorflow` of a process appends its pid
and command line to that file. The variable is one the tests pass on unchanged, so forks of the
tests' and tfdist's warm agents stay forks (TF_*, PYTHON* and LD_* would make the
tests start fresh processes instead). Prints a table by kind of process and writes
`--out` (JSON) if given.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import sysconfig
import tempfile

HOOK = """import os, sys
if os.environ.get("TFDIST_COUNT_IMPORTS") and not hasattr(sys, "_tfdist_counting"):
    sys._tfdist_counting = True
    def _tfdist_count(event, args, _done=[]):
        if event == "import" and args[0] == "tensorflow" and not _done:
            _done.append(1)
            with open(os.environ["TFDIST_COUNT_IMPORTS"], "a") as f:
                argv = " ".join(sys.orig_argv).replace("\\n", " ")
                f.write(f"{os.getpid()} {argv[:400]}\\n")
    sys.addaudithook(_tfdist_count)
"""
PTH = "tfdist_count_imports.pth"

#: (kind, a test on the command line) in order; the first that matches names the process.
KINDS = (
    ("tfdist's warm agents", lambda a: "tfdist.launch.agent" in a),
    ("horovodrun's launcher", lambda a: "horovodrun" in a.split(" -np ")[0]),
    ("multiprocessing children", lambda a: "multiprocessing" in a),
    ("Ray workers", lambda a: "ray/_private/workers" in a),
    ("the tests' fork server (before the agents)", lambda a: "forkserver.py" in a),
    ("tfdist launch (the launcher)", lambda a: "-m tfdist launch" in a),
    ("the fault driver (workers, ranks, runs)", lambda a: "faulty_train.py" in a),
    ("tfdist train (workers, ranks, runs)", lambda a: "-m tfdist train" in a),
    ("other tfdist commands", lambda a: "-m tfdist" in a or "bin/tfdist " in f"{a} "),
    ("user programs (examples, tests/support)", lambda a: "launchers/" in a or "support/" in a),
    ("python -c (tests)", lambda a: " -c " in f" {a} "),
    ("other", lambda a: True),
)


def kind(argv):
    return next(name for name, test in KINDS if test(argv))


def records(lines):
    """The recorded processes' command lines, one per process ("pid argv" lines)."""
    return [line.split(" ", 1)[1] for line in lines
            if line.split(" ", 1)[0].isdigit() and " " in line]


def count(lines):
    """{kind: count} of the recorded lines ("pid argv")."""
    return dict(collections.Counter(kind(argv) for argv in records(lines)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the counts as JSON here")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command after --")
    site = sysconfig.get_paths()["purelib"]
    venv_site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".venv", "lib",
                             f"python{sys.version_info.major}.{sys.version_info.minor}",
                             "site-packages")
    site = venv_site if os.path.isdir(venv_site) else site
    pth = os.path.join(site, PTH)
    record = tempfile.NamedTemporaryFile(prefix="tfdist-imports-", suffix=".txt", delete=False)
    record.close()
    with open(pth, "w") as f:
        f.write("import os, sys; exec(" + repr(HOOK) + ")\n")
    try:
        code = subprocess.call(command, env={**os.environ, "TFDIST_COUNT_IMPORTS": record.name})
    finally:
        os.remove(pth)
    with open(record.name) as f:
        lines = f.read().splitlines()
    os.remove(record.name)
    counts = count(lines)
    total = sum(counts.values())
    print(f"\nfresh TensorFlow imports: {total} (command exit {code})")
    print("| process | imports |\n|---|---|")
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {n} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "exit": code, "total": total, "by_kind": counts,
                       "processes": lines}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
