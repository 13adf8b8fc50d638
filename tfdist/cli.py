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


def fail(message):
    print(f"tfdist: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    except (KeyError, AttributeError, ValueError, TypeError, OSError) as e:
        # ml_collections reports bad config files and overrides with these.
        fail(f"bad --config: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")


def run(main, argv):
    def guarded(args):
        logging.set_verbosity(logging.WARNING)  # TFDS and checkpointing are chatty at INFO
        try:
            return main(args)
        except UsageError as e:
            fail(str(e))

    app.run(guarded, argv=argv, flags_parser=_parse_flags)
