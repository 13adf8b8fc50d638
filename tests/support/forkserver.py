"""A fork server for the tests: Python processes that start without importing TensorFlow again.

Importing TensorFlow and Keras takes 6 to 8 s of CPU on this machine, and the suite starts a few
hundred Python processes that do it: every `tfdist` command line case, every training driver.
This server imports them once (and nothing of tfdist, whose modules read the environment when
imported) and runs each command in a fork of itself: a real process with its own pid, exit
status, stdout and stderr, environment, working directory and process group, whose code starts
where `python -m tfdist ...`, `python script.py ...` or `python -c ...` would, after the imports.

    server = ForkServer()
    p = server.run(["-m", "tfdist", "train", "--config=..."], env=dict(os.environ), cwd=ROOT,
                   timeout=300)
    p.returncode, p.stdout, p.stderr            # as subprocess.run(capture_output=True) gives them

Not for what differs between a fork and a new process (`tests.helpers.run` decides, and starts
a new process then): a changed TF_*/KERAS_*/PYTHON*/LD_* variable (read when TF or Python
starts), TF's own start-up messages (printed once, by the server), or the peak memory of the
process (a fork's resident set starts with the server's pages).

Protocol: one JSON request per line on the server's stdin ({argv, env, cwd, timeout}), one JSON
reply per line on its stdout ({returncode, stdout, stderr, timed_out}). A command that runs out
of time is killed with its process group (SIGKILL), as `tests.helpers.run_group` does.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading


class ForkServer:
    """The client: starts the server (this file run as a script) on first use."""

    def __init__(self):
        self._p = None
        self._lock = threading.Lock()

    def _start(self):
        self._p = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True,
                                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get(
                                       "TF_CPP_MIN_LOG_LEVEL", "2")})

    def run(self, argv, env, cwd, timeout):
        """Runs `python <argv>` in a fork; a CompletedProcess, or TimeoutExpired after `timeout`
        s."""
        with self._lock:
            if self._p is None or self._p.poll() is not None:
                self._start()
            self._p.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": cwd,
                                            "timeout": timeout}) + "\n")
            self._p.stdin.flush()
            line = self._p.stdout.readline()  # bounded: the server kills the command at `timeout`
        if not line:
            raise RuntimeError("the tests' fork server died")
        reply = json.loads(line)
        cmd = [sys.executable, *argv]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, reply["stdout"], reply["stderr"])
        return subprocess.CompletedProcess(cmd, reply["returncode"], reply["stdout"],
                                           reply["stderr"])

    def close(self):
        if self._p is not None and self._p.poll() is None:
            self._p.stdin.close()
            try:
                self._p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._p.kill()
                self._p.wait()


# -- the server ----------------------------------------------------------------------------------
def _child(request, out, err):
    """In the fork: become the command's process, run it, exit with its status."""
    import atexit
    import runpy
    import signal
    os.setsid()  # its own process group, killed whole on timeout
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], request["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # as the interpreter does: sys.excepthook (a traceback), status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _serve():
    import signal
    import time

    import keras  # noqa: F401  (the point of it all)
    import tensorflow  # noqa: F401
    for line in sys.stdin:
        request = json.loads(line)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            pid = os.fork()
            if pid == 0:
                _child(request, out.fileno(), err.fileno())
            deadline, timed_out = time.monotonic() + request["timeout"], False
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status = -signal.SIGKILL
                    break
                time.sleep(0.02)
            try:  # what the command's own children left in its group dies with it
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = status if timed_out else os.waitstatus_to_exitcode(status)
            reply = {"returncode": code, "timed_out": timed_out}
            for key, f in (("stdout", out), ("stderr", err)):
                f.seek(0)
                reply[key] = f.read().decode(errors="replace")
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
