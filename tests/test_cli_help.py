"""The command line helps: `--help` lists a command's own flags; a bad flag is one line, with no
TensorFlow start-up noise before it."""
import os
import sys

import pytest

from tests.helpers import first_fast, run

COMMANDS = {  # command -> flags it must list (its own, defined in its module)
    "train": ["--workdir", "--strategy", "--devices", "--overwrite", "--prepare_only", "--config"],
    "plan": ["--device", "--devices", "--batch", "--validate", "--measured"],
    "launch": ["--workers", "--strategy", "--ps", "--max_restarts", "--backoff", "--bind"],
    "sample": ["--model", "--prompt", "--max_new_tokens", "--temperature", "--top_k"],
    "prepare": ["--out", "--workers", "--config"],
}


def tfdist(*args, env=None):
    # a fresh terminal: nothing of the test runner's own TF settings
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TF_CPP", "TFDIST_"))},
           **(env or {})}
    return run([sys.executable, "-m", "tfdist", *args], env=env, check=False, timeout=300)


@pytest.mark.parametrize("command", first_fast(sorted(COMMANDS)))
def test_help_lists_the_commands_own_flags(command):
    p = tfdist(command, "--help")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"usage: tfdist {command} [flags]")
    for flag in COMMANDS[command]:
        assert f"  {flag}:" in p.stdout or f"  --[no]{flag[2:]}:" in p.stdout, (flag, p.stdout)
    assert "(default:" in p.stdout and p.stderr == ""


# TensorFlow's C++ start-up lines at its default log level (the tests' environment raises it):
# which ones appear depends on the CPU (the oneDNN notice on some, the instruction-set notice on
# others), so the companion below asks for any of them.
LOUD = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0"}


@pytest.mark.parametrize("command", first_fast(sorted(COMMANDS)))
def test_a_bad_flag_is_exactly_one_line(command):
    p = tfdist(command, "--no_such_flag=1", env=LOUD)
    assert p.returncode == 2
    lines = (p.stdout + p.stderr).splitlines()  # every line, noise included
    assert lines == ["tfdist: error: Unknown command line flag 'no_such_flag'"], lines


# A bad value that `tfdist train` finds once TensorFlow is imported (flags are parsed before).
BAD_VALUE = "--config.train.steps=0"
BAD_VALUE_LINE = "tfdist: error: config key 'train.steps' must be an integer > 0, got 0"


@pytest.mark.slow
def test_a_bad_value_after_tensorflow_started_is_exactly_one_line():
    p = tfdist("train", BAD_VALUE, env=LOUD)
    assert p.returncode == 2
    assert (p.stdout + p.stderr).splitlines() == [BAD_VALUE_LINE], p.stdout + p.stderr


@pytest.mark.slow
def test_verbose_shows_tensorflows_start_up_messages():
    """The companion: the noise is really there, and --verbose lets it through."""
    from tfdist.cli import NOISE
    p = tfdist("train", BAD_VALUE, "--verbose", env=LOUD)
    assert p.returncode == 2
    assert any(n in p.stderr for n in NOISE), p.stderr
    assert p.stderr.splitlines()[-1] == BAD_VALUE_LINE


HELP_SECONDS = 1.5  # of CPU time, which a busy machine does not stretch as it does wall time


@pytest.mark.parametrize("command", [*sorted(COMMANDS), None])
def test_help_answers_without_tensorflow(command):
    """Every `--help` (and `tfdist --help`) answers in a fresh process without importing
    TensorFlow, within HELP_SECONDS of CPU. The companion: importing TensorFlow alone takes
    longer than that here."""
    argv = ["tfdist", command, "--help"] if command else ["tfdist", "--help"]
    code = ("import sys; from tfdist.__main__ import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('TENSORFLOW', 'tensorflow' in sys.modules, file=sys.stderr)")
    p, cpu = _timed([sys.executable, "-c", code])
    assert p.returncode == 0 and "usage: tfdist" in p.stdout, p.stderr[-2000:]
    assert "TENSORFLOW False" in p.stderr, p.stderr[-2000:]
    assert cpu <= HELP_SECONDS, cpu


def test_importing_tensorflow_takes_longer_than_a_help():
    _, cpu = _timed([sys.executable, "-c", "import tensorflow, keras"])
    assert cpu > HELP_SECONDS, cpu


def _timed(argv):
    """(CompletedProcess, CPU seconds of the new process and its children)."""
    import resource
    import subprocess
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return p, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
