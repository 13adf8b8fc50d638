"""The command lines of tfdist: one module per command (`tfdist <command>`: train, sample,
prepare, launch, plan; `serve`, a server task of a user's program), each the only reader of its
flags, and none importing TensorFlow before its `main` runs (every `--help` answers at once).

This module runs an absl main with tfdist's error contract: bad input -> one line on stderr, exit
status 2.

Flag errors (unknown or ill-typed `--config.*` keys, a missing config file) and `UsageError`s
raised anywhere in the run are reported as `tfdist: error: <what is wrong and what to do>`.
`tfdist <command> --help` lists that command's own flags. TensorFlow's start-up chatter stays
off the terminal unless `--verbose` is given (or TFDIST_VERBOSE=1).
"""
import os
import sys

from absl import app, flags, logging

from tfdist.errors import EXIT_PEER_LOST, EXIT_PREEMPTED, PeerLost, UsageError
from tfdist.runtime import cluster
from tfdist.runtime.console import (  # noqa: F401
    NOISE,
    pass_on_stderr,
    quiet_tensorflow_import,
    verbose,
)

#: The repository (its configs/), and the config a command reads without --config.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "gpt_nano.py")

_VERBOSE = flags.DEFINE_bool("verbose", False, "Show TensorFlow's start-up messages (also: "
                             "TFDIST_VERBOSE=1).")


def command_help(module_name, prog):
    """`<prog> --help`: the command's docstring and its own flags with their defaults."""
    module = sys.modules[module_name]
    print(f"usage: {prog} [flags]\n")
    print((module.__doc__ or "").strip() + "\n")
    print(flags.FLAGS.module_help(module_name))
    print(flags.FLAGS.module_help(__name__).replace(__name__ + ":", "common:"))


def fail(message, hard=False):
    print(f"tfdist: error: {message}", file=sys.stderr, flush=True)
    cluster.report_exit(2)
    if hard:  # a thread may still be blocked inside TensorFlow (e.g. connecting to a TPU)
        os._exit(2)
    sys.exit(2)


def _clean(e):
    text = str(e).strip().strip("'\"").replace("\\n", " ").replace("\\'", "'")
    return " ".join(text.split()) or type(e).__name__


def default_workdir(config_file):
    """`tfdist train`'s workdir without --workdir: runs/<the config file's name>."""
    return os.path.join("runs", os.path.splitext(os.path.basename(config_file))[0])


def define_config_flag(name, default, help_text):
    """`config_flags.DEFINE_config_file`, whose --config.* overrides are parsed at definition time
    (from sys.argv): an unknown or ill-typed key fails here, reported as one line."""
    from ml_collections import config_flags
    try:
        return config_flags.DEFINE_config_file(name, default, help_text, lock_config=True)
    except (KeyError, AttributeError, ValueError, TypeError) as e:
        fail(f"bad --{name} override: {_clean(e)}")


def _parse_flags(argv):
    for arg in argv[1:]:
        if arg == "--":
            break
        if arg in ("-h", "--help", "--helpshort"):
            command_help(_MAIN_MODULE[0], argv[0])
            sys.exit(0)
    for arg in argv[1:]:  # ml_collections' own message for this names no file; say which one
        if arg == "--":
            break
        if arg.startswith("--config=") and not os.path.isfile(arg[len("--config="):]):
            fail(f"config file '{arg[len('--config='):]}' not found; "
                 "pass --config=configs/<name>.py")
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    except (KeyError, AttributeError, ValueError, TypeError, OSError) as e:
        # ml_collections reports bad config files and overrides with these.
        fail(f"bad --config: {_clean(e)}")


_MAIN_MODULE = [None]


def run(main, argv, tensorflow=True):
    """Parses flags (after `--help` or a bad flag: exit, without TensorFlow), then runs
    `main(argv)` under the error contract; with `tensorflow`, TensorFlow is imported first,
    quietly (`quiet_tensorflow_import`)."""
    _MAIN_MODULE[0] = main.__module__

    def guarded(args):
        logging.set_verbosity(logging.WARNING)  # TFDS and checkpointing are chatty at INFO
        if tensorflow:
            quiet_tensorflow_import(argv)
            from tfdist.runtime import preemption
            preemption.exit_at_once()  # (a stop's backup written: this process ends at once)
        try:
            return main(args)
        except UsageError as e:
            fail(str(e), hard=getattr(e, "hard_exit", False))
        except PeerLost as e:  # TF's threads may still wait on the lost peer: end at once
            sys.stdout.flush()
            print(f"tfdist: error: {e}", file=sys.stderr, flush=True)
            cluster.run_before_hard_exit()
            cluster.report_exit(EXIT_PEER_LOST)
            os._exit(EXIT_PEER_LOST)
        except SystemExit as e:  # (a preempted run's 75)
            cluster.report_exit(e.code)
            if e.code == EXIT_PREEMPTED:
                # its backup is written: no teardown, during which Python has put TERM's default
                # back (srun's TERM to the tasks still exiting made them 143)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(EXIT_PREEMPTED)
            raise

    app.run(guarded, argv=argv, flags_parser=_parse_flags)
