"""A real multi-node Ray cluster on one machine: a `ray start` node on each of
tools/cluster/netcluster.py's hosts, each with its own address (root).

    # (root) a head and two worker nodes, then a run on them from the head's host
    .venv/bin/python tools/cluster/ray_cluster.py check

    with NetCluster(3) as net, RayCluster(net) as ray_nodes:   # head on host 0, nodes on 1, 2
        net.run(0, ["tfdist", "launch", "--engine=ray", f"--address={ray_nodes.address}", ...],
                env=ray_nodes.env)
        ray_nodes.stop(2)            # that node's `ray start` and everything it started, by PID
        ray_nodes.start(2)           # back again

Host 0 runs the head (`ray start --head --num-cpus=0`: it holds Ray's control processes and the
drivers, no Train worker); hosts 1.. each run a node with `cpus` CPUs (one Train worker each by
default). Every node is `ray start --block` in its host's namespace, bound to its host's address
(`--node-ip-address`), so Ray Train ranks them as the separate nodes they are (it ranks nodes by
address), with a temporary directory of its own.

Ray's own `ray stop` is not used: it ends every Ray process on the machine, by name. A node is
stopped here by the process id of its `ray start` (SIGTERM: it stops what it started) and then of
every process left in its host's namespace (SIGKILL, `NetCluster.kill`). The cluster's token
(`RAY_AUTH_TOKEN`, Ray's token authentication, which `ray start --head` turns on) is in `env`: a
driver needs it to connect.
"""
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.cluster.netcluster import NetCluster  # noqa: E402

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
PORT = 6379
START_BOUND = 90.0  # seconds for a node's `ray start` to say it runs
STARTED = "Ray runtime started."
# The GCS's health check of each node: every second, with 0.5 s to answer; 3 missed in a row and
# the node is dead (7.2 s after a SIGKILL and a cut link, measured). With Ray's defaults a node
# cut off here was still alive after 25 s (measured). That is longer than TF's coordination
# service takes to abort the survivors' collectives (10 s): Ray Train then restarted the group on
# both nodes, and waited out its 60 s start timeout for the dead one.
NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "500",
              "RAY_health_check_failure_threshold": "3"}


class RayCluster:
    """Ray nodes on the hosts of the NetCluster `net`: the head on host 0, a node with `cpus`
    CPUs on each other host (see the module doc)."""

    def __init__(self, net, cpus=1):
        self.net = net
        self.cpus = cpus
        self.procs = {}
        self.starts = {}  # node: how many times its log has said it started
        self.dir = tempfile.mkdtemp(prefix=f"{net.name}-ray-")
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(16), **NODE_DEATH}

    @property
    def address(self):
        return f"{self.net.address(0)}:{PORT}"

    def get_config(self):
        return {"hosts": self.net.n, "cpus": self.cpus, "address": self.address}

    def log(self, i):
        return os.path.join(self.dir, f"node{i}.log")

    def start(self, i):
        """Starts the node on host i (the head on host 0) and waits until it runs."""
        head = ["--head", f"--port={PORT}", "--num-cpus=0", "--include-dashboard=false"]
        where = head if i == 0 else [f"--address={self.address}", f"--num-cpus={self.cpus}"]
        cmd = [RAY, "start", "--block", "--disable-usage-stats", *where,
               f"--node-ip-address={self.net.address(i)}",
               f"--temp-dir={os.path.join(self.dir, f'h{i}')}"]
        with open(self.log(i), "a") as log:
            self.procs[i] = self.net.popen(i, cmd, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_BOUND
        while time.monotonic() < deadline:
            with open(self.log(i)) as f:
                said = f.read()
            if said.count(STARTED) > self.starts.get(i, 0):
                self.starts[i] = said.count(STARTED)
                return
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"ray node {i} exited ({self.procs[i].returncode}):\n"
                                   f"{said[-3000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"ray node {i} did not start within {START_BOUND:g} s")

    def up(self):
        try:
            for i in range(self.net.n):
                self.start(i)
        except BaseException:
            self.down()
            raise
        return self

    def stop(self, i, hard=False):
        """Stops the node on host i: its `ray start` (SIGTERM, or SIGKILL when `hard`), then
        every process left on the host (SIGKILL, by PID). Returns those PIDs."""
        p = self.procs.pop(i, None)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        return self.net.kill(i)

    def down(self):
        for i in sorted(self.procs, reverse=True):  # the nodes, then the head
            self.stop(i)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()


def main():
    """`check`: a head and two nodes; a driver on the head's host lists the nodes it sees."""
    probe = ("import sys, ray; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print(sorted((n['NodeManagerAddress'], n['Resources'].get('CPU', 0)) "
             "for n in ray.nodes() if n['Alive']))")
    start = time.monotonic()
    with NetCluster(3, rate="1gbit") as net, RayCluster(net) as nodes:
        up = time.monotonic() - start
        p = net.run(0, [sys.executable, "-c", probe, nodes.address], env=nodes.env, timeout=120)
        print(f"up in {up:.1f} s; nodes: {p.stdout.strip() or p.stderr[-2000:]}")
    return p.returncode


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # the with blocks still tear down
    sys.exit(main())
