"""The launcher's side of the warm agents (`tfdist/launch/agent.py`): an agent per host, and the
processes it starts, which the supervisor handles as it handles `subprocess.Popen` objects.

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
import subprocess
import sys
import threading

#: Seconds an agent may take to start (it imports TensorFlow) before it counts as lost.
READY_TIMEOUT = 180.0


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
        if host is not None and not host.local:  # (ssh runs here with `env`)
            argv = host.remote(argv, env if remote_env is None else remote_env)
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
