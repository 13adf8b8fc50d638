"""`tfdist launch --islands=N`: local-SGD islands (DiLoCo, `tfdist.parallel.dp.islands`), each a
group of its own, and the exchange where they meet.

    tfdist launch --workers 4 --hosts=a,b --islands 2 -- --config=configs/gpt_mini.py \\
        --config.dp.islands=2 --config.dp.sync_every=50

The launcher prepares the run once, starts the islands' exchange (`tfdist.parallel.dp.exchange`)
in a thread of its own process, and then one `tfdist launch` per island, `--workers / N`
workers each (with `--hosts`, island k on the k-th N-th of them: an island on one host, usually),
told by TFDIST_ISLAND, TFDIST_ISLANDS and TFDIST_EXCHANGE who they are. Each island's launcher
restarts its own group after a failure (its `--max_restarts`): a dead island stops no other, and
its workers, restored from its own backup, rejoin at the exchange. An island's output lines
carry its index: `[i1] [w0] ...`. The run ends when every island's launcher has; its status is
the first failed island's (0 when every island finished).
"""
import signal
import subprocess
import sys
import threading

from tfdist.errors import UsageError
from tfdist.launch.output import Output
from tfdist.parallel.dp import exchange
from tfdist.runtime import cluster
from tfdist.runtime.cluster import EXCHANGE, ISLAND, ISLANDS

#: The ports an island's tasks take on a host (`--port`), so that islands on one host differ.
PORTS_PER_ISLAND = 16


def islands_in(args):
    """`--config.dp.islands` among `tfdist train` flags `args` (1 if absent)."""
    for i, a in enumerate(args):
        if a.startswith("--config.dp.islands="):
            value = a.split("=", 1)[1]
        elif a == "--config.dp.islands" and i + 1 < len(args):
            value = args[i + 1]
        else:
            continue
        try:
            return int(value)
        except ValueError:
            raise UsageError(f"--config.dp.islands={value}: give an integer > 0") from None
    return 1


def split_hosts(hosts, islands):
    """Each island's hosts: the k-th N-th of `hosts` (None: all on this machine). UsageError
    where they do not split evenly."""
    if hosts is None:
        return [None] * islands
    if len(hosts) % islands:
        raise UsageError(f"--hosts has {len(hosts)} host(s), which {islands} islands cannot "
                         f"share evenly: give a multiple of {islands} (island k takes the k-th "
                         f"{islands}th of the list)")
    k = len(hosts) // islands
    return [hosts[i * k:(i + 1) * k] for i in range(islands)]


def check(workers, islands):
    """UsageError, one line, for islands that cannot divide the workers."""
    if islands < 1:
        raise UsageError(f"--islands must be >= 1, got {islands}")
    if workers % islands:
        raise UsageError(f"dp.islands={islands} does not divide --workers={workers}: every "
                         f"island has as many workers; give a multiple of {islands} workers")


def run(argv, workers, islands, hosts, host_address, launch_flags, port, env):
    """Runs `islands` islands of `workers / islands` workers each: `argv` (what follows --, the
    prepared train flags or a program) under `tfdist launch <launch_flags>` per island (island
    k's tasks from port `port` + k x PORTS_PER_ISLAND), the exchange on `host_address` (an
    address every island reaches). Returns the exit status."""
    server = exchange.serve_in_thread(host_address, islands)
    out = Output()
    out.line(f"tfdist launch: {islands} islands of {workers // islands} worker(s), meeting at "
             f"{server.address}")
    procs, pumps = [], []
    for k, chunk in enumerate(split_hosts(hosts, islands)):
        flags = [*launch_flags, f"--workers={workers // islands}",
                 f"--port={port + k * PORTS_PER_ISLAND}"]
        if chunk:
            flags.append(f"--hosts={','.join(chunk)}")
        cmd = [sys.executable, "-m", "tfdist", "launch", *flags, "--", *argv]
        p = subprocess.Popen(cmd, env={**env, ISLAND: str(k), ISLANDS: str(islands),
                                       EXCHANGE: server.address},
                             stdout=subprocess.PIPE, start_new_session=True)
        t = threading.Thread(target=out.pump, args=(p.stdout.fileno(), f"[i{k}] "), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)

    def forward(signum, frame):  # (each island's launcher backs up and stops its group)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    handlers = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=10)
        server.shutdown()
    rounds = server.rounds
    joined = {}
    for _, order in rounds.log:
        for k in order:
            joined[k] = joined.get(k, 0) + 1
    out.line(f"tfdist launch: islands: {rounds.round} round(s) closed; rounds each island sent "
             f"to: {', '.join(f'i{k} {joined.get(k, 0)}' for k in range(islands))}")
    failed = [(k, c) for k, c in enumerate(codes) if c]
    if failed:
        out.line(f"tfdist launch: island(s) {', '.join(f'i{k} (exit {c})' for k, c in failed)} "
                 f"did not finish")
        return failed[0][1]
    return 0


def launch_flags(values):
    """The `tfdist launch` flags each island's launcher gets from this one's `values`
    ({name: value}, None: not given)."""
    return [f"--{name}={value}" for name, value in values.items() if value is not None]


def host_of(hosts):
    """The address the islands reach this launcher at: its own host's among `hosts` (a list of
    `Host`), else 127.0.0.1."""
    here = next((h for h in hosts or [] if h.local), None)
    if hosts and here is None:
        raise UsageError("--islands with --hosts: run tfdist launch on one of the hosts (the "
                         "islands meet at its exchange)")
    return here.address if here else "127.0.0.1"


def is_island():
    """Whether this launcher is one island's (started by `run`)."""
    return cluster.island()[1] > 1
