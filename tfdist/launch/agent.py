"""The warm agent of a host: TensorFlow, Keras and tfdist imported once, each worker a fork of it.

    python -m tfdist.launch.agent --address=127.0.0.1     # started by tfdist launch (warm.py)

`tfdist launch` starts one agent on each host it uses (here directly, elsewhere through ssh) and
asks it for the processes it wants: the prepare step, the workers, a Horovod rank, a spare's
replacement. A process it starts is a real process: its own pid, session and process group
(`setsid`), its own exit status, its signals, its environment (`TF_CONFIG`, Horovod's rank
variables, TFDIST_*) and working directory, and its own output, which the agent passes on to
the launcher. Its code starts where `python -m tfdist ...` (or `python script.py`, `python -c`)
would, after the imports: a worker starts in well under a second instead of the 2-3 s of CPU
that importing TensorFlow costs.

**Nothing of TensorFlow's runtime starts before the fork.** TF's runtime (its eager context,
thread pools, gRPC servers, collectives) is made the first time an op runs or a device is
listed; a fork of a process where it runs would share its threads' locks in a state no thread
owns. The agent only imports modules, and before every fork it checks
(`tfdist.runtime.process.why_not_fork`) that
* TensorFlow's eager context is not initialised (`tfdist.compat.tf_runtime_started`),
* no thread of TF's runtime exists (their names begin `tf_`), and
* no Python thread other than the main one runs (the agent's loop is one thread: `select`).
(The threads of OpenBLAS and jemalloc that importing numpy and TF starts are made fork-safe by
those libraries' own `pthread_atfork` handlers.) A check that fails turns every later start into
a cold one (an `exec` of the same command), said once; `tests/test_warm.py` shows the check
failing once an op has run.

**What a fork cannot take over** is what Python or TensorFlow read when they start: a variable
of `READ_AT_START` that differs from the agent's own makes that process start cold (`exec`), and
so does a command that is not `python -m ...`, `python -c ...` or `python script.py` with this
interpreter.

The launcher's side (starting agents, the processes as `Popen`-like objects): `warm.py`.

Protocol: one JSON object per line each way, on the agent's stdin and stdout.
* requests: `{"op": "spawn", "id", "argv", "env", "cwd", "name", "separate"}` (`env`: the
  variables set on top of the agent's own environment),
  `{"op": "signal", "id", "sig"}`; end of input: the agent kills its processes and exits.
* events: `{"ev": "ready", "pid", "keeper", "interfaces", "import_s", "refused"}`,
  `{"ev": "started", "id", "pid", "how"}`, `{"ev": "out", "id", "fd", "data"}` (bytes as
  latin-1), `{"ev": "eof", "id"}`, `{"ev": "exit", "id", "code"}` (code as Popen's returncode),
  `{"ev": "keeper_exit", "code"}`.
A process's group is killed once it has exited (what it left in its own session dies with it).
Each process gets SIGKILL if the agent dies (`PR_SET_PDEATHSIG`), so none outlives its host's
agent.
"""
import argparse
import gc
import json
import os
import select
import shutil
import signal
import sys
import time

from tfdist.runtime import keeper, process

#: Variables read when Python, TensorFlow or oneDNN start (or when tfdist's patch table is
#: imported): a process whose value differs from the agent's starts cold.
READ_AT_START = ("TF_", "KERAS_", "XLA_", "CUDA", "LD_", "PYTHON", "OMP_", "MKL", "ONEDNN",
                 "DNNL", "TFDIST_DISABLE", "TFDIST_VERBOSE")
#: ... except these, read later (TF_CONFIG by the strategy, gRPC's options at its first channel)
READ_LATER = ("TF_CONFIG", "TF_GRPC_DEFAULT_OPTIONS", "PYTHONUNBUFFERED")

def differs(env, base):
    """The first variable read at start whose value in `env` is not `base`'s, or None."""
    for key in sorted(set(env) | set(base)):
        if key.startswith(READ_AT_START) and key not in READ_LATER and env.get(key) != base.get(
                key):
            return key
    return None


def program(argv, env):
    """The Python program `argv` runs with this interpreter (("-m", module), ("-c", code) or
    ("script", path)) and its arguments, or None for any other command."""
    if len(argv) < 2:
        return None
    exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
    if not exe or os.path.realpath(exe) != os.path.realpath(sys.executable):
        return None
    rest = list(argv[1:])
    while rest and rest[0] == "-u":  # (unbuffered: the output pipe is line-written anyway)
        rest = rest[1:]
    if len(rest) >= 2 and rest[0] in ("-m", "-c"):
        return (rest[0], rest[1]), rest[2:]
    if rest and not rest[0].startswith("-"):
        return ("script", rest[0]), rest[1:]
    return None


# -- the agent -----------------------------------------------------------------------------------
class Agent:
    """The agent's loop: requests on fd 0, events on fd 1, the processes' output on their pipes;
    one thread (`select`)."""

    def __init__(self, base_env, keeper_process, cold=False):
        self.base_env = base_env  # the environment the agent started with
        self.keeper = keeper_process
        self.cold = cold  # every process an exec (tfdist launch --cold)
        self.children = {}  # id -> {"pid", "fds", "exited"}
        self.fds = {}  # output fd -> (id, 1 or 2)
        self.refused = None  # why forks are refused (said once), or None

    def send(self, event):
        data = (json.dumps(event) + "\n").encode()
        while data:
            data = data[os.write(1, data):]

    def serve(self):
        pending = b""
        while True:
            readable, _, _ = select.select([0, *self.fds], [], [], 0.05)
            for fd in readable:
                if fd == 0:
                    chunk = os.read(0, 1 << 16)
                    if not chunk:
                        return self.shutdown()
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.strip():
                            self.handle(json.loads(line))
                else:
                    self.read(fd)
            self.reap()

    def handle(self, request):
        if request["op"] == "spawn":
            self.spawn(request)
        elif request["op"] == "signal":
            child = self.children.get(request["id"])
            if child and child["code"] is None:
                try:
                    os.kill(child["pid"], request["sig"])
                except ProcessLookupError:
                    pass

    def read(self, fd):
        wid, stream = self.fds[fd]
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            chunk = b""
        if chunk:
            self.send({"ev": "out", "id": wid, "fd": stream, "data": chunk.decode("latin-1")})
            return
        os.close(fd)
        del self.fds[fd]
        child = self.children[wid]
        child["fds"].remove(fd)
        if not child["fds"]:
            self.send({"ev": "eof", "id": wid})
            if child["code"] is not None:
                del self.children[wid]

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            code = os.waitstatus_to_exitcode(status)
            if self.keeper is not None and pid == self.keeper:
                self.keeper = None
                self.send({"ev": "keeper_exit", "code": code})
                continue
            wid = next((k for k, c in self.children.items() if c["pid"] == pid), None)
            if wid is None:
                continue
            child = self.children[wid]
            for fd in list(child["fds"]):  # what it wrote before it ended comes first
                _drain(fd, lambda data, fd=fd, wid=wid: self.send(
                    {"ev": "out", "id": wid, "fd": self.fds[fd][1],
                     "data": data.decode("latin-1")}))
            child["code"] = code
            try:  # what it left in its own session dies with it
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.send({"ev": "exit", "id": wid, "code": code})
            if not child["fds"]:
                del self.children[wid]

    def spawn(self, request):
        wid = request["id"]
        env = {**self.base_env, **{k: str(v) for k, v in request["env"].items()}}
        why = self.refused or process.why_not_fork()
        if why and not self.refused:
            self.refused = why
        key = differs(env, self.base_env)
        prog = program(request["argv"], env)
        cold = ("tfdist launch --cold" if self.cold else
                f"the agent cannot fork: {why}" if why else
                f"{key} differs from the agent's" if key else
                None if prog else "not a Python program of this interpreter")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if request.get("separate") else (None, None)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # What the agent holds (TF, Keras, tfdist: most of a worker's objects) is left out of
        # the fork's garbage collections, which would otherwise walk it, and copy its pages, at
        # every collection and once more at exit (1 s of CPU per process here): gc.freeze, as
        # Python's documentation advises before a fork without exec.
        gc.freeze()
        agent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the new process: out of the agent's loop, to run `prog` from `main`
            try:
                _become(request, env, out_w, err_w if err_w is not None else out_w,
                        keep=(out_w, err_w), close=[*self.fds, out_r, err_r], cold=cold,
                        agent=agent)
            except BaseException:  # noqa: BLE001 (nothing may go back into the agent's loop)
                import traceback
                traceback.print_exc()
                os._exit(127)
            raise Forked(prog)
        os.close(out_w)
        fds = [out_r]
        self.fds[out_r] = (wid, 1)
        if err_w is not None:
            os.close(err_w)
            fds.append(err_r)
            self.fds[err_r] = (wid, 2)
        self.children[wid] = {"pid": pid, "fds": fds, "code": None}
        self.send({"ev": "started", "id": wid, "pid": pid, "how": "cold" if cold else "warm",
                   "why": cold})

    def shutdown(self):
        """The launcher is gone (or done): every process of this agent, and the keeper, end."""
        for child in self.children.values():
            if child["code"] is None:
                try:
                    os.killpg(child["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self.keeper is not None:
            try:
                os.kill(self.keeper, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return 0


def _drain(fd, write):
    """Passes on what `fd` holds now, without waiting for more."""
    while select.select([fd], [], [], 0)[0]:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        write(chunk)


# -- the process, after the fork -----------------------------------------------------------------
class Forked(BaseException):
    """Raised in a new process, out of the agent's loop: `main` runs `prog` then, from the top
    of the stack, and the interpreter ends as a fresh one would (atexit, then its own
    finalisation)."""

    def __init__(self, prog):
        super().__init__()
        self.prog = prog


def _become(request, env, out, err, keep, close, cold, agent):
    """In the fork: become the requested process (its session, name, signals, output,
    directory and environment); a cold one execs its command here."""
    os.setsid()
    if not process.die_with_parent(agent):  # the agent died between the fork and the prctl
        os._exit(137)
    name = f"tfdist-{request.get('name') or 'worker'}"
    process.name_self(name)
    process.set_title(f"{name} (started warm by tfdist launch's agent)")
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD,
                signal.SIGQUIT, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # (as Python sets it at start)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in [null, *keep, *close]:
        if fd is not None and fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass
    os.chdir(request["cwd"])
    argv = request["argv"]
    if cold:
        exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
        try:
            os.execve(exe or argv[0], argv, env)
        except OSError as e:
            os.write(2, f"tfdist: error: cannot run {argv[0]}: {e.strerror}\n".encode())
            os._exit(127)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if "numpy" in sys.modules:  # (a fresh process seeds numpy's global generator anew)
        sys.modules["numpy"].random.seed()
    sys.orig_argv = list(argv)


def _run(prog):
    """Runs the program as the interpreter would (`main`'s caller ends the process: an uncaught
    exception's traceback and status 1, SystemExit's status)."""
    import runpy
    (kind, what), args = prog
    if kind == "-m":
        sys.argv, sys.path[0] = [what, *args], os.getcwd()
        runpy.run_module(what, run_name="__main__", alter_sys=True)
    elif kind == "-c":
        sys.argv, sys.path[0] = ["-c", *args], ""
        exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv, sys.path[0] = [what, *args], os.path.dirname(os.path.abspath(what))
        runpy.run_path(what, run_name="__main__")
    return 0


def warm_up():
    """Imports what a worker runs: TensorFlow and Keras (their start-up notices kept off the
    terminal), tfdist's run and command line, every strategy plugin, Horovod where it is built.
    Runs no op."""
    from tfdist.runtime.console import quiet_tensorflow_import
    quiet_tensorflow_import()
    import ml_collections.config_flags  # noqa: F401

    import tfdist.cli  # noqa: F401
    import tfdist.train  # noqa: F401
    from tfdist import strategies
    for name in strategies.names():
        strategies.get_class(name)
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError:
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", default="127.0.0.1", help="where this host's keeper listens")
    ap.add_argument("--cold", action="store_true",
                    help="import nothing: start every process fresh (an exec)")
    args = ap.parse_args(argv)
    process.name_self("tfdist-agent")
    process.set_title(f"tfdist-agent {args.address}")
    base_env = dict(os.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends it (end of input)
    keeper_pid, keeper_address = keeper.start(args.address)  # (before TF: it imports none)
    start = time.perf_counter()
    if not args.cold:
        warm_up()
    agent = Agent(base_env, keeper_pid, cold=args.cold)
    agent.refused = None if args.cold else process.why_not_fork()
    agent.send({"ev": "ready", "pid": os.getpid(), "keeper": keeper_address,
                "interfaces": interfaces(), "import_s": round(time.perf_counter() - start, 2),
                "refused": agent.refused})
    try:
        return agent.serve()
    except Forked as child:  # (in a new process)
        del agent
        return _run(child.prog)


def interfaces():
    """{address: interface name} of this host's IPv4 addresses (Gloo binds an interface)."""
    import fcntl
    import socket
    import struct
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[socket.inet_ntoa(packed[20:24])] = name
    return found


if __name__ == "__main__":
    sys.exit(main())
