"""Across hosts: tools/netcluster.py's network namespaces, each worker on its own address.

Needs root, iproute2 and iptables (`make cluster-tools` installs iptables); without them these
tests are skipped with that reason. Every namespace, veth, bridge, qdisc and rule they make is
removed, and checked to be gone.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import DRIVER, driver, losses, steps_by_worker, wait_until
from tools.netcluster import NetCluster, namespaces


def _missing():
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "iptables"):
        if not shutil.which(tool):
            return f"needs {tool} (make cluster-tools installs iptables; ip and tc: iproute2)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
PORT = 12345  # every host has its own address space: one port for all
STEPS = 20


def _root_links():
    return sorted(line.split()[0] for line in subprocess.run(
        ["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout.splitlines())


def _connects(net, host, address, port):
    probe = ("import socket,sys; s=socket.socket(); s.settimeout(5); "
             "sys.exit(s.connect_ex((sys.argv[1], int(sys.argv[2]))))")
    return net.run(host, [sys.executable, "-c", probe, address, str(port)]).returncode == 0


def _listening(pid):
    """IPv4 (address, port) of the LISTEN sockets in the network namespace of process `pid`;
    a dual-stack socket's v4-mapped address counts as its IPv4 address."""
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A":  # LISTEN
                    continue
                ip, port = cols[1].split(":")
                raw = bytes.fromhex(ip)
                if len(raw) == 16:  # 4 little-endian words
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    raw = raw[12:] if raw[:12] == b"\0" * 10 + b"\xff\xff" else None
                    found.append((".".join(str(b) for b in raw) if raw else "IPv6", int(port, 16)))
                else:
                    found.append((".".join(str(b) for b in raw[::-1]), int(port, 16)))
    return found


def test_the_cluster_is_torn_down_even_after_an_error():
    links = _root_links()
    with pytest.raises(RuntimeError, match="boom"):
        with NetCluster(3, rate="100mbit", loss="5%") as net:
            sleeper = net.popen(0, ["sleep", "600"])
            raise RuntimeError("boom")
    assert sleeper.returncode is not None  # killed by the cluster, by PID
    assert not [s for s in namespaces() if s.startswith(net.name + "-")]
    assert _root_links() == links  # nothing made in the machine's own namespace


def test_a_partition_drops_silently_and_heals():
    with NetCluster(2) as net:
        server = net.popen(1, [sys.executable, "-c",
                               "import socket,time; s=socket.socket(); "
                               f"s.bind(('{net.address(1)}', {PORT})); s.listen(); time.sleep(60)"])
        wait_until(lambda: (net.address(1), PORT) in _listening(server.pid), 30, "the listener",
                   proc=server)
        assert _connects(net, 0, net.address(1), PORT)
        net.partition(1)
        assert not _connects(net, 0, net.address(1), PORT)  # a timeout: dropped, not refused
        net.heal(1)
        assert _connects(net, 0, net.address(1), PORT)


@pytest.mark.slow
def test_mwms_across_two_hosts_equals_single_and_listens_on_its_own_address(tmp_path, data_dir):
    from tfdist.launch.local import loopback_shim
    common = {"data.data_dir": data_dir, "train.steps": STEPS, "train.steps_per_epoch": 10,
              "train.batch_size": 16, "backup.enabled": False}
    driver(tmp_path / "single", {**common, "strategy.name": "single"})
    work = tmp_path / "hosts"
    o = json.dumps({**common, "strategy.name": "multi_worker_mirrored"})
    with NetCluster(2, rate="1gbit") as net:
        cluster = {"worker": [f"{net.address(i)}:{PORT}" for i in range(2)]}
        procs = []
        for i in range(2):
            env = {**os.environ, "TF_CONFIG": json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": i}}),
                "LD_PRELOAD": loopback_shim(), "TFDIST_BIND_ADDRESS": net.address(i)}
            procs.append(net.popen(i, [sys.executable, DRIVER, str(work), o], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        wait_until(lambda: steps_by_worker(work).get(0), 300, "worker 0's first step",
                   proc=procs[0])
        for i, p in enumerate(procs):  # TF's server: the host's own address, no wildcard
            assert (net.address(i), PORT) in _listening(p.pid)
            assert not [a for a, port in _listening(p.pid) if port == PORT and a != net.address(i)]
        assert _connects(net, 1, net.address(0), PORT)  # from another host: yes
        assert not _connects(net, 0, "127.0.0.1", PORT)  # on its own loopback: no
        outs = [p.communicate(timeout=400)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    a, b = losses(tmp_path / "single"), losses(work)
    assert len(a) == len(b) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
