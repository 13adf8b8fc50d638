"""`tfdist launch`: the command line of the local launcher (`tfdist.launch.local` does the work).

    tfdist launch --workers 2 -- --config=configs/gpt_nano.py --workdir=runs/nano-2w
    tfdist launch --strategy=parameter_server --workers 2 --ps 1 -- --config=configs/gpt_nano.py
    tfdist launch --strategy=horovod --workers 2 -- --config=configs/gpt_nano.py
    tfdist launch --workers 2 -- python my_keras_program.py --its --flags
    tfdist launch --hosts=node1,node2 --workers 2 -- --config=configs/gpt_nano.py  # one per host
    tfdist launch --workers 2 --min_workers 1 --max_workers 3 --discovery="cat hosts.txt" \\
                  -- --config=configs/gpt_nano.py    # elastic: tfdist/launch/elastic.py
    tfdist launch --engine=ray --workers 2 -- --config=configs/gpt_nano.py  # ray_train.py

See `tfdist/launch/local.py` for what it does, and its exit status.
"""
import os
import shutil
import subprocess
import sys
import threading

from absl import flags

from tfdist import cli, strategies
from tfdist.errors import UsageError
from tfdist.launch import islands as islands_lib
from tfdist.launch.bind import launch_env
from tfdist.launch.hosts import Host
from tfdist.launch.local import (
    DEFAULT_PORT,
    Supervisor,
    place_of,
    round_robin,
)
from tfdist.launch.warm import Agent

_WORKERS = flags.DEFINE_integer("workers", 2, "Number of worker processes.")
_STRATEGY = flags.DEFINE_string("strategy", "multi_worker_mirrored",
                                "Strategy of the workers (one whose plugin declares `launch`: "
                                "multi_worker_mirrored, parameter_server, horovod).")
_PS = flags.DEFINE_integer("ps", 1, "Number of ps tasks, for a strategy with ps tasks "
                           "(parameter_server; a chief, the coordinator, is started too).")
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 3,
                                     "Restarts of the whole group before giving up.")
_BACKOFF = flags.DEFINE_float("backoff", 2.0,
                              "Seconds before the first restart; doubles each time, up to 60.")
_BIND = flags.DEFINE_enum("bind", "loopback", ["loopback", "all"],
                          "loopback: workers listen on 127.0.0.1 only; all: TF's default "
                          "(every interface).")
_HOSTS = flags.DEFINE_list("hosts", None, "Hosts (names or addresses) to run the tasks on, round "
                           "robin; those not this machine through ssh (same paths there). Default: "
                           "all here, on 127.0.0.1.")
_PORT = flags.DEFINE_integer("port", DEFAULT_PORT,
                             "With --hosts: the first port of the tasks on each host.")
_SPARES = flags.DEFINE_integer(
    "spares", 0, "Warm processes kept waiting to take a lost host's place at once, its state "
    "from the surviving processes' memory: the job neither shrinks nor waits for the host. "
    "With --hosts each spare is a host of its own, the last ones of the list.")
_COLD = flags.DEFINE_bool("cold", False, "Start every process fresh (it imports TensorFlow, "
                          "Keras and tfdist itself) instead of as a fork of its host's warm agent, "
                          "which has imported them once (tfdist/launch/agent.py).")
_ISLANDS = flags.DEFINE_integer(
    "islands", None, "Local-SGD islands (DiLoCo, config.dp.islands): the workers as N groups "
    "of --workers / N, each restarted on its own, meeting every dp.sync_every updates at an "
    "exchange this launcher runs (tfdist/launch/islands.py). Default: --config.dp.islands after "
    "--, else 1.")
_LOG_DIR = flags.DEFINE_string("worker_logs", None, "Also write each process's output to "
                               "<worker_logs>/<name>.log (w0, w1, ..., c0, ps0).")


_MIN = flags.DEFINE_integer("min_workers", None, "Elastic (tfdist/launch/elastic.py): the fewest "
                            "workers the job trains on; hosts that fail and are not back within "
                            "--rejoin_timeout are dropped down to it.")
_MAX = flags.DEFINE_integer("max_workers", None, "Elastic: the most workers (default --workers); "
                            "hosts that appear are added up to it.")
_DISCOVERY = flags.DEFINE_string("discovery", None, "Elastic: a shell command printing the hosts "
                                 "there now, one `host:slots` per line (Horovod's "
                                 "--host-discovery-script convention). Default: --hosts.")
_REJOIN = flags.DEFINE_float("rejoin_timeout", 30.0, "Elastic: seconds a failed group's hosts "
                             "have to be there again before they are dropped.")
_INTERVAL = flags.DEFINE_float("discovery_interval", 5.0, "Elastic: seconds between looks for "
                               "new hosts (--engine=ray: for more resources on the cluster, Ray "
                               "Train's elastic_resize_monitor_interval_s).")
_ENGINE = flags.DEFINE_enum("engine", "local", ["local", "ray"], "local: tfdist's own launcher "
                            "(here, or on --hosts); ray: the workers are Ray Train workers "
                            "(tfdist/launch/ray_train.py), which Ray places, restarts and "
                            "resizes (--min_workers, --max_workers).")
_STORAGE = flags.DEFINE_string("storage", None, "--engine=ray: Ray Train's storage_path, which "
                               "every node must see. Default: <workdir>/ray, or runs/ray for a "
                               "program.")
_ADDRESS = flags.DEFINE_string("address", None, "--engine=ray: the Ray cluster's head, HOST:PORT "
                               "(`ray start --head` prints it). Default: a Ray started here for "
                               "the run.")


def _elastic(n, strategy, spec, rest):
    """(min, max) workers when the job is elastic, else None; UsageError for a range that
    cannot run."""
    if _MIN.value is None and _MAX.value is None and _DISCOVERY.value is None:
        return None
    if (_MIN.value is not None and _MIN.value < 1) or (_MAX.value is not None and _MAX.value < 1):
        raise UsageError("--min_workers and --max_workers must be >= 1")
    if _MIN.value is not None and _MAX.value is not None and _MIN.value > _MAX.value:
        raise UsageError(f"--min_workers ({_MIN.value}) is above --max_workers ({_MAX.value}): "
                         f"the job runs on between min and max workers")
    if spec.elastic is not None:
        raise UsageError(f"strategy {strategy} does not resize (--min_workers, --max_workers, "
                         f"--discovery): {spec.elastic}")
    low = n if _MIN.value is None else _MIN.value
    high = max(n, low) if _MAX.value is None else _MAX.value
    if low > n:
        raise UsageError(f"--min_workers ({low}) is above --workers ({n}): the job starts with "
                         f"--workers and shrinks down to --min_workers")
    if not 1 <= low <= n <= high <= 64:
        raise UsageError(f"need 1 <= --min_workers <= --workers <= --max_workers <= 64, got "
                         f"{low} <= {n} <= {high}")
    if _REJOIN.value <= 0 or _INTERVAL.value <= 0:
        raise UsageError("--rejoin_timeout and --discovery_interval must be > 0 seconds")
    if _DISCOVERY.value is not None and not _DISCOVERY.value.strip():
        raise UsageError("--discovery is empty: give a command printing host:slots lines")
    return low, high


def _spares(hosts, spec, strategy, elastic, n):
    """(the hosts of the tasks, the spares: hosts, or a count on this machine) of --spares;
    UsageError for spares that cannot be used."""
    k = _SPARES.value
    if not k:
        return hosts, 0
    if k < 0:
        raise UsageError(f"--spares must be >= 0, got {k}")
    if spec.recovery is not None:
        able = [s for s in strategies.names()
                if getattr(strategies.get_class(s).launch, "recovery", "") is None]
        raise UsageError(f"--spares cannot serve strategy {strategy}: {spec.recovery}; a spare "
                         f"takes a lost host's place under {', '.join(able)}")
    if elastic:
        raise UsageError("--spares keeps the group's size, --min_workers/--max_workers/"
                         "--discovery change it: give one or the other")
    if _MAX_RESTARTS.value == 0:
        raise UsageError("--spares needs restarts: a spare takes a lost host's place when the "
                         "group restarts; set --max_restarts >= 1")
    if hosts is None:
        return None, k  # agents of their own on this machine
    free = len(hosts) - min(len(hosts), n)
    if k > free:
        raise UsageError(f"--spares={k} needs {k} host(s) besides the {min(len(hosts), n)} the "
                         f"{n} worker(s) take, and --hosts has {free} free: add hosts, or ask "
                         f"for fewer spares")
    return hosts[:len(hosts) - k], hosts[len(hosts) - k:]


def _train_argv(args, strategy):
    return [sys.executable, "-m", "tfdist", "train", *args, f"--strategy={strategy}"]


def _prepared(rest, strategy, env, elastic, agent=None):
    """`tfdist train` flags `rest`, checked and prepared once (`_prepare`; its failure ends the
    launcher with its status); returns the workers' flags (without --overwrite: the prepare step
    applied it)."""
    if any(a.startswith("--strategy") for a in rest):
        raise UsageError("give the strategy to tfdist launch (--strategy=...), not after --")
    sizes = ",".join(map(str, range(elastic[0], elastic[1] + 1))) if elastic else ""
    code = _prepare([*rest, f"--strategy={strategy}"], {**env, "TFDIST_ELASTIC_SIZES": sizes},
                    agent)
    if code:
        sys.exit(2 if code == 2 else 1)
    return [a for a in rest if a != "--overwrite" and not a.startswith("--overwrite=")]


def _prepare(args, env, agent=None):
    """`tfdist train <args> --prepare_only` (the config checked, the dataset prepared, the workdir
    readied) once, before any worker starts; its exit status. It runs in a fork of this
    machine's warm agent (`agent`, which the workers' starts use next), else in a process of its
    own. Its output is passed on as it is."""
    argv = [sys.executable, "-m", "tfdist", "train", *args, "--prepare_only"]
    sys.stdout.flush()
    if agent is None:
        return subprocess.run(argv, env=env).returncode
    p = agent.spawn(argv, env, os.getcwd(), "prepare", separate=True)
    copies = [threading.Thread(target=_copy, args=(fd, stream), daemon=True)
              for fd, stream in ((p.stdout_fd, sys.stdout), (p.stderr_fd, sys.stderr))]
    for t in copies:
        t.start()
    code = p.wait()
    for t in copies:
        t.join(timeout=10)
    return code


def _copy(fd, stream):
    """Copies what `fd` gives to `stream` until it closes."""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        stream.buffer.write(chunk)
        stream.flush()
    os.close(fd)


def main(argv):
    rest = argv[1:]
    n, strategy = _WORKERS.value, _STRATEGY.value
    if not rest:
        raise UsageError("nothing to run: put the `tfdist train` flags (or a command) after --, "
                         "e.g. tfdist launch --workers 2 -- --config=configs/gpt_nano.py")
    if not 1 <= n <= 64:
        raise UsageError(f"--workers must be between 1 and 64, got {n}")
    spec = strategies.get_class(strategy).launch
    if spec is None:
        launchable = [s for s in strategies.names() if strategies.get_class(s).launch]
        raise UsageError(f"tfdist launch cannot start strategy '{strategy}'; it starts: "
                         f"{', '.join(launchable)}")
    if "ps" in spec.roles and not 1 <= _PS.value <= 16:
        raise UsageError(f"--ps must be between 1 and 16, got {_PS.value}")
    if _ENGINE.value == "ray":
        if (_ISLANDS.value or 1) > 1 or islands_lib.islands_in(rest) > 1:
            raise UsageError("--islands runs on tfdist's own launcher: drop --engine=ray")
        sys.exit(_on_ray(rest, n, strategy, spec))
    if _ADDRESS.value is not None:
        raise UsageError("--address is the Ray cluster's, for --engine=ray")
    elastic = _elastic(n, strategy, spec, rest)
    if _MAX_RESTARTS.value < 0 or _BACKOFF.value < 0:
        raise UsageError("--max_restarts and --backoff must be >= 0")
    hosts = [h.strip() for h in _HOSTS.value or [] if h.strip()] or None
    if _HOSTS.value is not None and not hosts:
        raise UsageError("--hosts is empty: give host names or addresses, e.g. --hosts=node1,node2")
    hosts, spares = _spares(hosts, spec, strategy, elastic, n)
    if (hosts or elastic) and not 1 <= _PORT.value <= 65535 - 64:
        raise UsageError(f"--port must be between 1 and {65535 - 64}, got {_PORT.value}")
    islands = _ISLANDS.value or (islands_lib.islands_in(rest) if rest[0].startswith("-") else 1)
    if islands > 1 and not islands_lib.is_island():
        islands_lib.check(n, islands)
        if elastic or _SPARES.value:
            raise UsageError("--islands restarts each island on its own: give no --min_workers, "
                             "--max_workers, --discovery or --spares with it")
        islands_lib.split_hosts(hosts, islands)
        at = islands_lib.host_of([Host(name) for name in hosts] if hosts else None)
    env = launch_env(dict(os.environ), _BIND.value)  # (with --hosts: each task its host's address)
    # This machine's agent (the prepare step's, then its workers'): on its address among the
    # hosts, or 127.0.0.1; it imports TensorFlow while the launcher goes on.
    here = next((h for h in (Host(name) for name in hosts or []) if h.local), None)
    agent = Agent({**env, "PYTHONUNBUFFERED": "1"}, host=here,
                  address=here.address if here else "127.0.0.1", warm=not _COLD.value)
    agents = {agent.address: agent}
    if islands > 1 and not islands_lib.is_island():
        try:
            if rest[0].startswith("-"):  # (prepared once, for every island)
                rest = _prepared(rest, strategy, {**env, islands_lib.ISLANDS: str(islands)},
                                 None, agent)  # (as the islands' processes are told)
        finally:
            agent.close()
        given = {"strategy": strategy, "max_restarts": _MAX_RESTARTS.value,
                 "backoff": _BACKOFF.value, "bind": _BIND.value,
                 "cold": _COLD.value or None, "worker_logs": _LOG_DIR.value}
        sys.exit(islands_lib.run(rest, n, islands, hosts, at, islands_lib.launch_flags(given),
                                 _PORT.value, dict(os.environ)))
    try:
        if rest[0].startswith("-") and islands_lib.is_island():  # (prepared by the islands')
            argv = _train_argv([a for a in rest if a != "--overwrite"
                                and not a.startswith("--overwrite=")], strategy)
        elif rest[0].startswith("-"):  # tfdist train flags
            # (the prepare step judges config.dp's hierarchy against where the workers go: the
            # addresses the supervisor places them at)
            at = [Host(name) for name in hosts] if hosts else None
            placed = {"TFDIST_WORKER_HOSTS": ",".join(
                place_of(round_robin(at, k)) for k in range(n))}
            argv = _train_argv(_prepared(rest, strategy, {**env, **placed}, elastic, agent),
                               strategy)
        else:  # any program
            if not (shutil.which(rest[0]) or os.path.isfile(rest[0])):
                raise UsageError(f"cannot run '{rest[0]}': not found (tfdist train flags after "
                                 f"-- start with -, e.g. --config=...)")
            argv = rest
    except BaseException:
        agent.close()
        raise
    server_argv = ([sys.executable, "-m", spec.server_module, strategy]
                   if spec.server_module and not rest[0].startswith("-") else None)

    common = dict(max_restarts=_MAX_RESTARTS.value, backoff=_BACKOFF.value, env=env,
                  log_dir=_LOG_DIR.value, port=_PORT.value, warm=not _COLD.value, agents=agents,
                  rendezvous=spec.rendezvous() if spec.rendezvous else None,
                  recovery=spec.recovery is None)
    if elastic:
        from tfdist.launch.elastic import ElasticSupervisor, Membership
        membership = Membership(hosts=hosts, discovery=_DISCOVERY.value, max_workers=elastic[1],
                                port=_PORT.value)
        code = ElasticSupervisor(argv, membership, workers=n, min_workers=elastic[0],
                                 rejoin_timeout=_REJOIN.value, interval=_INTERVAL.value,
                                 **common).run()
        sys.exit(code)
    roles = [(role, i) for role, count in _role_counts(spec, n) for i in range(count)]
    code = Supervisor(argv, roles, restart_alone=spec.restart_alone, servers=spec.servers,
                      server_argv=server_argv, hosts=hosts, spares=spares, **common).run()
    sys.exit(code)


def _on_ray(rest, n, strategy, spec):
    """`--engine=ray` (tfdist/launch/ray_train.py): checked, prepared once, then run by Ray.
    Returns the exit status."""
    from tfdist.launch import ray_train
    if spec.ray is not None:
        raise UsageError(f"--engine=ray cannot run {strategy}: {spec.ray}. On Ray: "
                         f"{', '.join(ray_train.on_ray())}; {strategy} runs with tfdist "
                         f"launch's own engine (leave --engine out)")
    program = ray_train.program_of(rest)
    if _SPARES.value:
        raise UsageError("--spares is tfdist's own engine's: under --engine=ray Ray places and "
                         "restarts the workers, and keeps no spare (leave --engine out)")
    if _HOSTS.value is not None or _DISCOVERY.value is not None:
        raise UsageError("--hosts and --discovery are tfdist's own engine's: under --engine=ray "
                         "Ray places the workers on its cluster's nodes (--address)")
    if _MAX_RESTARTS.value < 0:
        raise UsageError("--max_restarts must be >= 0")
    ray_train.require_ray()
    elastic = _elastic(n, strategy, spec, rest)
    if _ADDRESS.value is not None:
        ray_train.check_reachable(_ADDRESS.value)
    args = [] if program else _prepared(rest, strategy, dict(os.environ), elastic)
    storage = _STORAGE.value or os.path.join(_workdir_in(args) if args else "runs", "ray")
    return ray_train.run(args, strategy, storage, n, elastic=elastic,
                         max_restarts=_MAX_RESTARTS.value, address=_ADDRESS.value,
                         backend=spec.ray_backend, program=program,
                         resize_interval=_INTERVAL.value,
                         roles=None if spec.roles == ("worker",) else _role_counts(spec, n),
                         servers=spec.servers)


def _role_counts(spec, n):
    """((role, count), ...) of a strategy's cluster (`Launch.roles`) with `n` workers."""
    counts = {"chief": 1, "worker": n, "ps": _PS.value}
    return tuple((role, counts[role]) for role in spec.roles)


def _workdir_in(args):
    """The --workdir of `tfdist train` flags `args` (its default: runs/<config name>)."""
    values = {}
    for i, a in enumerate(args):
        for name in ("--workdir", "--config"):
            if a.startswith(name + "="):
                values[name] = a.split("=", 1)[1]
            elif a == name and i + 1 < len(args):
                values[name] = args[i + 1]
    if "--workdir" in values:
        return values["--workdir"]
    return cli.default_workdir(values.get("--config", cli.DEFAULT_CONFIG).split(":", 1)[0])


def run(argv=None):
    cli.run(main, argv or sys.argv, tensorflow=False)  # (the agents import it, not the launcher)


if __name__ == "__main__":
    run()
