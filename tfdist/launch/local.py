"""The local launcher behind `tfdist launch` (its flags: `tfdist/cli/launch.py`): N worker
processes on 127.0.0.1 with their TF_CONFIG, supervised.

    tfdist launch --workers 2 -- --config=configs/gpt_nano.py --workdir=runs/nano-2w
    tfdist launch --workers 2 -- python my_keras_program.py --its --flags

Arguments after `--` that start with `-` are `tfdist train` flags (the launcher adds
`--strategy=<--strategy>`). Otherwise they are the command every worker runs; it finds its place
in the cluster in TF_CONFIG, as under a Kubernetes TFJob.

What it does:

1. `tfdist train` form only: runs `tfdist train --prepare_only` once. That checks the flags,
   prepares the dataset once (not N times at once) and applies `--overwrite`. `--overwrite` is
   not passed on to the workers, because a restarted group must resume, not start over.
2. Picks free 127.0.0.1 ports and starts the workers. Worker i gets TF_CONFIG
   `{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}` and
   TFDIST_RESTART_COUNT. Output is streamed with a `[w<i>]` prefix (and also written to
   `--worker_logs/w<i>.log` if given).
3. Supervises (abort and restart, TF's own design for synchronous training). When a worker exits
   non-zero, the others are stopped (SIGTERM, then SIGKILL) and the group starts again on fresh
   ports. The restart waits `--backoff` seconds, doubling each time up to 60 s, and there are at
   most `--max_restarts` of them. `tfdist train` resumes from its backup at the exact step.

Preemption (`tfdist.runtime.preemption`): SIGTERM or SIGUSR1 to the launcher is passed on to the
workers, which back up the step in progress and exit 75; the launcher waits for them (at most
`preemption_grace` seconds, then SIGKILL) and exits 75 too, which means "run the same command to
resume". A worker that exits 75 by itself (it alone was signalled) restarts the group at once,
without counting a restart.

Exit status: 0 when the run completed. 2 for bad usage: this launcher's flags, the prepare step's,
or a worker that exited 2 (restarting cannot fix that). 1 when the restart budget ran out.
75 when preempted, as above. 128+N when the launcher was stopped by signal N otherwise (the
workers are stopped too). Under horovodrun, which exits 1 whatever a rank's status was, the
ranks' own statuses count: each records its own in TFDIST_EXIT_DIR
(`tfdist.runtime.cluster.report_exit`).

Other hosts (`--hosts=a,b,...`): task k runs on host k mod N, at `<host>:<port>` (from
`--port` on each host); a host that is not this machine is reached with `ssh` (see `Host`),
which needs key-based login and the same paths there, as horovodrun and mpirun do. Each task's
gRPC server listens on its host's address only (the bind shim below, with that address).
A synchronous task that loses a peer (a partitioned host: TF's coordination service misses its
heartbeats for 10 s) exits 69 (`tfdist.errors.EXIT_PEER_LOST`), and the group restarts from
its backup like after any failure; a restarted group waits at start-up for every host, at most
TFDIST_JOIN_TIMEOUT seconds (180), after which each worker is stopped and the group restarted.

Listening only on 127.0.0.1: `tfdist.launch.bind`.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tfdist.errors import EXIT_PREEMPTED
from tfdist.launch import recovery
from tfdist.launch.bind import loopback_shim  # noqa: F401  (tfdist.launch.local's, for callers)
from tfdist.launch.hosts import DEFAULT_PORT, Host, passed_on
from tfdist.launch.output import Output
from tfdist.launch.warm import READY_TIMEOUT, Agent, AgentLost
from tfdist.runtime import cluster as cluster_lib
from tfdist.runtime import process

MAX_BACKOFF = 60.0
RESIZE = "resize"  # what `Supervisor._wait` returns when an elastic group is to be resized


def free_ports(n):
    """n distinct ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def children(pid):
    """PIDs of the direct children of process `pid` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def descendants(pid):
    """PIDs of every process below process `pid` (children, theirs, ...)."""
    found = []
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        found = found + kids
        todo = todo + kids
    return found


def task_of(pid):
    """(type, index) of the task process `pid` runs as, or None: from its title, `tfdist-<task>`
    (a warm one: a fork has no environment block of its own to read;
    `tfdist.runtime.process.set_title`; a Horovod rank `tfdist-r<i>` is ("worker", i)), or its
    TF_CONFIG (a process started cold). With `descendants`, this finds a launcher's worker or ps
    process, e.g. to pause or kill it in a chaos test."""
    try:
        m = _TASK_NAME.match(process.title_of(pid))
        if m:
            return _ROLE_OF[m.group(1)], int(m.group(2))
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        task = json.loads(env[b"TF_CONFIG"])["task"]
        return task["type"], task["index"]
    except (OSError, KeyError, ValueError):
        return None


_ROLE_OF = {"c": "chief", "w": "worker", "ps": "ps", "r": "worker"}
_TASK_NAME = re.compile(r"^tfdist-(c|w|ps|r)(\d+)$")


def task_name(role, index, ranks=False):
    """The short name of a task (its output's prefix, and its process name): c0, w1, ps0; a
    Horovod rank r1."""
    return f"{'r' if ranks else {'chief': 'c', 'worker': 'w'}.get(role, role)}{index}"


def describe_exit(code):
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class Supervisor:
    """Starts `argv` as the tasks `roles` ([(role, index), ...], the first the chief), each
    with its place in the cluster (TF_CONFIG on fresh 127.0.0.1 ports, or on `hosts`; or, with
    `rendezvous`, Horovod's rank variables), and restarts on failure (the strategy plugin's
    `Launch` says how).

    Every process is started by the warm agent of its host (`tfdist.launch.agent`, one per
    host, kept for the whole run): a fork of a process that has imported TensorFlow, Keras and
    tfdist, or, with `warm=False`, a fresh process (an exec). A dead task of a role in
    `restart_alone` is restarted alone, at its address, and rejoins; any other failure restarts
    the whole group. The run is done when the chief exits 0; tasks still running then are
    stopped: at once for `servers`, which never exit by themselves, else after FINISH_GRACE
    seconds. `server_argv`, if given, is what the `servers` run instead of `argv` (a user's own
    program then runs on the other tasks only).

    Example (any program that reads TF_CONFIG):

        from tfdist.launch.local import Supervisor
        code = Supervisor(["python", "-c", "import os; print(os.environ['TF_CONFIG'])"],
                          [("worker", 0), ("worker", 1)], max_restarts=0).run()
    """

    FINISH_GRACE = 120.0  # seconds the others may take to exit after the chief has finished
    preemption_grace = 45.0  # seconds the workers get to back up and exit when preempted

    def __init__(self, argv, roles, *, restart_alone=(), servers=(), max_restarts=3, backoff=2.0,
                 env=None, log_dir=None, output=None, tf_config=True, server_argv=None,
                 hosts=None, port=DEFAULT_PORT, rendezvous=None, warm=True, agents=None,
                 spares=(), recovery=False):
        self.argv = argv
        self.roles = list(roles)
        self.tf_config = tf_config and rendezvous is None
        self.rendezvous = rendezvous  # Horovod's: each task's rank variables (no TF_CONFIG)
        self.hosts = [Host(h) for h in hosts] if hosts else None
        self.port = port
        self.server_argv = server_argv
        self.restart_alone = tuple(restart_alone)
        self.servers = tuple(servers)
        self.n = sum(role == "worker" for role, _ in self.roles)
        self.max_restarts = max_restarts
        self.backoff = backoff
        self.env = dict(os.environ if env is None else env)
        self.log_dir = log_dir
        self.out = output or Output()
        self.warm = warm
        self.agents = dict(agents or {})  # a place (`place_of`) -> its Agent (warm.py)
        self.places = {}  # a place -> its Host (None: this machine, on 127.0.0.1)
        # The spares' places, in the order they take a lost host's place: hosts (--hosts), or
        # agents of their own on this machine ("127.0.0.1#spare1"; a count).
        if isinstance(spares, int):
            spares = [None] * spares
        self.spares = []
        for k, h in enumerate(spares):
            spare = Host(h) if isinstance(h, str) else h
            key = place_of(spare, f"spare{k + 1}")
            self.places[key] = spare
            self.spares.append(key)
        self.recovery = recovery  # a synchronous group whose state goes to its keepers
        self.plan = None  # where the next group's state comes from (tfdist.launch.recovery)
        self.took_over = False  # a spare took a lost host's place: restart at once
        self.stop_signal = None
        self.wake = threading.Event()
        self.restarts = 0
        self.preemptions = 0  # group restarts after a worker's exit 75: not counted in restarts
        self.resized = 0  # group restarts at another size (tfdist.launch.elastic): neither
        self.exit_dir = None  # where the processes record their own exit status (run)
        self.placed = {}

    def say(self, message):
        self.out.line(f"tfdist launch: {message}")

    # -- agents ----------------------------------------------------------------------------------
    def agent(self, place):
        """The agent of `place` (`place_of`), started on first use and again after it was
        lost."""
        agent = self.agents.get(place)
        if agent is None or not agent.alive:
            host = self.places.get(place)
            env = {**self.env, "PYTHONUNBUFFERED": "1"}
            agent = self.agents[place] = Agent(
                env, host=host, warm=self.warm, address=host.address if host else "127.0.0.1",
                remote_env={k: v for k, v in env.items() if passed_on(k, self.env)})
        return agent

    def _ready(self, places):
        """Waits until the agents of `places` have started (in parallel). Returns the places
        whose agent did not: lost."""
        agents = {place: self.agent(place) for place in places}
        lost = []
        for place, agent in agents.items():
            try:
                agent.ready()
            except AgentLost:
                lost.append(place)
        return lost

    def close_agents(self):
        for agent in self.agents.values():
            agent.close()
        self.agents = {}

    # -- the group -------------------------------------------------------------------------------
    def _assign(self):
        """Each task's place, when the group is new (or resized): the hosts round robin, else
        this machine."""
        if set(self.placed) == set(self.roles):
            return
        self.placed = {}
        for k, task in enumerate(self.roles):
            host = round_robin(self.hosts, k)
            self.placed[task] = place_of(host)
            self.places[self.placed[task]] = host

    def _cluster(self):
        """TF_CONFIG's cluster: each task at its host's address, ports from --port on each; on
        this machine alone, fresh 127.0.0.1 ports."""
        self._assign()
        cluster = {}
        hosts = [self.places[self.placed[task]] for task in self.roles]
        if any(hosts):
            used = {}
            for (role, _), host in zip(self.roles, hosts):
                port = self.port + used.get(host.address, 0)
                used[host.address] = used.get(host.address, 0) + 1
                cluster.setdefault(role, []).append(f"{host.address}:{port}")
            return cluster
        ports = iter(free_ports(len(self.roles)))
        for role, _ in self.roles:
            cluster.setdefault(role, []).append(f"127.0.0.1:{next(ports)}")
        return cluster

    def host_of(self, task):
        """The Host of `task` (None: this machine)."""
        return self.places[self.placed[task]]

    def _rank_env(self):
        """{(role, index): Horovod's variables} for the group (`rendezvous`), its server
        started."""
        hosts = [self.host_of(k) for k in self.roles]
        addresses = [h.address if h else "127.0.0.1" for h in hosts]
        interfaces = [(self.agent(self.placed[k]).info or {}).get("interfaces", {}).get(a, "lo")
                      for k, a in zip(self.roles, addresses)]
        envs = self.rendezvous.start(addresses, interfaces, here=rendezvous_address(hosts))
        return dict(zip(self.roles, envs))

    def _spawn(self, cluster, role, index, extra=None):
        name = task_name(role, index, ranks=self.rendezvous is not None)
        env = {**self.env, "PYTHONUNBUFFERED": "1",
               "TFDIST_RESTART_COUNT": str(self.restarts + self.preemptions + self.resized),
               cluster_lib.EXIT_DIR: self.exit_dir, **(extra or {})}
        if self.tf_config:
            env["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                           "task": {"type": role, "index": index}})
        host = self.host_of((role, index))
        argv = self.server_argv if self.server_argv and role in self.servers else self.argv
        if host:  # its gRPC server on the host's address only (the bind shim, if preloaded)
            env["TFDIST_BIND_ADDRESS"] = host.address
        if host and not host.local:
            env = {k: v for k, v in env.items() if passed_on(k, self.env)}
        p = self.agent(self.placed[role, index]).spawn(argv, env, os.getcwd(), name)
        log = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            log = open(os.path.join(self.log_dir, f"{name}.log"), "a")
        t = threading.Thread(target=self.out.pump, args=(p.stdout_fd, f"[{name}] ", log),
                             daemon=True)
        t.start()
        return p, (t, log)

    def _start(self):
        for name in os.listdir(self.exit_dir):  # the last group's statuses
            os.remove(os.path.join(self.exit_dir, name))
        cluster = self._cluster()
        self._ready(sorted({*self.placed.values(), *self.spares}))
        extra = {task: {**self._keepers(task), **recovery.environment(self.plan)}
                 for task in self.roles}
        self.plan = None  # (given to this group; a later failure plans again)
        for task, rank in (self._rank_env() if self.rendezvous else {}).items():
            extra[task].update(rank)
        procs = {}
        pumps = []
        for role, index in self.roles:
            procs[role, index], pump = self._spawn(cluster, role, index, extra.get((role, index)))
            pumps.append(pump)
        for p in procs.values():
            p.started.wait(READY_TIMEOUT)
        pids = ", ".join(str(p.pid) for p in procs.values())
        how = self._how(procs.values())
        if self.rendezvous:
            where = ", ".join(f"{task_name(r, i, True)} {h.address if h else '127.0.0.1'}"
                              for (r, i), h in ((k, self.host_of(k)) for k in self.roles))
            self.say(f"started {len(procs)} Horovod rank(s) {how} ({where}; pids {pids})")
            return cluster, procs, pumps
        where = "; ".join(f"{r}: {', '.join(a)}" for r, a in cluster.items())
        self.say(f"started {len(self.roles)} process(es) {how} ({where}; pids {pids})"
                 if len(cluster) > 1 else
                 f"started {self.n} worker(s) {how} on {', '.join(cluster['worker'])} "
                 f"(pids {pids})")
        return cluster, procs, pumps

    def _keepers(self, task):
        """TFDIST_KEEPERS of `task`: its host's keeper, and a peer's on another host (the next
        task's in the group that is elsewhere) for a shard's copy."""
        place = self.placed[task]
        local = self.agent(place).keeper
        k = self.roles.index(task)
        others = [self.placed[t] for t in self.roles[k + 1:] + self.roles[:k]]
        peer = next((self.agent(p).keeper for p in others if p != place), None)
        return {cluster_lib.KEEPERS: json.dumps({"local": local, "peer": peer})} if local else {}

    def _settle_and_stop(self, procs):
        """After a failure of a group whose state goes to its keepers: once the survivors'
        sends are done, the plan of the next group (`tfdist.launch.recovery`); the survivors are
        then SIGKILLed (their state is in memory, their backups on disk are whole), or, with no
        plan, stopped as usual."""
        keepers = [a.keeper for a in self.agents.values() if a.alive and a.keeper]
        self.plan = recovery.plan(keepers)
        if self.plan is None:
            self.stop_tasks(list(procs.values()))
            return
        self.stop_tasks(list(procs.values()), grace=0.0, sig=signal.SIGKILL)
        self.say(f"the next group's state: {recovery.describe(self.plan)}")

    def _take_over(self, procs):
        """The places lost with their agent (a lost host) given to spares, in order. Returns
        whether a spare took one."""
        lost = sorted({self.placed[k] for k, p in procs.items() if getattr(p, "host_lost", False)}
                      | {place for place in set(self.placed.values())
                         if place in self.agents and not self.agents[place].alive})
        took = False
        for place in lost:
            if not self.spares:
                self.say(f"{self.describe_place(place)} is lost and no spare is left")
                continue
            spare = self.spares.pop(0)
            tasks = [t for t, p in self.placed.items() if p == place]
            for t in tasks:
                self.placed[t] = spare
            self.agents.pop(place, None)
            took = True
            self.say(f"{self.describe_place(place)} is lost: the spare {self.describe_place(spare)}"
                     f" takes its place ({', '.join(f'{r} {i}' for r, i in tasks)}; "
                     f"{len(self.spares)} spare(s) left)")
        return took

    def _watch_spares(self):
        """A spare whose agent ended while it waited is dropped, and said."""
        for place in list(self.spares):
            agent = self.agents.get(place)
            if agent is not None and not agent.alive:
                self.spares.remove(place)
                self.say(f"the spare {self.describe_place(place)} is lost ({agent.lost}); "
                         f"{len(self.spares)} spare(s) left")

    def describe_place(self, place):
        host = self.places.get(place)
        return f"host {host.name}" if host else ("this machine's agent" if "#" not in place
                                                 else f"this machine's {place.split('#')[1]}")

    @staticmethod
    def _how(procs):
        """How processes started: "warm" (forks of a warm agent), "cold" (why), or a mix."""
        hows = [p.how or "not" for p in procs]
        if all(h == "warm" for h in hows):
            return "warm"
        whys = sorted({p.why for p in procs if p.why})
        return f"cold ({'; '.join(whys)})" if all(h == "cold" for h in hows) else (
            f"{hows.count('warm')} warm, {hows.count('cold')} cold ({'; '.join(whys)})")

    def stop_tasks(self, procs, grace=10.0, sig=signal.SIGTERM):
        """`sig` to every process still running, SIGKILL after `grace` seconds. Ours, by PID,
        through the agent of its host; an agent that does not answer then is ended (its host's
        processes die with it)."""
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(timeout=Host.SSH_TIMEOUT)
                except subprocess.TimeoutExpired:  # its host is cut off: end our agent there
                    p.agent.close(timeout=0)
                    p.wait()

    def _wait(self, cluster, procs, pumps):
        """Waits for the group. Returns None if it succeeded, else ((role, index), exit code) of
        a failure that needs a group restart. Dead parameter-server workers are restarted here."""
        chief = self.roles[0]
        chief_done = None
        grace = 0.0 if self.servers else self.FINISH_GRACE
        while True:
            if self.stop_signal:
                return None
            codes = {k: p.poll() for k, p in procs.items()}
            if codes[chief] == 0:
                chief_done = chief_done or time.monotonic()
                others = [k for k, c in codes.items() if c is None]
                if not others or time.monotonic() - chief_done > grace:
                    if others and not self.servers:
                        self.say(f"stopping the workers still running {grace:g} s after the "
                                 f"chief finished")
                    self.stop_tasks([procs[k] for k in others])
                    for k, c in codes.items():
                        if c not in (None, 0) and k != chief:
                            self.say(f"{k[0]} {k[1]} {describe_exit(c)} "
                                     f"after the chief had finished")
                    return None
            self._watch_spares()
            failed = [(k, c) for k, c in codes.items() if c not in (None, 0)]
            if chief_done is None and not failed and self._resize_wanted():
                return RESIZE
            if failed and chief_done is None:
                (role, index), code = failed[0]
                if role not in self.restart_alone or code == 2:
                    return failed[0]
                if self.restarts >= self.max_restarts:
                    return failed[0]
                self.restarts += 1
                self.say(f"{role} {index} {describe_exit(code)}; restarting it alone at "
                         f"{cluster[role][index]} (restart {self.restarts} of {self.max_restarts})")
                procs[role, index], pump = self._spawn(cluster, role, index)
                pumps.append(pump)
            self.wake.wait(0.1)

    # -- what an elastic launcher (tfdist.launch.elastic) changes; fixed membership here ---------
    def _place(self):
        """Before each start: the group's size and places."""

    def _resize_wanted(self):
        """While the group runs (every 0.1 s): whether to stop it at a step boundary, to resize."""
        return False

    def _stop_to_resize(self, procs):
        """Stops the group after `_resize_wanted`; RESIZE, or what `_wait` would have returned."""
        raise NotImplementedError

    def _shrink(self, failure):
        """After a failed group: None for the usual restart; True when it goes on at another
        size without counting a restart; False when it cannot go on."""
        return None

    def _on_signal(self, signum, frame):
        self.stop_signal = signum
        self.wake.set()

    def run(self):
        """Runs the group to completion. Returns the exit status (see the module doc)."""
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM,
                                                                   signal.SIGUSR1)}
        try:
            with tempfile.TemporaryDirectory(prefix="tfdist-exits-") as self.exit_dir:
                return self._run()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.rendezvous:
                self.rendezvous.stop()
            self.close_agents()

    def _run(self):
        while True:
            self._place()
            cluster, procs, pumps = self._start()
            failure = self._wait(cluster, procs, pumps)
            preempted = self.stop_signal in (signal.SIGTERM, signal.SIGUSR1)
            if preempted:  # passed on: each worker backs up its step and exits 75
                self.stop_tasks(list(procs.values()), grace=self.preemption_grace,
                                sig=self.stop_signal)
            elif failure == RESIZE:
                failure = self._stop_to_resize(procs)
            elif (failure and self.recovery and not self.stop_signal
                  and failure[1] not in (EXIT_PREEMPTED, 2)):  # (a crash, a lost host)
                self._settle_and_stop(procs)
            elif failure or self.stop_signal:
                self.stop_tasks(list(procs.values()))
            for t, log in pumps:
                t.join(timeout=5)
                if log:
                    log.close()
            if preempted and procs[self.roles[0]].returncode == EXIT_PREEMPTED:
                self.say(f"preempted ({signal.Signals(self.stop_signal).name}): the workers backed "
                         f"up their step; exit {EXIT_PREEMPTED} (run the same command to resume)")
                return EXIT_PREEMPTED
            if self.stop_signal:
                self.say(f"stopped by {signal.Signals(self.stop_signal).name}; workers stopped")
                return 128 + self.stop_signal
            if failure is None:
                what = ("the chief finished" if self.roles[0][0] == "chief" else
                        f"{self.n} worker(s) finished" if not self.rendezvous else
                        f"{self.n} Horovod rank(s) finished")
                self.say(f"done: {what}"
                         + (f" after {self.restarts} restart(s)" if self.restarts else ""))
                return 0
            if failure == RESIZE:
                continue
            (role, index), code = failure
            if code == EXIT_PREEMPTED:  # a worker was preempted on its own, and backed up: resume
                self.preemptions += 1
                self.say(f"{role} {index} was preempted (exit {EXIT_PREEMPTED}, backup written); "
                         f"restarting the group to resume (not counted as a restart)")
                continue
            if code == 2:
                self.say(f"{role} {index} exited with status 2 (bad usage); not restarting")
                return 2
            took_over = self._take_over(procs)
            shrunk = None if took_over else self._shrink(failure)
            if shrunk is not None:
                if shrunk:
                    continue
                return 1
            if self.restarts >= self.max_restarts:
                print(f"tfdist: error: {role} {index} {describe_exit(code)}; gave up after "
                      f"{self.restarts} restart(s) (--max_restarts={self.max_restarts})",
                      file=sys.stderr, flush=True)
                return 1
            # a spare's takeover is no crash loop: at once
            delay = 0.0 if took_over else min(self.backoff * 2 ** self.restarts, MAX_BACKOFF)
            self.restarts += 1
            self.say(f"{role} {index} {describe_exit(code)}; stopped the others; restart "
                     f"{self.restarts} of {self.max_restarts} in {delay:g} s")
            self.wake.clear()
            self.wake.wait(delay)
            if self.stop_signal:
                return 128 + self.stop_signal


def round_robin(hosts, k):
    """The host of task `k` of a group on `hosts` (None: this machine)."""
    return hosts[k % len(hosts)] if hosts else None


def place_of(host, spare=None):
    """The key of a place a task runs at: its host's address (None: this machine,
    "127.0.0.1"), and for a spare of this machine its own ("127.0.0.1#spare1")."""
    address = host.address if host else "127.0.0.1"
    return f"{address}#{spare}" if spare and host is None else address


def rendezvous_address(hosts):
    """The address the tasks on `hosts` (None: this machine) reach this process at: 127.0.0.1
    for a group here, else this machine's address among the hosts, else the one the kernel
    routes to the first of them from."""
    remote = [h for h in hosts if h is not None]
    if not remote:
        return "127.0.0.1"
    mine = next((h.address for h in remote if h.local), None)
    if mine:
        return mine
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote[0].address, 9))  # (no packet is sent: the route is looked up)
        return s.getsockname()[0]
