"""The launcher's side of the warm agents (`tfdist/launch/agent.py`): an agent per host, and the
processes it starts, which the supervisor handles as it handles `subprocess.Popen` objects. This
host's first agent is a fork of the launcher where the launcher has TensorFlow imported already
(`keep_a_fork`: a launch the tests start warm), else a new interpreter that imports it.

Example (an agent on this machine; a process that it starts warm, in a fork):

    >>> import os, sys
    >>> from tfdist.launch.warm import Agent
    >>> agent = Agent(dict(os.environ))
    >>> p = agent.spawn([sys.executable, "-c", "print('hello from', 'a fork')"], dict(os.environ),
    ...                 os.getcwd(), name="example")
    >>> p.wait(timeout=60), p.how, os.read(p.stdout_fd, 100)
    (0, 'warm', b'hello from a fork\\n')
    >>> agent.close()
"""
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from tfdist.runtime import process

#: Seconds an agent may take to start (it imports TensorFlow) before it counts as lost.
READY_TIMEOUT = 180.0
#: A fork of this process kept for this host's first agent (`keep_a_fork`), or None.
_KEPT = None


class AgentLost(Exception):
    """An agent ended, or did not start: its host is lost (or unreachable)."""


class WarmProcess:
    """A process an agent started: `pid`, `returncode`, `poll`, `wait`, `send_signal`,
    `terminate`, `kill`, as `subprocess.Popen` has them, and `stdout_fd` (`stderr_fd` with
    `separate`), a pipe with its output. `how` is "warm" (a fork) or "cold" (`why`: an exec);
    `host_lost` is True when it ended because its agent did (its host was lost)."""

    def __init__(self, agent, wid, args, separate):
        self.agent, self.wid, self.args = agent, wid, args
        self.pid = self.returncode = self.how = self.why = None
        self.host_lost = False
        self.output_ended = False
        self.pipes = {}  # 1 (and 2): the write ends of its output's pipes, while it has output
        r1, w1 = os.pipe()
        self.stdout_fd, self.pipes[1] = r1, w1
        self.stderr_fd = None
        if separate:
            r2, w2 = os.pipe()
            self.stderr_fd, self.pipes[2] = r2, w2
        self.started = threading.Event()
        self._done = threading.Event()
        # Its output goes through a queue and a thread of its own into its pipes, so that a
        # reader that falls behind holds up this process's output only, never its agent's.
        self._queue = queue.SimpleQueue()
        threading.Thread(target=self._write, daemon=True, name=f"tfdist-output-{wid}").start()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            self.agent.request({"op": "signal", "id": self.wid, "sig": int(sig)})

    def terminate(self):
        self.send_signal(15)

    def kill(self):
        self.send_signal(9)

    # (what the agent's reader thread calls)
    def deliver(self, stream, data):
        self._queue.put((stream, data))

    def close_output(self):
        self._queue.put(None)

    def _write(self):
        while True:
            item = self._queue.get()
            if item is None:
                break
            fd = self.pipes.get(item[0]) or self.pipes.get(1)
            try:
                os.write(fd, item[1])
            except OSError:  # (nobody reads it any more)
                pass
        for fd in self.pipes.values():
            os.close(fd)
        self.pipes = {}

    def ended(self, code, lost=False):
        if self.returncode is None:
            self.returncode = code
            self.host_lost = lost
        self.started.set()
        self._done.set()


class Agent:
    """A host's warm agent: started here (`host` None or this machine) or on `host` through
    ssh (`tfdist.launch.hosts.Host.remote`), with environment `env` (there: `remote_env`, the
    variables the launcher passes on); its keeper listens on
    `address`. `warm=False`: it imports nothing and starts every process fresh (an exec).
    `ready()` waits until it has imported everything (READY_TIMEOUT at most); `spawn` starts a
    process; `close` ends it, and every process it started."""

    def __init__(self, env, host=None, address="127.0.0.1", cwd=None, warm=True,
                 remote_env=None):
        self.host = host
        self.address = address
        argv = [sys.executable, "-m", "tfdist.launch.agent", f"--address={address}",
                *([] if warm else ["--cold"])]
        here = host is None or host.local
        if not here:  # (ssh runs here with `env`)
            argv = host.remote(argv, env if remote_env is None else remote_env)
        self.proc = _kept_fork(argv[3:], env, cwd or os.getcwd()) if warm and here else None
        if self.proc is None:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         env=env, cwd=cwd or os.getcwd(), start_new_session=True)
        self.info = None
        self.lost = None  # why the agent ended, once it has
        self._ready = threading.Event()
        self._ids = itertools.count()
        self._procs = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True,
                         name=f"tfdist-agent-{getattr(host, 'name', 'local')}").start()

    @property
    def alive(self):
        return self.lost is None

    @property
    def keeper(self):
        """The address of this host's keeper ("host:port"), once ready."""
        return self.info and self.info.get("keeper")

    def ready(self, timeout=READY_TIMEOUT):
        """The agent's ready report; AgentLost if it ended or did not report within `timeout`."""
        if not self._ready.wait(timeout):
            self.close()
            raise AgentLost(f"its agent did not start within {timeout:g} s")
        if self.info is None:
            raise AgentLost(self.lost or "its agent ended")
        return self.info

    def spawn(self, argv, env, cwd, name, separate=False):
        """Starts `argv` there (warm when it can: `tfdist/launch/agent.py`); a `WarmProcess`.
        `separate`: its stderr on a pipe of its own."""
        wid = next(self._ids)
        p = WarmProcess(self, wid, list(argv), separate)
        with self._lock:
            self._procs[wid] = p
        if not self.alive:
            p.close_output()
            p.ended(-9, lost=True)
            return p
        self.request({"op": "spawn", "id": wid, "argv": list(argv), "env": dict(env),
                      "cwd": cwd, "name": name, "separate": separate})
        return p

    def request(self, message):
        try:
            with self._lock:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                self.proc.stdin.flush()
        except (OSError, ValueError):  # the agent is gone; its reader says so
            pass

    def _read(self):
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:  # not ours (a remote shell's banner): ignored
                continue
            kind = event.get("ev")
            if kind == "ready":
                self.info = event
                self._ready.set()
                continue
            if kind == "keeper_exit":
                self.info["keeper"] = None
                continue
            p = self._procs.get(event.get("id"))
            if p is None:
                continue
            if kind == "started":
                p.pid, p.how, p.why = event["pid"], event["how"], event.get("why")
                p.started.set()
            elif kind == "out":
                p.deliver(event["fd"], event["data"].encode("latin-1"))
            elif kind == "eof":
                p.output_ended = True
                p.close_output()
                if p.returncode is not None:
                    with self._lock:
                        self._procs.pop(p.wid, None)
            elif kind == "exit":
                p.ended(event["code"])
                if p.output_ended:
                    with self._lock:
                        self._procs.pop(p.wid, None)
        self.proc.wait()
        self.lost = f"its agent ended (status {self.proc.returncode})"
        self._ready.set()
        with self._lock:
            procs, self._procs = list(self._procs.values()), {}
        for p in procs:
            p.close_output()
            p.ended(-9, lost=True)

    def close(self, timeout=10.0):
        """Ends the agent (end of its input): it kills its processes and its keeper."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- an agent that is a fork of the launcher -----------------------------------------------------
def keep_a_fork():
    """Keeps a fork of this process for this host's first agent, where this process has already
    imported what an agent imports (a launcher that runs as a warm process of another agent:
    the tests' own) and may fork (`tfdist.runtime.process.why_not_fork`); else does nothing.
    `tfdist launch` calls it before anything else. The fork waits for `Agent` to hand it an
    environment, a directory and the agent's arguments, then runs the agent's loop, with no
    import to do (about 4 s of CPU saved a launch); unused, it ends with the launcher (the end of
    its pipe). `Agent` takes it only where the environment it is given reads at start what this
    process did (`tfdist.launch.agent.differs`: the bind shim's LD_PRELOAD too,
    `tfdist.launch.bind`)."""
    global _KEPT
    if _KEPT is not None or "tfdist.train" not in sys.modules or process.why_not_fork():
        return
    config_r, config_w = os.pipe()
    requests_r, requests_w = os.pipe()
    events_r, events_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        for fd in (config_w, requests_w, events_r):
            os.close(fd)
        _wait_to_be_the_agent(config_r, requests_r, events_w)
    for fd in (config_r, requests_r, events_w):
        os.close(fd)
    _KEPT = (pid, config_w, requests_w, events_r, dict(os.environ))


def _kept_fork(args, env, cwd):
    """The kept fork, started as the agent with `args` in `env` and `cwd` (a Popen-like
    `_Forked`), or None: none kept, or `env` reads at start what this process did not."""
    global _KEPT
    from tfdist.launch.agent import differs
    if _KEPT is None or differs(env, _KEPT[4]):
        return None
    pid, config_w, requests_w, events_r, _ = _KEPT
    _KEPT = None
    data = json.dumps({"args": list(args), "env": dict(env), "cwd": cwd}).encode()
    try:
        while data:
            data = data[os.write(config_w, data):]
    except OSError:  # (it has ended)
        data = None
    os.close(config_w)
    if data is None:
        os.close(requests_w)
        os.close(events_r)
        return None
    return _Forked(pid, requests_w, events_r)


def _wait_to_be_the_agent(config_r, requests_r, events_w):
    """In the kept fork: waits for its configuration (the end of the launcher's pipe: none, it
    ends), then becomes the agent: its own session, its requests on stdin, its events on
    stdout. Never returns: the agent's status ends the process as it would end a warm process of
    the agent this one is a fork of (SystemExit), or os._exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the launcher's ^C is its to handle)
    chunks = []
    while True:
        chunk = os.read(config_r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(config_r)
    if not chunks:
        os._exit(0)
    config = json.loads(b"".join(chunks))
    os.setsid()
    os.dup2(requests_r, 0)
    os.dup2(events_w, 1)
    os.close(requests_r)
    os.close(events_w)
    os.chdir(config["cwd"])
    os.environ.clear()
    os.environ.update(config["env"])
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.argv = [sys.argv[0], *config["args"]]
    from tfdist.launch import agent
    raise SystemExit(agent.main(config["args"]))


class _Forked:
    """The kept fork as the agent: what `Agent` uses of a `subprocess.Popen` (`stdin`, `stdout`,
    `pid`, `returncode`, `poll`, `wait`, `kill`)."""

    def __init__(self, pid, requests_w, events_r):
        self.pid, self.returncode = pid, None
        self.stdin = open(requests_w, "wb")
        self.stdout = open(events_r, "rb")
        self._lock = threading.Lock()

    def poll(self):
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # (reaped elsewhere: its status is lost)
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"tfdist agent {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
