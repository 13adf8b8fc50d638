"""Runs an absl main with tfdist's error contract: bad input -> one line on stderr, exit status 2.

Flag errors (unknown or ill-typed `--config.*` keys, a missing config file) and `UsageError`s
raised anywhere in the run are reported as `tfdist: error: <what is wrong and what to do>`.
"""
import os
import sys

# Quiet TensorFlow's C++ start-up chatter unless the user asked for it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from tfdist.errors import UsageError  # noqa: E402


def fail(message, hard=False):
    print(f"tfdist: error: {message}", file=sys.stderr, flush=True)
    if hard:  # a thread may still be blocked inside TensorFlow (e.g. connecting to a TPU)
        os._exit(2)
    sys.exit(2)


def _clean(e):
    text = str(e).strip().strip("'\"").replace("\\n", " ").replace("\\'", "'")
    return " ".join(text.split()) or type(e).__name__


def define_config_flag(name, default, help_text):
    """`config_flags.DEFINE_config_file`, whose --config.* overrides are parsed at definition time
    (from sys.argv): an unknown or ill-typed key fails here, reported as one line."""
    from ml_collections import config_flags
    try:
        return config_flags.DEFINE_config_file(name, default, help_text, lock_config=True)
    except (KeyError, AttributeError, ValueError, TypeError) as e:
        fail(f"bad --{name} override: {_clean(e)}")


def _parse_flags(argv):
    for arg in argv[1:]:  # ml_collections' own message for this names no file; say which one
        if arg == "--":
            break
        if arg.startswith("--config=") and not os.path.isfile(arg[len("--config="):]):
            fail(f"config file '{arg[len('--config='):]}' not found; pass --config=configs/<name>.py")
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    except (KeyError, AttributeError, ValueError, TypeError, OSError) as e:
        # ml_collections reports bad config files and overrides with these.
        fail(f"bad --config: {_clean(e)}")


def run(main, argv):
    def guarded(args):
        logging.set_verbosity(logging.WARNING)  # TFDS and checkpointing are chatty at INFO
        try:
            return main(args)
        except UsageError as e:
            fail(str(e), hard=getattr(e, "hard_exit", False))

    app.run(guarded, argv=argv, flags_parser=_parse_flags)
