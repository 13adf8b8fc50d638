"""A cluster of hosts on one machine: network namespaces on a bridge, with shaped links (root).

    # (root) up, connect across, down
    .venv/bin/python tools/cluster/netcluster.py check --rate=1gbit

    with NetCluster(2, rate="1gbit", loss="5%") as net:
        net.run(0, ["python", "-c", "..."])          # on host 0; host 1 is net.address(1)

Host i is the namespace `<name>-h<i>` with a loopback and one interface, `eth0`, at
10.213.0.<i+1>/24. Its cable is a veth pair whose other end is on a bridge in a namespace of its
own, `<name>-sw`. Nothing is created in the machine's own namespace: its interfaces, routes and
firewall stay as they were. The hosts have no route beyond their /24 and the bridge no uplink,
so their traffic reaches only each other's addresses.

Links: `rate` caps each host's link in both directions (a `tbf` qdisc on both ends of its
cable); `loss` is the fraction of its packets a host's egress drops (an iptables rule in its
namespace). `partition(i)` silently drops everything on host i's cable (no error reaches the
sender, as with a pulled cable behind a switch); `heal(i)` restores its shaping; `shape(i, ...)`
changes one link (a straggler: a tenth of the rate). Latency is not available: this machine's
kernel has no `netem` qdisc ("Specified qdisc kind is unknown"), so `delay` is refused.

Processes started with `popen`/`run` run in a host's namespace and are the cluster's: `down()`
(the context manager's exit, also after an error) kills those still running, by PID, and every
process left inside the cluster's namespaces (`ip netns pids`: started there by the cluster's own
processes), then deletes the namespaces, which removes the veths, the bridge and the qdiscs.

`ssh`: multi-host launchers (horovodrun, mpirun) start their remote processes with `ssh HOST
COMMAND`. `net.ssh_path()` is a directory holding an `ssh` for the front of PATH that runs
COMMAND with `sh -c` in HOST's namespace (HOST: an address of the cluster), in the caller's
environment, as sshd would on that host. No sshd, keys or login are involved.
"""
import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SUBNET = "10.213.0"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def missing():
    """Why a cluster cannot be made here (None if it can): root, iproute2 and iptables."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "iptables"):
        if not shutil.which(tool):
            return f"needs {tool} (make cluster-tools installs iptables; ip and tc: iproute2)"
    return None


def namespaces():
    """Names of the machine's network namespaces (`ip netns list`)."""
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def root_links():
    """Names of the interfaces in the machine's own network namespace (`ip -br link`)."""
    return sorted(line.split()[0] for line in _ip("-br", "link").stdout.splitlines())


def leftovers(prefix, links_before):
    """What test clusters named `prefix...` left on the machine: their namespaces still there
    (deleting one removes its veths, bridge, qdiscs and rules), and interfaces of the machine's
    own namespace added or gone since `links_before` (`root_links()`). Empty when clean."""
    left = [f"namespace {n}" for n in namespaces() if n.startswith(prefix)]
    now = root_links()
    left += [f"interface {x} added" for x in now if x not in links_before]
    left += [f"interface {x} gone" for x in links_before if x not in now]
    return left


class NetCluster:
    """`n` hosts as network namespaces on one bridge (see the module doc). Needs root."""

    def __init__(self, n, *, rate=None, delay=None, loss=None, name=None):
        self.n = n
        self.name = name or f"tfdist{os.getpid() % 100000}"
        self.link = dict(rate=rate, delay=delay, loss=loss)
        self.links = [dict(self.link) for _ in range(n)]
        self.procs = []
        self.created = []
        self._filtered = {}
        self._ssh_dir = None

    # -- names ----------------------------------------------------------------------------------
    def ns(self, i):
        return f"{self.name}-h{i}"

    @property
    def switch(self):
        return f"{self.name}-sw"

    def address(self, i):
        return f"{SUBNET}.{i + 1}"

    def get_config(self):
        return {"n": self.n, "name": self.name, **self.link}

    # -- life -----------------------------------------------------------------------------------
    def up(self):
        if os.geteuid() != 0:
            raise PermissionError("tools/cluster/netcluster.py needs root (network namespaces)")
        clash = [s for s in namespaces() if s.startswith(self.name + "-")]
        if clash:
            raise RuntimeError(f"namespaces {clash} exist already; remove them (ip netns del) or "
                               f"pick another name")
        try:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.n):
                ns, port = self.ns(i), f"h{i}"
                self._add_ns(ns)
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                    "netns", self.switch)
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                self._shape(i, **self.links[i])
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, ns):
        _ip("netns", "add", ns)
        self.created.append(ns)

    def down(self):
        """Kills the cluster's processes still running (by PID), then deletes its namespaces."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.created:  # what they started there (e.g. through `ssh`), by PID
            self._kill_in(ns)
        for ns in reversed(self.created):
            _ip("netns", "del", ns, check=False)
        self.created = []
        if self._ssh_dir:
            shutil.rmtree(self._ssh_dir, ignore_errors=True)
            self._ssh_dir = None

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    # -- links ----------------------------------------------------------------------------------
    # This machine's kernel has no netem ("Specified qdisc kind is unknown") and no tc
    # classifiers, so: the rate is a token bucket (tbf) on both ends of the cable; loss and
    # partitions are iptables rules in the host's own namespace. Latency cannot be added here.
    def _tbf(self, ns, dev, rate):
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True,
                       timeout=30)
        if rate:
            burst = max(_bits(rate) // 8 // 250, 32768)  # >= rate / HZ, or tbf caps below rate
            subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                            rate, "burst", str(burst), "latency", "50ms"], check=True,
                           capture_output=True, timeout=30)

    def _filter(self, i, loss=None, drop_all=False):
        ns = self.ns(i)
        for chain in ("INPUT", "OUTPUT"):
            subprocess.run(["ip", "netns", "exec", ns, "iptables", "-F", chain], check=True,
                           capture_output=True, timeout=30)
        rules = []
        if drop_all:  # both ways, silently (DROP, not REJECT); the host's loopback still works
            rules = [["INPUT", "-i", "eth0", "-j", "DROP"], ["OUTPUT", "-o", "eth0", "-j", "DROP"]]
        elif loss:
            rules = [["OUTPUT", "-o", "eth0", "-m", "statistic", "--mode", "random",
                      "--probability", str(_fraction(loss)), "-j", "DROP"]]
        for r in rules:
            subprocess.run(["ip", "netns", "exec", ns, "iptables", "-A", *r], check=True,
                           capture_output=True, timeout=30)

    def _shape(self, i, rate=None, delay=None, loss=None, drop_all=False):
        if delay:
            raise ValueError("this kernel has no netem: link latency cannot be added here")
        self._tbf(self.ns(i), "eth0", rate)
        self._tbf(self.switch, f"h{i}", rate)
        if loss or drop_all or self._filtered.get(i):
            self._filter(i, loss, drop_all)
            self._filtered[i] = bool(loss or drop_all)

    def shape(self, i, *, rate=None, loss=None):
        """Changes host i's link (None keeps a setting)."""
        for k, v in dict(rate=rate, loss=loss).items():
            if v is not None:
                self.links[i][k] = v
        self._shape(i, **self.links[i])

    @staticmethod
    def _kill_in(ns):
        pids = [int(pid) for pid in _ip("netns", "pids", ns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def kill(self, i):
        """SIGKILLs every process on host i (in its namespace: what the cluster's processes
        started there), as a host that dies. Returns their PIDs."""
        return self._kill_in(self.ns(i))

    def partition(self, i):
        """Host i's cable drops everything, both ways, without an error to the sender."""
        self._filter(i, drop_all=True)
        self._filtered[i] = True

    def heal(self, i):
        self._shape(i, **self.links[i])

    # -- processes ------------------------------------------------------------------------------
    def command(self, i, cmd):
        return ["ip", "netns", "exec", self.ns(i), *cmd]

    def popen(self, i, cmd, **kwargs):
        """Starts `cmd` on host i (a Popen the cluster kills at `down`)."""
        p = subprocess.Popen(self.command(i, cmd), **kwargs)
        self.procs.append(p)
        return p

    def host_of(self, address):
        """The index of the host with `address` (or `user@address`), or None."""
        address = address.rsplit("@", 1)[-1]
        for i in range(self.n):
            if address == self.address(i):
                return i
        return None

    def ssh_path(self):
        """A directory with an `ssh` that runs its command on a host of this cluster (module doc);
        put it first on PATH. Removed at `down`."""
        if self._ssh_dir is None:
            self._ssh_dir = tempfile.mkdtemp(prefix=f"{self.name}-ssh-")
            script = os.path.join(self._ssh_dir, "ssh")
            with open(script, "w") as f:
                f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                        f"{shlex.quote(os.path.abspath(__file__))} ssh --name={self.name} "
                        f"--hosts={self.n} -- \"$@\"\n")
            os.chmod(script, 0o755)
        return self._ssh_dir

    def run(self, i, cmd, timeout=60, **kwargs):
        p = self.popen(i, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _bits(rate):
    """bits/s of a tc rate ("1gbit", "100mbit", "500kbit")."""
    for unit, f in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if rate.endswith(unit):
            return int(float(rate[:-len(unit)]) * f)
    raise ValueError(f"rate {rate!r}: give e.g. 1gbit, 100mbit")


def _fraction(loss):
    """0.05 from "5%" or 0.05."""
    return float(str(loss).rstrip("%")) / 100 if str(loss).endswith("%") else float(loss)


# ssh's options that take a value (OpenSSH's ssh(1)); the others are flags.
_SSH_VALUED = set("BbcDEeFIiJLlmOoPpQRSWw")


def ssh(name, n, argv):
    """`ssh [options] HOST COMMAND...` for the cluster `name` of `n` hosts: replaces this process
    with COMMAND under `sh -c` in HOST's namespace. Options are accepted and ignored."""
    words = []
    target = None
    i = 0
    while i < len(argv):  # as ssh(1): options before the host and right after it, then COMMAND
        a = argv[i]
        if a == "--" and target is None:
            target, words, i = (argv[i + 1], [], i + 2) if i + 1 < len(argv) else (None, [], i + 1)
            break
        if a.startswith("-") and len(a) > 1:
            i += 2 if len(a) == 2 and a[1] in _SSH_VALUED else 1
        elif target is None:
            target, i = a, i + 1
        else:
            break
    words = argv[i:]
    if target is None:
        sys.exit("netcluster ssh: no host given")
    net = NetCluster(n, name=name)
    host = net.host_of(target)
    command = " ".join(words)
    if host is None:  # as ssh says for a host it cannot resolve; exit status 255, as ssh's
        sys.stderr.write(f"ssh: Could not resolve hostname {target}: not a host of {name}\n")
        sys.exit(255)
    if not command:
        sys.stderr.write("netcluster ssh: no command (an interactive login is not offered)\n")
        sys.exit(255)
    os.execvp("ip", ["ip", "netns", "exec", net.ns(host), "sh", "-c", command])


def main():
    if sys.argv[1:2] == ["ssh"]:  # the `ssh` of ssh_path(): options are ssh's, after `--`
        ap = argparse.ArgumentParser(prog="netcluster.py ssh")
        ap.add_argument("--name", required=True)
        ap.add_argument("--hosts", type=int, required=True)
        split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
        args = ap.parse_args(sys.argv[2:split])
        return ssh(args.name, args.hosts, sys.argv[split + 1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["check"])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    args = ap.parse_args()
    probe = ("import socket,sys; s=socket.socket(); s.settimeout(5); "
             "s.connect((sys.argv[1], int(sys.argv[2]))); print('connected to', sys.argv[1])")
    with NetCluster(args.hosts, rate=args.rate) as net:
        server = net.popen(args.hosts - 1, [sys.executable, "-c",
                                            "import socket,time; s=socket.socket(); "
                                            f"s.bind(('{net.address(args.hosts - 1)}', 7000)); "
                                            "s.listen(); s.accept(); time.sleep(1)"])
        time.sleep(1)
        p = net.run(0, [sys.executable, "-c", probe, net.address(args.hosts - 1), "7000"])
        print((p.stdout or p.stderr).strip())
        server.wait(timeout=10)
        print(f"{net.n} hosts: {net.get_config()}")
    left = [s for s in namespaces() if s.startswith(net.name + "-")]
    print("left behind:", left or "nothing")
    return 1 if left or p.returncode else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # the with block still tears down
    sys.exit(main())
