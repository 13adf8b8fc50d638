"""Where a restarted group's state comes from: the newest step at which the keepers still there
hold every replica's state (`tfdist.callbacks.memory`), or, when none is complete, the disk
backup.

After a failure the launcher asks every keeper it still reaches what it holds, once the pushes
under way there are done (`settle`). Under data parallelism each replica's snapshot is the whole
state, so any one of a step will do; under ZeRO each replica's shard must be held by some keeper
(its own host's, or the peer's copy). The newest step with a complete set is the plan, given to
every process of the new group (TFDIST_RECOVERY) with the keepers that hold each replica's
state. Nothing complete: no plan, and the group resumes from its newest disk backup.

Example (two keepers; replica 1's shard of step 8 is lost with its host, step 6's is kept by a
peer's copy):

    >>> listings = {"a:1": {"held": [
    ...     {"owner": 0, "step": 8, "meta": {"sharded": True, "size": 2}},
    ...     {"owner": 0, "step": 6, "meta": {"sharded": True, "size": 2}},
    ...     {"owner": 1, "step": 6, "meta": {"sharded": True, "size": 2}}]}}
    >>> best(listings)
    {'step': 6, 'sharded': True, 'size': 2, 'sources': {'0': ['a:1'], '1': ['a:1']}}
"""
import concurrent.futures
import json

from tfdist.runtime import keeper
from tfdist.runtime.cluster import KEEPERS, RECOVERY  # noqa: F401  (the variables it sets)


def holdings(addresses, timeout=2.0, quiet=0.2):
    """{address: listing} of the keepers at `addresses` that answer (in parallel), each once
    its pushes under way are done (`keeper.Client.settle`)."""
    def ask(address):
        client = keeper.Client(address, timeout=timeout)
        try:
            return client.settle(timeout, quiet)
        except keeper.KeeperError:
            return None
        finally:
            client.close()
    addresses = sorted(set(a for a in addresses if a))
    with concurrent.futures.ThreadPoolExecutor(max(1, len(addresses))) as pool:
        answers = dict(zip(addresses, pool.map(ask, addresses)))
    return {a: listing for a, listing in answers.items() if listing is not None}


def best(listings):
    """The plan of `listings` (`holdings`): {"step", "sharded", "size", "sources": {owner:
    [addresses]}} of the newest complete step, or None."""
    steps = {}
    for address, listing in sorted(listings.items()):
        for h in listing["held"]:
            meta = h["meta"]
            key = (h["step"], bool(meta.get("sharded")), int(meta.get("size", 1)))
            steps.setdefault(key, {}).setdefault(h["owner"], []).append(address)
    complete = [(key, owners) for key, owners in steps.items()
                if owners and (not key[1] or set(owners) >= set(range(key[2])))]
    if not complete:
        return None
    (step, sharded, size), owners = max(complete, key=lambda c: c[0][0])
    return {"step": step, "sharded": sharded, "size": size,
            "sources": {str(o): sorted(a) for o, a in sorted(owners.items())}}


def plan(addresses, timeout=2.0, quiet=0.2):
    """The plan for a restart from the keepers at `addresses` (None: nothing in memory)."""
    return best(holdings(addresses, timeout, quiet))


def describe(p):
    """One line: where the state comes from."""
    if p is None:
        return "the newest disk backup (no complete state in the keepers' memory)"
    where = sorted({a for addresses in p["sources"].values() for a in addresses})
    return (f"step {p['step']} from the memory of the keeper(s) at {', '.join(where)}"
            + (" (each replica's shard)" if p["sharded"] else ""))


def environment(p):
    """The variable that gives plan `p` to a process."""
    return {RECOVERY: json.dumps(p)} if p is not None else {}
