"""Horovod's ranks as Ray Train workers: a Ray Train V2 backend that does what `horovodrun --gloo`
does before it starts the ranks (`tfdist launch --engine=ray --strategy=horovod`).

Ray Train V2's own `HorovodTrainer` raises ("not supported and is scheduled to be removed"), and
V1's backend needs V1's worker group. Here, in Ray's train controller, `on_start`:
* asks each worker for its node's address; the ranks are Ray's world ranks, a node's workers
  its local ranks (`SlotInfo`: rank, local and cross rank and sizes, as `horovodrun` assigns);
* starts Horovod's Gloo rendezvous server (`horovod.runner.http.http_server.RendezvousServer`,
  what `horovodrun` starts) on the controller's node, with that plan;
* gives each worker the environment `horovodrun` gives a rank: `HOROVOD_RANK`, `_SIZE`,
  `_LOCAL_RANK`, ..., the rendezvous address and port, `HOROVOD_CONTROLLER=gloo`, and the network
  interface of its node's address (`HOROVOD_GLOO_IFACE`).
`hvd.init()` in each worker then meets the others. `on_shutdown` stops the server. A restart
(a lost worker, a resize) starts a new group: a new server, a new plan.
"""
import dataclasses
import os

from ray.train.backend import Backend, BackendConfig


@dataclasses.dataclass
class HorovodGlooConfig(BackendConfig):
    """Horovod over Gloo on Ray Train workers (`loopback`: all on this machine, met on
    127.0.0.1; Ray's node address here is the machine's outward one)."""
    loopback: bool = False

    @property
    def backend_cls(self):
        return _HorovodGlooBackend


def _node_address(loopback=False):
    import ray
    return "127.0.0.1" if loopback else ray.util.get_node_ip_address()


def _interface_of(address):
    """The network interface that holds `address` on this node (Gloo binds it)."""
    import psutil
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return "lo"


def _set_env(variables):
    """On a worker: `variables`, and the interface of its node's address (Gloo binds it)."""
    os.environ.update(variables)
    os.environ["HOROVOD_GLOO_IFACE"] = _interface_of(variables["HOROVOD_HOSTNAME"])


def slots(addresses):
    """Horovod's SlotInfo of each rank (in order), for the node address of each.

    >>> [s.to_response_string() for s in slots(["a", "a", "b"])]
    ['0,3,0,2,0,2', '1,3,1,2,0,1', '2,3,0,1,1,2']
    """
    from horovod.runner.common.util.hosts import SlotInfo
    hosts = list(dict.fromkeys(addresses))
    local = [addresses[:i].count(a) for i, a in enumerate(addresses)]
    out = []
    for rank, (address, local_rank) in enumerate(zip(addresses, local)):
        # the cross group: the ranks with this local rank, one per host that has it
        with_local = [h for h in hosts if addresses.count(h) > local_rank]
        out.append(SlotInfo(hostname=address, rank=rank, local_rank=local_rank,
                            cross_rank=with_local.index(address), size=len(addresses),
                            local_size=addresses.count(address), cross_size=len(with_local)))
    return out


class _HorovodGlooBackend(Backend):
    def on_start(self, worker_group, backend_config):
        import ray
        from horovod.runner.http.http_server import RendezvousServer
        addresses = worker_group.execute(_node_address, backend_config.loopback)
        plan = slots(addresses)
        self.server = RendezvousServer()
        port = self.server.start()
        self.server.init(plan)
        here = _node_address(backend_config.loopback)
        ray.get([worker_group.execute_single_async(rank, _set_env, {
            "HOROVOD_HOSTNAME": s.hostname, "HOROVOD_RANK": str(s.rank),
            "HOROVOD_SIZE": str(s.size), "HOROVOD_LOCAL_RANK": str(s.local_rank),
            "HOROVOD_LOCAL_SIZE": str(s.local_size), "HOROVOD_CROSS_RANK": str(s.cross_rank),
            "HOROVOD_CROSS_SIZE": str(s.cross_size), "HOROVOD_GLOO_RENDEZVOUS_ADDR": here,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo"}) for rank, s in enumerate(plan)])

    def on_shutdown(self, worker_group, backend_config):
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
            self.server = None
