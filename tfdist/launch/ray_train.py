"""`tfdist launch --engine=ray`: tfdist's workers as Ray Train workers (Ray Train V2's
`DataParallelTrainer`, with `tfdist.launch.ray_roles`'s backend for a TF_CONFIG, or
`tfdist.launch.ray_horovod`'s for Horovod's ranks), on a Ray cluster at `--address` or on a Ray
started here for the run.

    tfdist launch --engine=ray --workers 2 -- --config=configs/gpt_nano.py --workdir=runs/r
    tfdist launch --engine=ray --address=10.0.0.1:6379 --workers 4 --min_workers 2 -- ...
    tfdist launch --engine=ray --strategy=parameter_server --workers 2 --ps 1 -- ...

What runs where:
* The launcher checks the config and prepares the data once (`tfdist train --prepare_only`, as
  `tfdist launch` does), connects to Ray, and runs one trainer whose `train_loop_per_worker` is
  `worker_loop`: each Ray Train worker runs `tfdist train` in its own process, with its
  TF_CONFIG (worker tasks: worker 0 is the chief; or the parameter server's chief, workers and ps
  tasks, of which only the chief trains and the others serve), or, for Horovod, the environment
  `horovodrun` would give its rank.
* Progress and metrics go to Ray with `ray.train.report` at every epoch end (a barrier every
  worker reaches at the same step): the step, the epoch, the training and validation losses.
* Backups: tfdist's own (asynchronous, sharded under ZeRO) in `<workdir>/backup`, which every
  node must see, as Ray's `storage_path` must be (`--storage`, by default `<workdir>/ray`). The
  checkpoint the chief reports with each epoch's metrics is a pointer to them (`tfdist.json`:
  the step and the backup directory), so Ray's result names the step a restart resumes at; the
  state itself is not copied.
* Faults and resizes are Ray's: a worker that dies fails the group, and Ray starts it again (at
  most `--max_restarts` times: `FailureConfig(max_failures=...)`), with `num_workers=(min, max)`
  on as many workers as the cluster has then. Each start resumes from the newest backup at its
  exact step, resharded to the new size; the global batch stays the same at every size. Before
  Ray resizes a healthy group, its workers back up the step they are at (`ray_resize`), so a
  grow loses no step.

Only strategies whose plugin says so run here (`Launch.ray`); the error names them.
"""
import json
import os
import socket
import sys
import tempfile

from tfdist.errors import UsageError

EXTRA = "pip install 'tfdist[ray]' (ray[train]==2.60.0)"
REACH_TIMEOUT = 10.0  # seconds: a TCP connection to --address, before anything is prepared
CONNECT_TIMEOUT = 15.0  # seconds: ray.init on it (which waits on a silent port for minutes)


def require_ray():
    """UsageError, naming the extra, when Ray Train is not installed."""
    try:
        import ray.train  # noqa: F401  (not TensorFlow: its trainer is imported by `run`)
    except ImportError as e:
        raise UsageError(f"--engine=ray needs Ray Train, which is not installed here ({e}): "
                         f"{EXTRA}") from None


def check_reachable(address, timeout=REACH_TIMEOUT):
    """UsageError, within `timeout` seconds, when nothing listens at `address` (HOST:PORT, the
    head node's GCS)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--address={address}: give the Ray head's HOST:PORT (`ray start "
                         f"--head` prints it, port 6379 by default)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise UsageError(_unreachable(address, e)) from None


def _unreachable(address, why):
    port = address.rpartition(":")[2]
    return (f"cannot reach a Ray cluster at {address} ({why}): start one there with `ray start "
            f"--head --port={port}`, or leave --address out to start Ray here for this run")


# Each worker's line once (Ray Train's print patch also sends prints to its logger, and the
# driver showed each line twice), without colour codes.
QUIET = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_COLOR_PREFIX": "0"}

# Ray 2.60 workaround: after a node is lost, an elastic group's restart can ask for the lost
# node's workers too. ElasticScalingPolicy (ray/train/v2/_internal/execution/scaling_policy/
# elastic.py) reads the AutoscalingCoordinator's reservations without `recompute`, and the
# coordinator refreshes its view of the nodes every 20 s (DefaultAutoscalingCoordinator.
# TICK_INTERVAL_S); ray-project/ray#66001 added the recompute for callers that pin workers. The
# group then waits for a placement group that cannot be placed until RAY_TRAIN_WORKER_GROUP_START_
# TIMEOUT_S (60 s by default) and retries (a controller error: it does not count against
# --max_restarts). Measured on 3 nodes here: on 1 worker 71 s after the kill, against ~25 s
# once that wait is 15 s. Remove when Ray's elastic policy recomputes after a failure.
START_TIMEOUT = ("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "15")


def connect(address, workers=1):
    """`ray.init` on the cluster at `address` (a UsageError, or after CONNECT_TIMEOUT seconds one
    line and exit 2, when it is not a Ray cluster); without one, the cluster RAY_ADDRESS names
    (as `ray job submit` sets it), else a Ray for this run on this machine, with a CPU for each of
    the `workers` (at least this machine's CPUs). Returns whether Ray was started here."""
    import threading

    import ray
    variable, seconds = START_TIMEOUT
    env_vars = {**QUIET, variable: os.environ.get(variable, seconds)}  # (a user's value wins)
    runtime_env = {"env_vars": env_vars}
    os.environ.update(env_vars)  # (the driver prints the workers' lines; and a Ray started here)
    if not address and os.environ.get("RAY_ADDRESS"):
        ray.init(configure_logging=False, runtime_env=runtime_env)  # (Ray reads the variable)
        return False
    if not address:  # ("local": not a cluster an earlier `ray start` left in /tmp/ray)
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 configure_logging=False, runtime_env=runtime_env,
                 num_cpus=max(os.cpu_count() or 1, workers))
        return True

    # Ray's C++ client logs each retry on file descriptor 2 while it connects: held back, and
    # passed on only once connected (a failure is said in one line instead)
    sys.stderr.flush()
    saved, held = os.dup(2), tempfile.TemporaryFile()
    os.dup2(held.fileno(), 2)

    def give_up():  # (ray.init cannot be interrupted; nothing has started on the cluster)
        os.dup2(saved, 2)
        print(f"tfdist: error: {_unreachable(address, f'no answer within {CONNECT_TIMEOUT:g} s')}",
              file=sys.stderr, flush=True)
        os._exit(2)
    watchdog = threading.Timer(CONNECT_TIMEOUT, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        ray.init(address=address, configure_logging=False, runtime_env=runtime_env)
    except ConnectionError as e:
        raise UsageError(_unreachable(address, e)) from None
    else:
        held.seek(0)
        said = held.read().decode(errors="replace")
    finally:
        watchdog.cancel()
        os.dup2(saved, 2)
        os.close(saved)
        held.close()
    sys.stderr.write(said)
    return False


def _backend_config(backend, roles, loopback):
    """Ray Train V2's DataParallelTrainer's backend for a plugin's `Launch.ray_backend` (`roles`:
    its TF_CONFIG tasks, None for worker tasks only; `loopback`: every worker on this machine)."""
    if backend == "horovod_gloo":
        from tfdist.launch.ray_horovod import HorovodGlooConfig
        return HorovodGlooConfig(loopback=loopback)
    from tfdist.launch.ray_roles import RolesConfig
    return RolesConfig(roles=roles, loopback=loopback)


def on_ray():
    """The strategies whose processes run as Ray Train workers (their plugin's `Launch.ray`)."""
    from tfdist import strategies
    return [s for s in strategies.names()
            if getattr(strategies.get_class(s).launch, "ray", "") is None]


def trainer(strategy, train_loop_per_worker, loopback=False, **kwargs):
    """Ray Train's trainer for a user's own program under tfdist's `strategy` (a name), so that
    the program is the same under every strategy: its loop calls `tfdist.strategies.get(...)`,
    and the strategy's plugin says how Ray readies the workers (`Launch.ray_backend`: a TF_CONFIG
    of worker tasks, worker 0 the chief, for multi_worker_mirrored; Horovod's Gloo rendezvous for
    horovod). `kwargs` go to Ray Train V2's `DataParallelTrainer` (train_loop_config,
    scaling_config, run_config, ...); `loopback`: every worker on this machine, listening on
    127.0.0.1. A UsageError in one line without Ray, or for a strategy whose processes are not
    Ray Train workers or that has tasks which only serve (`tfdist launch --engine=ray` runs
    those).

        trainer("horovod", loop, train_loop_config=config,
                scaling_config=ScalingConfig(num_workers=2)).fit()   # (launchers/ray/)
    """
    from tfdist import strategies
    require_ray()
    launch = strategies.get_class(strategy).launch
    if launch is None or launch.ray is not None or launch.servers:
        why = ("it runs in one process" if launch is None else launch.ray or
               f"its {', '.join(launch.servers)} tasks only serve: run the program with "
               f"`tfdist launch --engine=ray --strategy={strategy} -- python PROGRAM`")
        able = [s for s in on_ray() if not strategies.get_class(s).launch.servers]
        raise UsageError(f"a Ray Train trainer cannot run strategy {strategy}: {why}; it runs "
                         f"{', '.join(able)}")
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    return DataParallelTrainer(
        train_loop_per_worker,
        backend_config=_backend_config(launch.ray_backend, None, loopback=loopback), **kwargs)


def run(train_args, strategy, storage, workers, elastic=None, max_restarts=3, address=None,
        backend="tensorflow", program=None, resize_interval=60.0, roles=None, servers=()):
    """Runs `tfdist train <train_args> --strategy=<strategy>` (or the Python `program`, its argv)
    as `workers` Ray Train workers, with Ray's results in `storage` (`elastic`: (min, max)
    workers instead, a resize considered every `resize_interval` seconds), readied by Ray Train
    `backend` (`Launch.ray_backend`). `roles` ((role, count), ...: the chief first), when given,
    instead of `workers`: those of `servers` only serve (`tfdist.launch.ray_roles`).
    Returns the exit status: 0 once the run finished, 1 when Ray gave up."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    if roles:
        workers = sum(n for _, n in roles)
    here = connect(address, max(elastic or (workers,)))
    callbacks = None
    if elastic:
        from tfdist.launch.ray_resize import StopBeforeResize
        callbacks = [StopBeforeResize()]
    trainer = DataParallelTrainer(
        worker_loop, backend_config=_backend_config(backend, roles, loopback=here),
        train_loop_config={"args": list(train_args), "strategy": strategy, "cwd": os.getcwd(),
                           "program": program, "servers": list(servers),
                           "elastic": bool(elastic)},
        scaling_config=ScalingConfig(num_workers=tuple(elastic) if elastic else workers,
                                     resources_per_worker={"CPU": 1},
                                     elastic_resize_monitor_interval_s=resize_interval),
        run_config=RunConfig(name="tfdist", storage_path=os.path.abspath(storage),
                             failure_config=FailureConfig(max_failures=max_restarts),
                             callbacks=callbacks))
    try:
        result = trainer.fit()
    except Exception as e:  # Ray's TrainingFailedError: the workers' own errors are above
        print(f"tfdist launch: Ray gave up after {max_restarts} restart(s): "
              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)
        return 1
    finally:
        ray.shutdown()
    step = _checkpoint_step(result.checkpoint)
    print(f"tfdist launch: done: Ray Train finished the run (last reported: {result.metrics}; "
          f"backup pointer at step {step})", flush=True)
    return 0


def _checkpoint_step(checkpoint):
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        with open(os.path.join(d, POINTER)) as f:
            return json.load(f)["step"]


# -- on each Ray Train worker ---------------------------------------------------------------------
POINTER = "tfdist.json"


def worker_loop(config):
    """A Ray Train worker: `tfdist train` in this process (or the Python program given instead),
    reporting to Ray at each epoch end of every `tfdist.train.train` run in it; or, on a server
    task of a strategy that has them (`config["servers"]`), its server until the chief is done."""
    # Not tf_keras (Ray's own TensorflowConfig sets TF_USE_LEGACY_KERAS=1 for it, in
    # ray/train/tensorflow/config.py, `_setup_tensorflow_environment`): tfdist is Keras 3.
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    os.chdir(config["cwd"])  # (Ray starts its workers in a directory of its session)
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # (as `tfdist train`: TF's collectives chat at INFO)
    program = config.get("program")
    sys.argv = list(program) if program else [
        "tfdist train", *config["args"], f"--strategy={config['strategy']}"]
    from tfdist import cli
    cli.quiet_tensorflow_import()
    from tfdist import train
    from tfdist.errors import EXIT_PEER_LOST, PeerLost
    from tfdist.runtime import cluster
    servers = config.get("servers") or ()
    spec = cluster.from_environment() if servers else None
    if spec is not None and spec.task_type in servers:
        from tfdist.launch import ray_roles
        from tfdist.strategies import get_class
        from tfdist.strategies import options_of as get_options
        strategy = get_class(config["strategy"])
        ray_roles.serve(strategy, spec, {} if program else get_options(_train_config()[0]))
        return
    from tfdist.runtime.preemption import Preempted
    train.LAUNCHER_CALLBACKS.append(
        lambda c, workdir: _report_callback(c, workdir, followed=bool(servers)))
    try:
        if program:
            _run_program(program)
        else:
            train.train(*_train_config())
    except PeerLost as e:  # TF's threads may wait on the lost peer: end the actor at once
        print(f"tfdist: error: {e}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)
    except Preempted:  # stopped and backed up for Ray's resize (ray_resize): Ray ends the group
        pass
    finally:
        if config.get("elastic"):
            from tfdist.launch import ray_resize
            ray_resize.ENDED.set()
    if servers:
        from tfdist.launch import ray_roles
        ray_roles.tell_servers(ray_roles.END)


def _train_config():
    """`tfdist train`'s config and workdir from sys.argv (its --config.* overrides are read as its
    flags are defined: a new process for each Ray Train worker, so this is the first import)."""
    from absl import flags

    from tfdist.cli import train as train_cli
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv)
    return train_cli.resolve_config(), train_cli.workdir_of()


def _run_program(argv):
    """`python PROGRAM ARGS` (sys.argv) in this process, as its `__main__`; its `sys.exit(0)` is
    an end."""
    import runpy
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    from tfdist.runtime.preemption import Preempted
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except Preempted:
        raise
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(f"{argv[0]} exited with status {e.code}") from None


def program_of(rest):
    """The Python program (its argv) of `tfdist launch --engine=ray -- python PROGRAM ARGS` (or
    `-- PROGRAM.py ARGS`), or None when `rest` are `tfdist train` flags; UsageError for anything
    else (a Ray Train worker runs Python in its own process)."""
    if rest[0].startswith("-"):
        return None
    argv = rest[1:] if os.path.basename(rest[0]).startswith("python") else rest
    if not argv or not argv[0].endswith(".py") or not os.path.isfile(argv[0]):
        raise UsageError(f"--engine=ray runs `tfdist train` (its flags after --) or a Python "
                         f"program (`-- python PROGRAM.py ARGS`), not '{' '.join(rest[:2])}'; a "
                         f"Keras program of your own can also run through its own "
                         f"TensorflowTrainer (launchers/ray/)")
    return argv


def _report_callback(c, workdir, followed=False):
    import ray.train

    from tfdist.runtime import preemption
    from tfdist.runtime.lazy import keras
    from tfdist.train import backup_dir

    class ReportToRay(keras.callbacks.Callback):
        """`ray.train.report` at every epoch end; the chief adds the pointer to the backup (and,
        `followed` by server tasks, tells them to report with it: `ray_roles`)."""

        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            step = (epoch + 1) * c.train.steps_per_epoch
            metrics = {"step": step, "epoch": epoch + 1,
                       **{k: float(v) for k, v in logs.items() if k in ("loss", "val_loss")}}
            if preemption.stopping():  # every worker agreed to stop here: none reports (a
                return  # barrier), as Ray's controller, waiting for the stop, takes no report
            if ray.train.get_context().get_world_rank() != 0:
                ray.train.report(metrics)
                return
            if followed:
                from tfdist.launch import ray_roles
                ray_roles.tell_servers(ray_roles.REPORT)
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, POINTER), "w") as f:
                    json.dump({"step": step, "backup_dir": os.path.abspath(
                        backup_dir(c, workdir))}, f)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))

    return ReportToRay()
