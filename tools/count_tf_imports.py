"""Counts the fresh imports of TensorFlow a command causes: every Python process of the venv that
imports `tensorflow` itself (a fork of a process that had imported it does not), by what the
process was.

    python tools/count_tf_imports.py -- make test          # the suite's count
    python tools/count_tf_imports.py -- .venv/bin/tfdist launch --workers 2 -- --config=...

How: while the command runs, a `.pth` file in the venv's site-packages (`tfdist_count_imports
.pth`, removed at the end) adds an audit hook (`sys.addaudithook`) to every Python process that
starts with `TFDIST_COUNT_IMPORTS` set; the first `import tensorflow` of a process appends its pid
and command line to that file. The variable is one the tests pass on unchanged, so forks of the
tests' fork server and of tfdist's warm agents stay forks (TF_*, PYTHON* and LD_* would make the
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
                f.write(f"{os.getpid()} {' '.join(sys.orig_argv)[:400]}\\n")
    sys.addaudithook(_tfdist_count)
"""
PTH = "tfdist_count_imports.pth"

#: (kind, a test on the command line) in order; the first that matches names the process.
KINDS = (
    ("tfdist warm agent", lambda a: "tfdist.launch.agent" in a),
    ("tests' fork server", lambda a: "forkserver.py" in a),
    ("pytest worker", lambda a: "pytest" in a or "xdist" in a or "execnet" in a),
    ("horovodrun's launcher", lambda a: "horovodrun" in a or "multiprocessing.spawn" in a
     or "from multiprocessing" in a),
    ("Ray worker", lambda a: "ray" in a and ("default_worker" in a or "ray::" in a
                                             or "/ray/" in a)),
    ("tfdist launch (launcher)", lambda a: " launch " in f" {a} " and "tfdist" in a),
    ("tfdist command (train, worker, rank)", lambda a: "tfdist" in a or "faulty_train" in a),
    ("other", lambda a: True),
)


def kind(argv):
    return next(name for name, test in KINDS if test(argv))


def count(lines):
    """{kind: count} of the recorded lines ("pid argv")."""
    return dict(collections.Counter(kind(line.split(" ", 1)[1] if " " in line else "")
                                    for line in lines if line.strip()))


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
    print(f"\nfresh TensorFlow imports: {len(lines)} (command exit {code})")
    print("| process | imports |\n|---|---|")
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {n} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "exit": code, "total": len(lines), "by_kind": counts,
                       "processes": lines}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
