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

from tfdist.strategies.horovod import rank_env, slots


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
    """On a worker: `variables`, with the interface of its node's address (Gloo binds it)."""
    os.environ.update(variables)
    os.environ["HOROVOD_GLOO_IFACE"] = _interface_of(variables["HOROVOD_HOSTNAME"])


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
        ray.get([worker_group.execute_single_async(rank, _set_env, rank_env(s, here, port, "lo"))
                 for rank, s in enumerate(plan)])

    def on_shutdown(self, worker_group, backend_config):
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
            self.server = None
