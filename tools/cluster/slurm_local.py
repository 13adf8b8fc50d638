"""A real Slurm on this machine, for tests: Debian's slurm-wlm as one node, or as one node per
host of a tools/cluster/netcluster.py cluster, started and stopped.

    .venv/bin/python tools/cluster/slurm_local.py check     # (root) up, `srun -n 2 hostname`, down

    with LocalSlurm(cpus=2) as slurm:               # slurm.env: SLURM_CONF for sbatch/srun/...
        subprocess.run(["sbatch", "--wait", ...], env={**os.environ, **slurm.env})

    with NetCluster(2) as net, LocalSlurm(net=net) as slurm:   # nodes h0, h1: a node per host
        net.run(0, ["srun", "-N", "2", "hostname"], env={**os.environ, **slurm.env})

With a cluster, slurmctld runs on host 0 (`SlurmctldHost=<this host>(<host 0's address>)`) and
node hi is a slurmd on host i (`slurmd -N hi`, `NodeAddr=<host i's address>`), started with
`nsenter --net` so that it keeps the machine's /sys/fs/cgroup (`ip netns exec` mounts a sysfs of
its own, where slurmd's cgroup plugin fails). The client commands run on host 0. Killing a
host's processes (`net.kill(i)`) and cutting its link loses that node: slurmctld marks it down
after `SlurmdTimeout` (10 s).

It needs root and Debian's `slurm-wlm` and `munge` (`make cluster-tools` installs them). The
set-up is the one measured in shared/DESIGN.md: a munge key (made if missing), `munged`, then
`slurmctld` and one `slurmd` with a minimal `slurm.conf` written into a scratch directory:
`SlurmctldHost` = `NodeName` = this host's short name, root as SlurmUser and SlurmdUser,
`proctrack/linuxproc`, `task/none`, `select/cons_tres` with `CR_CPU`, one partition with
`OverSubscribe=YES`, and state, spool, pid and log files in the scratch directory. Its ports
(default 16817/16818) are on this machine; nothing else is changed but the munge key when none
existed. `down()` stops the daemons it started (by PID) and removes the scratch directory.
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


def missing():
    """Why a local Slurm cannot start here (None if it can)."""
    if os.geteuid() != 0:
        return "needs root (it runs slurmctld and slurmd)"
    absent = [d for d in DAEMONS if not shutil.which(d)]
    if absent:
        return (f"needs Debian's slurm-wlm and munge ({', '.join(absent)} not found; "
                f"make cluster-tools installs them)")
    return None


class LocalSlurm:
    """One-node Slurm (see the module doc). `env` holds SLURM_CONF for the client commands."""

    def __init__(self, cpus=2, port=16817, net=None):
        self.cpus = cpus
        self.port = port
        self.net = net
        self.host = socket.gethostname().split(".")[0]
        self.dir = None
        self.procs = {}
        self.env = {}

    def get_config(self):
        return {"cpus": self.cpus, "port": self.port, "host": self.host}

    def up(self, timeout=60):
        why = missing()
        if why:
            raise RuntimeError(why)
        self.dir = tempfile.mkdtemp(prefix="tfdist-slurm-")
        nodes = [f"h{i}" for i in range(self.net.n)] if self.net else [self.host]
        for sub in ("state", *(f"spool-{n}" for n in nodes)):
            os.makedirs(os.path.join(self.dir, sub))
        conf = os.path.join(self.dir, "slurm.conf")
        if self.net:  # the controller on host 0; node hi on host i, at its address
            where = f"({self.net.address(0)})"
            lines = [f"NodeName={n} NodeAddr={self.net.address(i)} CPUs={self.cpus} State=UNKNOWN"
                     for i, n in enumerate(nodes)]
        else:
            where = ""
            lines = [f"NodeName={self.host} CPUs={self.cpus} State=UNKNOWN"]
        with open(conf, "w") as f:
            f.write(f"""ClusterName=tfdist
SlurmctldHost={self.host}{where}
SlurmctldPort={self.port}
SlurmdPort={self.port + 1}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation={self.dir}/state
SlurmdSpoolDir={self.dir}/spool-%n
SlurmctldPidFile={self.dir}/slurmctld.pid
SlurmdPidFile={self.dir}/slurmd-%n.pid
SlurmctldLogFile={self.dir}/slurmctld.log
SlurmdLogFile={self.dir}/slurmd-%n.log
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
KillWait=10
SlurmdTimeout=10
{chr(10).join(lines)}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self.env = {"SLURM_CONF": conf}
        try:
            self._munge()
            env = {**os.environ, **self.env}
            quiet = dict(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            self.procs["slurmctld"] = subprocess.Popen(self.on(0, ["slurmctld", "-D", "-f", conf]),
                                                       **quiet)
            # `nsenter --net` keeps /sys/fs/cgroup (`ip netns exec` mounts a sysfs of its own)
            for i, n in enumerate(nodes):
                self.procs[f"slurmd-{n}"] = subprocess.Popen(
                    ([*self.on(i, [], enter=True)] if self.net else []) +
                    ["slurmd", "-D", *(["-N", n] if self.net else []), "-f", conf], **quiet)
            deadline = time.monotonic() + timeout
            while True:
                p = subprocess.run(self.on(0, ["sinfo", "-h", "-N", "-o", "%T"]), env=env,
                                   capture_output=True, text=True, timeout=30)
                states = p.stdout.split()
                if p.returncode == 0 and len(states) == len(nodes) and set(states) <= {
                        "idle", "mixed", "allocated"}:
                    break
                dead = [n for n, q in self.procs.items() if q.poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"slurm did not come up ({', '.join(dead) or 'timeout'}; "
                                       f"sinfo: {p.stdout.strip() or p.stderr.strip()}); logs in "
                                       f"{self.dir}: {self.log()[-1500:]}")
                time.sleep(0.5)
        except BaseException:
            self.down()
            raise
        return self

    def on(self, i, argv, enter=False):
        """`argv` on node i: in host i's namespace with a NetCluster (`enter`: nsenter, which
        keeps this mount namespace), else here."""
        if not self.net:
            return argv
        if enter:
            return ["nsenter", f"--net=/run/netns/{self.net.ns(i)}", *argv]
        return self.net.command(i, argv)

    def _munge(self):
        """munged with the machine's key (made, as Debian's postinst would, when missing)."""
        key = "/etc/munge/munge.key"
        if not os.path.exists(key):
            subprocess.run(["mungekey", "--create", "--keyfile", key], check=True, timeout=30)
            shutil.chown(key, "munge", "munge")
            os.chmod(key, 0o400)
        alive = subprocess.run(["munge", "-n"], capture_output=True, timeout=30).returncode == 0
        if not alive:
            os.makedirs("/run/munge", exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            # runs as munge, in the background; it stays for other users of this machine's key
            subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], check=True,
                           timeout=30)

    def log(self):
        out = []
        for name in sorted(os.listdir(self.dir or ".")) if self.dir else []:
            path = os.path.join(self.dir, name)
            if name.endswith(".log"):
                with open(path) as f:
                    out.append(f"--- {name}\n" + f.read()[-3000:])
        return "\n".join(out)

    def down(self):
        for name in sorted(self.procs, reverse=True):  # the slurmds, then slurmctld
            p = self.procs.pop(name, None)
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["check"])
    ap.parse_args()
    with LocalSlurm() as slurm:
        p = subprocess.run(["srun", "-n", "2", "hostname"], env={**os.environ, **slurm.env},
                           capture_output=True, text=True, timeout=120)
        print(p.stdout.strip() or p.stderr.strip())
    return p.returncode


if __name__ == "__main__":
    sys.exit(main())
