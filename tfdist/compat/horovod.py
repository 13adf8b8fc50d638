"""horovodrun's build check, answered without importing TensorFlow ("horovod_built_check").

Before it starts a rank, horovodrun asks how Horovod was built (`gloo_built`, `mpi_built`, and,
for `--check-build`, NCCL, DDL, CCL). Horovod 0.28.1 answers each question in a forked process
that imports `horovod.tensorflow`, which imports all of TensorFlow: 2-3 s of CPU per question on
this machine. The answer is in Horovod's own extension library (`horovod_gloo_built()` and its
kin, C functions of `horovod/tensorflow/mpi_lib*.so`), which needs TensorFlow's two shared
libraries but not its Python package: here one forked process loads them with ctypes and answers
every question at once (0.3 s of CPU), and horovodrun's functions are replaced by that answer.
Nothing here imports Keras or TensorFlow.

Example (where Horovod is built):

    >>> from tfdist.compat import horovod_built
    >>> horovod_built()["gloo"]
    True
"""
import ctypes
import glob
import importlib.util
import json
import os

from tfdist.compat.table import using

_BUILT = {}
_QUESTIONS = ("gloo", "mpi", "nccl", "ddl", "ccl", "cuda", "rocm")


def horovod_built():
    """{"gloo": bool, "mpi": bool, ...}: what Horovod's TensorFlow extension was built with,
    read from the library in a forked process; {} when it cannot be loaded. Asked once."""
    using("horovod_built_check")
    if not _BUILT:
        _BUILT.update(_ask())
    return dict(_BUILT)


def _ask():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (TF's libraries run their initialisers here, not in horovodrun)
        answer = {}
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)  # (the libraries' start-up notices)
            tf_dir = importlib.util.find_spec("tensorflow").submodule_search_locations[0]
            for name in ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2"):
                ctypes.CDLL(os.path.join(tf_dir, name), mode=ctypes.RTLD_GLOBAL)
            hvd_dir = os.path.dirname(importlib.util.find_spec("horovod").origin)
            lib = ctypes.CDLL(glob.glob(os.path.join(hvd_dir, "tensorflow", "mpi_lib*.so"))[0],
                              mode=ctypes.RTLD_GLOBAL)
            for q in _QUESTIONS:
                f = getattr(lib, f"horovod_{q}_built", None)
                if f is not None:
                    answer[q] = bool(f())
        except (OSError, IndexError, AttributeError, TypeError):
            answer = {}
        finally:
            os.write(w, json.dumps(answer).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data or b"{}")


def patch_horovodrun():
    """Makes horovodrun (`horovod.runner.launch`) ask `horovod_built` instead of importing
    TensorFlow; a question the library cannot answer falls back to Horovod's own way. (Nothing
    when the row is switched off.)"""
    if not using("horovod_built_check"):
        return
    from horovod.common import util
    from horovod.runner import launch

    def answer(question, upstream):
        def built(verbose=False):
            known = horovod_built()
            return known[question] if question in known else upstream(verbose=verbose)
        return built
    for question in ("gloo", "mpi", "nccl", "ddl", "ccl"):
        for module in (util, launch):
            name = f"{question}_built"
            if hasattr(module, name):
                setattr(module, name, answer(question, getattr(util, name)))
