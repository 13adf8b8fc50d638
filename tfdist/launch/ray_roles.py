"""TF_CONFIG for Ray Train workers, with roles (a chief, workers, ps tasks): a Ray Train V2
backend (`tfdist launch --engine=ray`, every strategy with a TF_CONFIG: multi_worker_mirrored's
worker tasks, `--strategy=parameter_server --workers 2 --ps 1`'s chief, workers and ps tasks).

Ray's own TensorflowConfig writes worker tasks only (ray/train/tensorflow/config.py), which a
parameter server's cluster cannot use, at the address Ray finds for the node (on a Ray started
here for the run, this machine's outward one, not 127.0.0.1, measured). Here, in Ray's train
controller, `on_start`:
* asks each worker for a free port on its node's address (127.0.0.1 with `loopback`: every
  worker on this machine);
* gives the roles out in world-rank order, `roles` as given (("chief", 1), ("worker", 2),
  ("ps", 1)): rank 0 is the chief, then the workers, then the ps tasks; without `roles`, every
  worker of the group (of whatever size Ray gave it) is a worker task, worker 0 the chief;
* sets each worker's TF_CONFIG: the whole cluster, and its own task.
A restart (a lost worker, a resize) starts a new group: new ports, new TF_CONFIGs, the same roles.

The chief runs `tfdist train` (or the program); the others only serve (`serve`). Ray Train's
`ray.train.report` is a barrier every worker must reach, and only the chief trains, so the servers
follow it: before each of its reports the chief broadcasts `REPORT` and the servers report too
(no metrics of their own); once its run is over it broadcasts `END`, and the servers return,
which ends the group. Any failure (a lost server too) fails the group and Ray restarts all of it:
tfdist's own launcher restarts a lost worker alone instead.
"""
import dataclasses
import json
import os

from ray.train.backend import Backend, BackendConfig

REPORT, END = "report", "end"  # what the chief broadcasts to the servers


@dataclasses.dataclass
class RolesConfig(BackendConfig):
    """`roles`: ((role, count), ...) in world-rank order, the first the chief (None: worker tasks
    only, as many as the group has); `loopback`: the tasks listen on 127.0.0.1."""
    roles: tuple = None
    loopback: bool = False

    @property
    def backend_cls(self):
        return _RolesBackend


def tasks(roles):
    """(role, index) of each world rank.

    >>> tasks((("chief", 1), ("worker", 2), ("ps", 1)))
    [('chief', 0), ('worker', 0), ('worker', 1), ('ps', 0)]
    """
    return [(role, i) for role, n in roles for i in range(n)]


def tf_configs(roles, addresses):
    """The TF_CONFIG of each world rank, given each rank's "host:port".

    >>> c = tf_configs((("chief", 1), ("ps", 1)), ["a:1", "b:2"])
    >>> json.loads(c[1])
    {'cluster': {'chief': ['a:1'], 'ps': ['b:2']}, 'task': {'type': 'ps', 'index': 0}}
    """
    ranks = tasks(roles)
    cluster = {}
    for (role, _), address in zip(ranks, addresses):
        cluster.setdefault(role, []).append(address)
    return [json.dumps({"cluster": cluster, "task": {"type": role, "index": i}})
            for role, i in ranks]


def _address_and_port(loopback):
    from ray.train._internal.utils import get_address_and_port
    address, port = get_address_and_port()
    address = "127.0.0.1" if loopback else address
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"  # (IPv6 in brackets)


def _set_tf_config(text):
    os.environ["TF_CONFIG"] = text


class _RolesBackend(Backend):
    def on_start(self, worker_group, backend_config):
        import ray
        roles = backend_config.roles or (("worker", len(worker_group)),)
        if len(worker_group) != sum(n for _, n in roles):
            raise RuntimeError(f"{len(worker_group)} Ray Train workers for the tasks {roles}")
        addresses = worker_group.execute(_address_and_port, backend_config.loopback)
        ray.get([worker_group.execute_single_async(rank, _set_tf_config, text)
                 for rank, text in enumerate(tf_configs(roles, addresses))])


# -- on each Ray Train worker ---------------------------------------------------------------------
def serve(strategy_class, spec, options):
    """A server task (`spec`: its ClusterSpec): its server, started by `strategy_class` with its
    `options`, serves until the chief broadcasts END; at each REPORT it joins the chief's report.
    """
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero
    # (kept while the process lives: Ray ends the group's processes once every worker returned)
    _SERVERS.append(strategy_class.start_server(spec, **options))
    while (what := broadcast_from_rank_zero(None)) != END:
        assert what == REPORT, what
        ray.train.report({})
    print(f"tfdist: the chief is done; {spec.task_type} {spec.task_index} stops", flush=True)


_SERVERS = []


def tell_servers(what):
    """On the chief: `what` (REPORT or END) to every server task (a barrier with them)."""
    from ray.train.collective import broadcast_from_rank_zero
    broadcast_from_rank_zero(what)
