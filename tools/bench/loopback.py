"""Bytes that processes on 127.0.0.1 send one another, as the benchmarks count them.

    >>> from tools.bench.loopback import loopback_tx
    >>> loopback_tx() >= 0
    True
"""


def loopback_tx():
    """The loopback interface's transmitted bytes so far (/proc/net/dev)."""
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":")[1].split()[8])
    return 0
