"""Who am I: the cluster this process belongs to, from TF_CONFIG or Slurm, validated.

This is the one module that reads TF_CONFIG and Slurm's variables. Everything else gets a
`ClusterSpec`.

Example:

    >>> from tfdist.runtime import cluster
    >>> spec = cluster.from_tf_config(
    ...     '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},'
    ...     ' "task": {"type": "worker", "index": 1}}')
    >>> spec.is_chief, spec.num_workers
    (False, 2)
    >>> resolver = spec.resolver()           # for tf.distribute strategies
"""
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

from tfdist.errors import EXIT_PREEMPTED, UsageError

PREEMPTION_SIGNALS = ("TERM", "USR1")  # what a server waits out (config.backup's default)

ROLES = ("chief", "worker", "ps", "evaluator")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """`cluster`: role -> list of "host:port"; this process is `task_type`/`task_index`."""
    cluster: dict
    task_type: str
    task_index: int
    source: str = "TF_CONFIG"

    @property
    def is_chief(self):
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def num_workers(self):
        return len(self.cluster.get("chief", [])) + len(self.cluster.get("worker", []))

    @property
    def worker_index(self):
        """Index among chief + workers (chief first), as tf.distribute numbers them."""
        chiefs = len(self.cluster.get("chief", [])) if self.task_type == "worker" else 0
        return self.task_index + chiefs

    def resolver(self):
        import tensorflow as tf
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.cluster), task_type=self.task_type,
            task_id=self.task_index, rpc_layer="grpc")

    def tf_config(self):
        return json.dumps({"cluster": self.cluster,
                           "task": {"type": self.task_type, "index": self.task_index}})


def _check_address(role, addr):
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"TF_CONFIG: address {addr!r} of role '{role}' is not host:port")


def from_tf_config(text, allowed_roles=ROLES):
    """Parses and validates a TF_CONFIG JSON string; UsageError (one line) on any problem."""
    try:
        conf = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"TF_CONFIG is not valid JSON ({e.msg} at char {e.pos}); "
                         f'expected {{"cluster": {{...}}, '
                         f'"task": {{"type": ..., "index": ...}}}}') from None
    if (not isinstance(conf, dict) or not isinstance(conf.get("cluster"), dict)
            or not conf["cluster"]):
        raise UsageError('TF_CONFIG has no "cluster" mapping roles to address lists')
    task = conf.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise UsageError('TF_CONFIG has no "task" with a "type" and an "index"')
    cluster, seen = {}, {}
    for role, addrs in conf["cluster"].items():
        if role not in allowed_roles:
            raise UsageError(f"TF_CONFIG role '{role}' is not used by this strategy "
                             f"(allowed: {', '.join(allowed_roles)})")
        if not isinstance(addrs, list) or not addrs:
            raise UsageError(f"TF_CONFIG role '{role}' must list at least one host:port")
        for a in addrs:
            _check_address(role, a)
            if a in seen:
                raise UsageError(f"TF_CONFIG address {a} is given twice ({seen[a]} and {role})")
            seen[a] = role
        cluster[role] = list(addrs)
    ttype, index = task["type"], task.get("index", 0)
    if ttype not in cluster:
        raise UsageError(f"TF_CONFIG task type '{ttype}' is not a role of the cluster "
                         f"({', '.join(cluster)})")
    if (not isinstance(index, int) or isinstance(index, bool)
            or not 0 <= index < len(cluster[ttype])):
        raise UsageError(f"TF_CONFIG task index {index!r} is out of range for '{ttype}' "
                         f"({len(cluster[ttype])} task(s))")
    if "chief" in cluster and len(cluster["chief"]) != 1:
        raise UsageError("TF_CONFIG must have exactly one chief")
    return ClusterSpec(cluster, ttype, index)


def processes_here(env=None):
    """How many of the job's processes run on this host: Horovod's or MPI's local size, else the
    TF_CONFIG workers (and chief) at this task's host, else 1."""
    env = os.environ if env is None else env
    for key in ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if env.get(key, "").isdigit():
            return int(env[key])
    try:
        tf_config = json.loads(env.get("TF_CONFIG") or "{}")
        task = tf_config["task"]
        cluster = tf_config["cluster"]
        mine = cluster[task["type"]][task["index"]].rsplit(":", 1)[0]
        return sum(a.rsplit(":", 1)[0] == mine for role in ("chief", "worker")
                   for a in cluster.get(role, []))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return 1


def one_local_worker():
    """A cluster of this process alone, on a free port of 127.0.0.1 (`tfdist.strategies.get(
    "auto")` in a process started without a launcher: multi_worker_mirrored of one worker)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return from_tf_config(json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}"]},
                                      "task": {"type": "worker", "index": 0}}))


def from_slurm(port_base=8888, env=None, ps=0):
    """The cluster of a Slurm job step, through TF's SlurmClusterResolver: one task per worker;
    with `ps` > 0 (parameter server), task 0 is the chief, tasks 1..ps the ps tasks, the rest
    workers."""
    import tensorflow as tf
    env = os.environ if env is None else env
    old = {k: os.environ.get(k) for k in env if k.startswith("SLURM_")}
    os.environ.update({k: v for k, v in env.items() if k.startswith("SLURM_")})
    try:
        from tfdist import compat
        per_node = max(compat.slurm_tasks_per_node(
            env.get("SLURM_STEP_TASKS_PER_NODE") or env["SLURM_TASKS_PER_NODE"]))
        # TF's resolver zips each node's task ports with a range over its GPUs, so on CPU-only
        # nodes (gpus_per_node=0) it lists no tasks at all. Give it one "GPU" slot per task and
        # auto_set_gpu=False (it then touches no CUDA_VISIBLE_DEVICES).
        n = int(env["SLURM_NTASKS"])
        jobs = {"worker": n} if not ps else {"chief": 1, "ps": ps, "worker": n - 1 - ps}
        if min(jobs.values()) < 1:
            raise ValueError(f"{n} tasks cannot hold a chief, {ps} ps task(s) and a worker")
        r = tf.distribute.cluster_resolver.SlurmClusterResolver(
            jobs=jobs, port_base=port_base,
            gpus_per_node=per_node, gpus_per_task=1, auto_set_gpu=False)
        spec = r.cluster_spec().as_dict()
        return ClusterSpec({k: list(v) for k, v in spec.items()}, r.task_type, r.task_id, "slurm")
    except (KeyError, ValueError, RuntimeError) as e:
        raise UsageError(f"cannot build the cluster from Slurm's environment ({e}); run inside "
                         f"an sbatch/srun job step or set TF_CONFIG") from None
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def from_environment(allowed_roles=ROLES, env=None):
    """TF_CONFIG if set (Kubernetes TFJob and tfdist's launcher set it), else Slurm, else None.

    Under Slurm, task i of a node listens on TFDIST_SLURM_PORT_BASE + i (default 8888 + i), and
    TFDIST_SLURM_PS=P makes task 0 the chief and tasks 1..P ps tasks (parameter server)."""
    env = os.environ if env is None else env
    if env.get("TF_CONFIG"):
        return from_tf_config(env["TF_CONFIG"], allowed_roles)
    if env.get("SLURM_JOB_ID") and env.get("SLURM_NTASKS"):
        port = env.get("TFDIST_SLURM_PORT_BASE", "8888")  # task i of a node listens on base + i
        if not port.isdigit() or not 0 < int(port) < 65000:
            raise UsageError(f"TFDIST_SLURM_PORT_BASE={port!r} is not a port number")
        ps = env.get("TFDIST_SLURM_PS", "0")
        if not ps.isdigit():
            raise UsageError(f"TFDIST_SLURM_PS={ps!r} is not a number of ps tasks")
        return from_slurm(port_base=int(port), env=env, ps=int(ps))
    return None


def wait_for_tasks(cluster, roles, timeout, how):
    """Returns once every task of `roles` in `cluster` (role -> addresses) accepts a TCP
    connection; after `timeout` seconds, UsageError naming the first that did not (`how`: what
    starts them). TensorFlow would wait for them forever."""
    deadline = time.monotonic() + timeout
    for role in roles:
        for index, address in enumerate(cluster.get(role, [])):
            while not _accepts(address):
                if time.monotonic() > deadline:
                    raise UsageError(f"{role} {index} at {address} did not answer within "
                                     f"{timeout:g} s; start every task of the cluster ({how}) "
                                     f"and check TF_CONFIG")
                time.sleep(0.5)


def start_server(spec):
    """This task's `tf.distribute.Server` (a parameter server's worker or ps task), started; it
    serves while the returned object lives."""
    import tensorflow as tf
    # The server runs the coordinator's ops with its own thread pools, sized by this config;
    # `tf.config.threading` (set by `tfdist train`) does not reach them. One inter-op thread
    # deadlocks a worker (a function's receive from the ps waits on the only thread), so at
    # least 2; they mostly wait, the compute is in the intra-op pool.
    threads = tf.config.threading
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=threads.get_intra_op_parallelism_threads(),
        inter_op_parallelism_threads=max(2, threads.get_inter_op_parallelism_threads()))
    server = tf.distribute.Server(tf.train.ClusterSpec(spec.cluster), job_name=spec.task_type,
                                  task_index=spec.task_index, config=config, protocol="grpc",
                                  start=True)
    print(f"tfdist: {spec.task_type} {spec.task_index} serving at "
          f"{spec.cluster[spec.task_type][spec.task_index]}", flush=True)
    return server


def serve_until_chief_gone(spec, orphan_timeout, grace=45.0):
    """Runs this task's server (`start_server`) until the chief, after having been up, has been
    unreachable for `orphan_timeout` seconds. Returns the exit status: 0, or 75 after a
    preemption signal."""
    server = start_server(spec)
    # Preemption stops the whole job: the chief then drains the steps in flight and saves, which
    # needs these servers, so a signal here waits for the chief to go, `grace` s at most.
    signalled = []
    for name in PREEMPTION_SIGNALS:
        signal.signal(getattr(signal, "SIG" + name),
                      lambda n, f: signalled.append(time.monotonic()))
    wait_until_gone(spec.cluster["chief"][0], orphan_timeout, signalled, grace)
    why = (f"preempted: the chief is gone or {grace:g} s have passed" if signalled else
           f"the chief has been gone for {orphan_timeout:g} s")
    print(f"tfdist: {why}; {spec.task_type} {spec.task_index} stops", flush=True)
    del server
    return EXIT_PREEMPTED if signalled else 0


def wait_until_gone(address, timeout, signalled=(), grace=0.0):
    """Returns once `address`, after having accepted a connection, has refused them for
    `timeout` seconds (a chief whose run is over), or, once `signalled` holds the time of a
    signal, when `address` refuses or `grace` seconds have passed since. Polls twice a second:
    often enough to see a chief that is up for a second only."""
    seen, down_since = False, None
    while True:
        if _accepts(address):
            seen, down_since = True, None
        else:
            down_since = down_since or time.monotonic()
            if seen and time.monotonic() - down_since > timeout:
                return
            if signalled:
                return
        if signalled and time.monotonic() - signalled[0] > grace:
            return
        time.sleep(0.5)


def _accepts(address):
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


_WATCHDOG = """
import os, select, signal, sys
parent, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], timeout)[0]:  # the parent closes our stdin when done
    try:
        os.kill(parent, 0)
        print("tfdist: error: " + message, file=sys.stderr, flush=True)
        os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


@contextlib.contextmanager
def watchdog(timeout, message):
    """Bounds a wait that Python cannot interrupt (TF blocking in C++ with the GIL held): unless
    the block ends within `timeout` seconds, a small watchdog process prints `tfdist: error:
    <message>` and SIGKILLs this process, which a supervisor then restarts."""
    dog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(timeout),
                            message], stdin=subprocess.PIPE)
    try:
        yield
    finally:
        dog.stdin.close()
        dog.wait(timeout=30)


def grpc_keepalive(seconds):
    """gRPC keepalive on this process's channels (TF's `TF_GRPC_DEFAULT_OPTIONS`, read when TF makes
    its first channel; a value the user set is kept): a ping every `seconds` while a step is in
    flight, `seconds` to answer. A worker cut off is then noticed, and its step runs again on
    another; without it the run stalls until TCP gives up. A single step longer than about
    3 x `seconds` may fail with "Too many pings" and run again (docs/deployment.md, "network
    faults", has the measurements)."""
    if seconds and "TF_GRPC_DEFAULT_OPTIONS" not in os.environ:
        ms = int(seconds * 1000)
        os.environ["TF_GRPC_DEFAULT_OPTIONS"] = (
            f"grpc.keepalive_time_ms={ms},grpc.keepalive_timeout_ms={ms},"
            "grpc.http2.max_pings_without_data=0")


#: The keepers of a process started by `tfdist launch`: {"local": its host's, "peer": another
#: host's or null} (`tfdist.callbacks.memory`); and the plan of a restarted group: the step and
#: the keepers that hold each replica's state (`tfdist.launch.recovery`).
KEEPERS, RECOVERY = "TFDIST_KEEPERS", "TFDIST_RECOVERY"


def keepers(env=None):
    """This process's keepers ({"local", "peer"}), or None when no launcher gave any."""
    return _json_of((os.environ if env is None else env).get(KEEPERS), KEEPERS)


def recovery_plan(env=None):
    """The plan this process restores from (`tfdist.launch.recovery`), or None."""
    return _json_of((os.environ if env is None else env).get(RECOVERY), RECOVERY)


#: What `tfdist launch --islands=N` tells each process of an island (`tfdist.parallel.dp.islands`):
#: its island, the islands, and the address of their exchange.
ISLAND, ISLANDS, EXCHANGE = "TFDIST_ISLAND", "TFDIST_ISLANDS", "TFDIST_EXCHANGE"


def island(env=None):
    """(this process's island, the islands, their exchange's "host:port"): (0, 1, "") when it
    was not started as an island."""
    env = os.environ if env is None else env
    try:
        return int(env.get(ISLAND, 0)), int(env.get(ISLANDS, 1)), env.get(EXCHANGE, "")
    except ValueError:
        raise UsageError(f"{ISLAND} and {ISLANDS} must be integers; they are set by tfdist "
                         f"launch --islands, not by hand") from None


def _json_of(text, name):
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        raise UsageError(f"{name} is not valid JSON; it is set by tfdist launch, not by "
                         f"hand") from None


_BEFORE_HARD_EXIT = []


def before_hard_exit(fn):
    """Registers `fn` to run before this process ends at once (`run_before_hard_exit`: a lost
    peer, whose TF threads may still wait on it): what must not be cut short, the newest
    in-memory snapshot's send (`tfdist.callbacks.memory`)."""
    _BEFORE_HARD_EXIT.append(fn)


def run_before_hard_exit():
    for fn in _BEFORE_HARD_EXIT:
        try:
            fn()
        except Exception:  # noqa: BLE001 (the process ends anyway)
            pass


#: Where a process of a launched job records its exit status: horovodrun and mpirun report any
#: rank's failure as their own status 1, so `tfdist launch` reads the ranks' own (2: bad input,
#: 75: preempted) from here. Set by the launcher for the processes it starts.
EXIT_DIR = "TFDIST_EXIT_DIR"


def report_exit(code, env=None):
    """Records this process's exit status `code` in $TFDIST_EXIT_DIR, as `<rank>.exit` (a
    Horovod or MPI rank, a TF_CONFIG task, else the pid), when the variable is set."""
    env = os.environ if env is None else env
    directory = env.get(EXIT_DIR)
    if not directory or not isinstance(code, int):
        return
    rank = next((env[k] for k in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK") if k in env),
                None)
    if rank is None and env.get("TF_CONFIG"):
        try:
            task = json.loads(env["TF_CONFIG"])["task"]
            rank = f"{task['type']}-{task['index']}"
        except (ValueError, KeyError, TypeError):
            rank = None
    try:
        with open(os.path.join(directory, f"{rank or os.getpid()}.exit"), "w") as f:
            f.write(str(code))
    except OSError:
        pass  # a status nobody can read back is not worth failing the exit for


def reported_exits(directory):
    """{name: status} of the processes that recorded theirs in `directory` (`report_exit`)."""
    out = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if name.endswith(".exit"):
            try:
                with open(os.path.join(directory, name)) as f:
                    out[name[:-len(".exit")]] = int(f.read().strip())
            except (OSError, ValueError):
                continue
    return out
