"""Which workers share a host: the groups of a hierarchical all-reduce.

A job of N workers on H hosts, L on each, has two kinds of group:

* a **local** group: the L workers of one host (they talk through the host's memory or its
  loopback, not its network link);
* a **cross** group: the H workers of equal local rank, one on each host (their traffic is what
  crosses the hosts' links).

Hosts are told apart by their address (the host part of a worker's `TF_CONFIG` address, or
Horovod's `HOROVOD_HOSTNAME`), in the order in which they first appear; a worker's local rank is
its place among its host's workers, in worker order. So the groups are the same whatever order
the workers were started in: four workers placed a, b, a, b make the local groups (0, 2) and
(1, 3) and the cross groups (0, 1) and (2, 3).

Example:

    >>> from tfdist.parallel.dp.hosts import Hosts
    >>> h = Hosts(("a", "b", "a", "b"), rank=2)
    >>> h.local, h.cross, h.local_rank, h.per_host
    ((0, 2), (2, 3), 1, 2)
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Hosts:
    """`of_worker`: the host of each worker (by worker index); `rank`: this worker's index."""
    of_worker: tuple
    rank: int

    @property
    def names(self):
        """The distinct hosts, in order of their first worker."""
        return tuple(dict.fromkeys(self.of_worker))

    def workers_on(self, host):
        return tuple(i for i, h in enumerate(self.of_worker) if h == host)

    @property
    def local(self):
        """The workers of this worker's host, in worker order (its local group)."""
        return self.workers_on(self.of_worker[self.rank])

    @property
    def local_rank(self):
        return self.local.index(self.rank)

    @property
    def host_index(self):
        return self.names.index(self.of_worker[self.rank])

    @property
    def cross(self):
        """The workers of this worker's local rank, one per host, in host order (its cross
        group)."""
        return tuple(self.workers_on(h)[self.local_rank] for h in self.names)

    @property
    def per_host(self):
        """Workers on each host; 0 when the hosts hold different numbers of them."""
        counts = {len(self.workers_on(h)) for h in self.names}
        return counts.pop() if len(counts) == 1 else 0

    def describe(self):
        counts = [len(self.workers_on(h)) for h in self.names]
        return (f"{len(self.of_worker)} worker(s) on {len(counts)} host(s) "
                f"({', '.join(map(str, counts))})")
