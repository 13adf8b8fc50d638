"""The console: what TensorFlow's C++ runtime prints while it loads is not the run's, so tfdist
keeps it off the terminal unless asked (`--verbose`, or TFDIST_VERBOSE=1).

Example:

    >>> from tfdist.runtime import console
    >>> [console.is_noise(line)
    ...  for line in ("oneDNN custom operations are on. You may see ...", "real news")]
    [True, False]
"""
import os
import sys
import tempfile

# What TensorFlow's C++ runtime prints while it loads, whatever TF_CPP_MIN_LOG_LEVEL says: the
# absl pre-initialisation warning, the oneDNN notice (twice) and the CPU-feature notice. It
# carries nothing about the run.
NOISE = ("WARNING: All log messages before absl::InitializeLog() is called",
         "oneDNN custom operations are on",
         "This TensorFlow binary is optimized to use available CPU instructions",
         "To enable the following instructions:")


def verbose(argv=None):
    argv = sys.argv if argv is None else argv
    return os.environ.get("TFDIST_VERBOSE", "") not in ("", "0") or "--verbose" in argv


def quiet_tensorflow_import(argv=None):
    """Imports TensorFlow and Keras with the C++ runtime's stderr captured; what is not start-up
    noise is passed on. (The notices are C++ writes to file descriptor 2 while TF loads, so
    they cannot be filtered at the Python level; oneDNN itself stays on.)"""
    if "tensorflow" in sys.modules:
        return
    if verbose(argv):  # its messages shown, as TensorFlow prints them
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import keras  # noqa: F401
            import tensorflow  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            pass_on_stderr(captured.read())


def is_noise(line):
    """Whether `line` is one of TensorFlow's start-up notices (NOISE)."""
    return any(n in line for n in NOISE)


def pass_on_stderr(captured):
    """Writes captured stderr bytes to stderr, without TensorFlow's start-up noise."""
    rest = [line for line in captured.decode(errors="replace").splitlines()
            if line.strip() and not is_noise(line)]
    if rest:
        print("\n".join(rest), file=sys.stderr, flush=True)
