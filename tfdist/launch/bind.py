"""The bind shim of `tfdist launch --bind=loopback`.

Listening only on 127.0.0.1: TF's gRPC server binds every interface whatever TF_CONFIG says
(tensorflow/tensorflow#2925). `--bind=loopback` (the default) therefore preloads
`loopback_bind.c`, which the system C compiler builds once into ~/.cache/tfdist. It turns the
workers' wildcard binds into 127.0.0.1 binds. `--bind=all` leaves TF's behaviour alone.

The launcher sets `TFDIST_BIND` (its --bind) for every process it starts, and the shim reads it at
each bind: with "all" it passes wildcard binds through. A process whose environment preloads the
shim already (the tests' processes, with TFDIST_BIND=all) keeps its LD_PRELOAD as it is, so its
launch's agent can be a fork of it (`tfdist.launch.warm`).

    >>> launch_env({"LD_PRELOAD": "x.so"}, "all")
    {'LD_PRELOAD': 'x.so', 'TFDIST_BIND': 'all'}
"""
import hashlib
import os
import shutil
import subprocess

from tfdist.errors import UsageError
from tfdist.runtime import host

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loopback_shim():
    """Path of the compiled loopback-bind shim, built on first use (cached by source hash)."""
    src = os.path.join(_REPO, "launchers", "loopback_bind.c")
    if not os.path.exists(src):
        raise UsageError(f"--bind=loopback needs {src} (tfdist's repository checkout); "
                         f"pass --bind=all (workers then listen on every interface)")
    with open(src, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:12]
    cache = host.cache_dir()
    so = os.path.join(cache, f"loopback_bind-{digest}.so")
    if os.path.exists(so):
        return so
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise UsageError("--bind=loopback needs a C compiler (cc) once, to build its bind shim; "
                         "install gcc, or pass --bind=all (workers then listen on every interface)")
    os.makedirs(cache, exist_ok=True)
    tmp = f"{so}.{os.getpid()}.tmp"
    p = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, src, "-ldl"],
                       capture_output=True, text=True)
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"building {src} with {cc} failed ({last}); pass --bind=all to do without")
    os.replace(tmp, so)
    return so


def launch_env(env, bind):
    """`env` for a launch's processes under `--bind=bind`: TFDIST_BIND set, and with "loopback"
    the shim in LD_PRELOAD (first, unless it is there already)."""
    env = {**env, "TFDIST_BIND": bind}
    if bind == "loopback":
        shim, present = loopback_shim(), env.get("LD_PRELOAD", "").split()
        if shim not in present:
            env["LD_PRELOAD"] = " ".join([shim, *present])
    return env
