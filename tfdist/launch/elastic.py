"""Elastic `tfdist launch`: the group's size follows the hosts that are there.

    tfdist launch --strategy=horovod --workers=2 --min_workers=1 --max_workers=3 \\
        --discovery="cat hosts.txt" -- --config=configs/gpt_nano.py

Which hosts are there:

* `--discovery=CMD` is run (`sh -c`, at most 10 s) at the start and every `--discovery_interval`
  seconds. It prints one host per line, `host:slots` or `host` (one slot): Horovod's
  `--host-discovery-script` convention. A command that fails or prints anything else is said in
  one line, and the hosts it printed last stay (at the start: `--hosts`, or none). Without it,
  the `--hosts` list (or this machine) offers the `--max_workers` slots round robin.
* A host is there when it is offered and answers: a TCP connection to its first task port
  (`--port`) is accepted or refused within 1 s. A refusal is an answer; a dead host, or a cut
  link, gives none. This machine's own addresses always answer.

What changes the size, always at a step boundary and from a consistent state:

* **Shrinking.** When the group fails it is stopped, as without elasticity, and each of its hosts
  has `--rejoin_timeout` seconds to be there again. If all are, this is the usual restart (counted
  against `--max_restarts`). Those that are not are dropped, and the group starts again at once
  on the rest, from the newest backup, without counting a restart. Below `--min_workers` the job
  ends (exit 1). Progress lost: the steps since the newest backup.
* **Growing.** When the hosts offer more slots than the group has (up to `--max_workers`), the
  group is asked to stop after its step in progress: the processes get SIGUSR1, agree after the
  step (`tfdist.runtime.preemption`; `tfdist train` holds the signal while it starts,
  `tfdist.runtime.early`), back that step up and exit 75. The group starts again at the new size
  from that backup: no step is lost. (A program that does not handle SIGUSR1, or `horovod` with
  no rank on this machine, restarts from its newest backup instead.)

The global batch is the same at every size: `tfdist train`'s `train.batch_size` is the global
batch, each of N replicas reads its N-th of the same rows (`tfdist.data.pipeline`), and the step
count and learning-rate schedule follow the global step. The launcher checks before starting
that every size from `--min_workers` to `--max_workers` splits the batch. Resizes are not
counted as restarts; each is said in one line, and every logged step in metrics.json carries
its `replicas`.

The launcher itself is the job's one controller, as horovodrun's driver is: losing its host ends
the job (resume it with the same command, from the newest backup).
"""
import itertools
import re
import signal
import socket
import subprocess
import threading
import time

from tfdist.errors import EXIT_PREEMPTED, UsageError
from tfdist.launch.hosts import Host
from tfdist.launch.local import RESIZE, Supervisor

_LINE = re.compile(r"^([A-Za-z0-9._-]+)(?::(\d+))?$")


def parse_hosts(text):
    """[(host, slots)] of a discovery command's output; ValueError (naming the line) otherwise.

        >>> parse_hosts("10.0.0.1:2\\nnode-b\\n")
        [('10.0.0.1', 2), ('node-b', 1)]
    """
    hosts = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"'{line[:60]}' is not host or host:slots")
        hosts.append((m.group(1), int(m.group(2) or 1)))
    return hosts


class Membership:
    """The hosts offered (by `discovery` or `hosts`) that answer, as worker slots.

        >>> m = Membership(hosts=["127.0.0.1"], max_workers=2, port=12345, say=print)
        >>> m.offer()
        ['127.0.0.1', '127.0.0.1']
    """

    PROBE_TIMEOUT = 1.0
    DISCOVERY_TIMEOUT = 10.0

    def __init__(self, *, hosts=None, discovery=None, max_workers, port, say=print):
        self.discovery = discovery
        self.max_workers = max_workers
        self.port = port
        self.say = say
        names = hosts or ["127.0.0.1"]
        counts = {}
        # round robin, as --hosts places a fixed group
        for k in range(max(max_workers, len(names))):
            counts[names[k % len(names)]] = counts.get(names[k % len(names)], 0) + 1
        self.offered = [] if discovery and not hosts else list(counts.items())
        self._lock = threading.Lock()  # (the launcher's loop and its watcher both ask)
        self._hosts = {}
        self._said = None

    def host(self, name):
        if name not in self._hosts:
            self._hosts[name] = Host(name)
        return self._hosts[name]

    def _discover(self):
        """Runs the discovery command; keeps the hosts it offered last if it fails."""
        try:
            p = subprocess.run(["sh", "-c", self.discovery], capture_output=True, text=True,
                               timeout=self.DISCOVERY_TIMEOUT, stdin=subprocess.DEVNULL)
            if p.returncode:
                last = (p.stderr.strip().splitlines() or ["no output on stderr"])[-1]
                raise ValueError(f"exited with status {p.returncode} ({last[:100]})")
            hosts = parse_hosts(p.stdout)
            for name, _ in hosts:
                self.host(name)  # resolvable
        except (ValueError, UsageError, OSError, subprocess.TimeoutExpired) as e:
            why = (f"took over {self.DISCOVERY_TIMEOUT:g} s"
                   if isinstance(e, subprocess.TimeoutExpired)
                   else str(e).replace("--hosts: ", ""))
            if why != self._said:  # once per distinct failure, not every interval
                self.say(f"--discovery={self.discovery!r} failed: {why}; keeping the hosts it "
                         f"printed last ({self.describe(self.offered) or 'none'})")
            self._said = why
            return
        self._said = None
        self.offered = hosts

    def answers(self, name):
        host = self.host(name)
        if host.local:
            return True
        try:
            socket.create_connection((host.address, self.port), timeout=self.PROBE_TIMEOUT).close()
            return True
        except ConnectionRefusedError:
            return True  # the host is up; nothing listens there now
        except OSError:
            return False

    def offer(self):
        """One host name per worker slot there now, the hosts in turn, at most `max_workers`."""
        with self._lock:
            if self.discovery:
                self._discover()
            there = [[name] * n for name, n in self.offered if self.answers(name)]
            slots = [name for turn in itertools.zip_longest(*there) for name in turn if name]
            return slots[:self.max_workers]  # round robin: the first N spread over the hosts

    @staticmethod
    def describe(hosts):
        if hosts and isinstance(hosts[0], str):
            hosts = [(h, hosts.count(h)) for h in dict.fromkeys(hosts)]
        return ", ".join(f"{h}:{n}" for h, n in hosts)


class ElasticSupervisor(Supervisor):
    """A `Supervisor` whose group has between `min_workers` and `max_workers` workers, placed on
    the slots `membership` offers (see the module doc). `program` is what each worker runs (a
    Horovod rank, with `rendezvous`)."""

    def __init__(self, program, membership, *, workers, min_workers, rejoin_timeout, interval,
                 **kwargs):
        super().__init__(program, [("worker", 0)], **kwargs)
        self.program = program
        self.membership = membership
        membership.say = self.say
        self.start_workers = workers
        self.min_workers = min_workers
        self.rejoin_timeout = rejoin_timeout
        self.interval = interval
        self.workers = None  # the host of each worker of the group
        self._grow = threading.Event()
        self._watching = None
        self._offered = []
        self._done = threading.Event()

    def _place(self):
        if self.workers is None:  # the first start: the hosts there, within the bound
            offer = self._await(lambda o: len(o) >= self.min_workers)
            if len(offer) < self.min_workers:
                raise UsageError(f"only {len(offer)} worker slot(s) answer "
                                 f"({self.membership.describe(offer) or 'none'}) after "
                                 f"{self.rejoin_timeout:g} s; --min_workers is {self.min_workers}")
            self.workers = offer[:max(self.start_workers, self.min_workers)]
        n = len(self.workers)
        remote = [h for h in self.workers if not self.membership.host(h).local]
        self.n = n
        self.hosts = [self.membership.host(h) for h in self.workers] if remote else None
        self.roles = [("worker", i) for i in range(n)]
        self.say(f"elastic: {n} worker(s) on {self.membership.describe(self.workers)} "
                 f"(between {self.min_workers} and {self.membership.max_workers})")
        self._grow.clear()
        if self._watching is None:
            self._watching = threading.Thread(target=self._watch, daemon=True)
            self._watching.start()

    def _await(self, ready):
        """The offer, polled every second until `ready(offer)` or `rejoin_timeout`."""
        deadline = time.monotonic() + self.rejoin_timeout
        offer = self.membership.offer()
        while not ready(offer) and time.monotonic() < deadline and not self.stop_signal:
            self.wake.wait(1.0)
            offer = self.membership.offer()
        return offer

    def run(self):
        try:
            return super().run()
        finally:
            self._done.set()  # the watcher ends

    def _watch(self):
        """Every `interval` s: more slots offered than the group has asks for a resize."""
        while not self.stop_signal and not self._done.wait(self.interval):
            workers = self.workers
            if workers and not self._grow.is_set():
                self._offered = self.membership.offer()
                if len(self._offered) > len(workers):
                    self._grow.set()

    def _resize_wanted(self):
        # (the watcher may have judged a group that has since grown)
        return self._grow.is_set() and len(self._offered) > len(self.workers)

    def _stop_to_resize(self, procs):
        """SIGUSR1 to the processes: they back up the step in progress and exit 75."""
        grown = self._offered
        self.say(f"elastic: {self.membership.describe(grown)} offered; stopping the group after "
                 f"its step in progress to grow from {self.n} to {len(grown)} worker(s)")
        self.stop_tasks(list(procs.values()), grace=self.preemption_grace, sig=signal.SIGUSR1)
        code = procs[self.roles[0]].returncode
        if code == 0:
            return None  # it finished meanwhile
        # A process not yet (or no longer) training dies of the signal: a restart costs nothing
        # then (tfdist train's restarted group finds a finished run and exits 0).
        by_signal = code in (-signal.SIGUSR1, 128 + signal.SIGUSR1)
        if code != EXIT_PREEMPTED and not by_signal:
            return self.roles[0], code
        self.resized += 1
        self.say(f"elastic: the group stopped (exit {code}: "
                 + ("it backed up its step" if code == EXIT_PREEMPTED
                    else "it resumes from its newest backup")
                 + f"); growing to {len(grown)} worker(s)")
        self.workers = grown
        return RESIZE

    def _shrink(self, failure):
        group = list(self.workers)

        def back(offer):
            return all(offer.count(h) >= group.count(h) for h in set(group))
        offer = self._await(back)
        if back(offer):
            return None  # every host is there again: the usual restart
        gone = [h if group.count(h) == 1
                else f"{group.count(h) - offer.count(h)} of {h}'s {group.count(h)} slots"
                for h in dict.fromkeys(group) if offer.count(h) < group.count(h)]
        if len(offer) < self.min_workers:
            self.say(f"error: {', '.join(gone)} not back within --rejoin_timeout="
                     f"{self.rejoin_timeout:g} s, and {len(offer)} worker slot(s) are below "
                     f"--min_workers={self.min_workers}; giving up")
            return False
        self.resized += 1
        self.say(f"elastic: {', '.join(gone)} not back within {self.rejoin_timeout:g} s: dropped; "
                 f"going on with {len(offer)} worker(s) from the newest backup (not counted as a "
                 f"restart)")
        self.workers = offer
        return True
