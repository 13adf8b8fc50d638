"""The backup files of ZeRO: each replica's share of the state, beside the chief's checkpoint.

A ZeRO backup of step S is the usual checkpoint (weights, the optimizer's common variables,
step; written by the chief) plus, in <backup>/zero/step-S/, one checkpoint per replica of its
slots (ZeRO-3: and its weights) under the unsplit GPT's names, each followed by a manifest
rank-<r>.json naming them. Every replica writes its shard before the chief's checkpoint index
names step S, so a kill never leaves an index pointing at missing shards. A restore reads, for
each slot it holds now, whichever shard has it: so the backup reshards to any number of
replicas, or none. `tfdist.callbacks.backup` calls these.

The same files, in <backup>/dp/step-S/, hold each worker's own state of a compressed all-reduce
(`tfdist.parallel.dp.compression`: its errors, under the same names on every worker, read back
by the worker that wrote them: `restore_own`).

Example (a shard written and read back):

    >>> import tempfile, tensorflow as tf
    >>> from tfdist.parallel.zero import shards
    >>> d = tempfile.mkdtemp()
    >>> v = {"momentums/w": tf.Variable([1.0, 2.0])}
    >>> shards.save_shard(d, 3, v, rank=0, size=1)
    >>> _ = v["momentums/w"].assign([0.0, 0.0])
    >>> shards.restore_slots(d, 3, v)
    >>> v["momentums/w"].numpy().tolist()
    [1.0, 2.0]
"""
import json
import os
import time

import tensorflow as tf

from tfdist.data.store import write_atomic
from tfdist.errors import UsageError


def split_slots(stage, optimizer_state):
    """(slots, the rest) of `optimizer_state` ({name: variable}, tfdist.models.state): the slots
    are this replica's shard under ZeRO `stage` (a `tfdist.parallel.zero.stage.Stage`, or None:
    nothing is split off)."""
    mine = stage.slots if stage is not None else frozenset()
    parts = {k: getattr(v, "shards", [v]) for k, v in optimizer_state.items()}  # (joined shards)
    slots = {k: v for k, v in optimizer_state.items()
             if mine and all(id(x) in mine for x in parts[k])}
    held = sum(len(parts[k]) for k in slots)
    if held != len(mine):  # a slot joined with another replica's: a partition error
        raise ValueError(f"{len(mine) - held} ZeRO slot(s) are not in the state's names")
    return slots, {k: v for k, v in optimizer_state.items() if k not in slots}


class DamagedShards(UsageError):
    """A backup step whose shards are incomplete: the restore falls back to an older backup.
    `short`: the reason in a few words."""

    def __init__(self, message, short):
        super().__init__(message)
        self.short = short


#: The kinds of shards (`shard_dir`).
KINDS = ("zero", "dp")


def shard_dir(backup_dir, step, kind="zero"):
    """Where step `step`'s shards of `kind` go: "zero" (ZeRO's), or "dp" (each worker's own
    state of the compressed all-reduce: `tfdist.parallel.dp.compression`)."""
    return os.path.join(backup_dir, kind, f"step-{step}")


def save_shard(backup_dir, step, slots, rank, size, weights=None, kind="zero", shared=()):
    """Writes this replica's `slots` ({name: variable}; ZeRO-3: and its `weights`) for step
    `step`, then its manifest. `shared`: the names among `slots` that hold the same on every
    replica (`restore_own` reads them into another number of replicas)."""
    d = shard_dir(backup_dir, step, kind)
    tf.io.gfile.makedirs(d)
    parts = dict(optimizer=slots, **({"weights": weights} if weights else {}))
    tf.train.Checkpoint(**parts).write(os.path.join(d, f"rank-{rank}"))
    write_atomic(os.path.join(d, f"rank-{rank}.json"),
                 json.dumps({"rank": rank, "replicas": size, "names": sorted(slots),
                             "weights": sorted(weights or {}), "shared": sorted(shared)}))


def manifests(backup_dir, step, kind="zero"):
    """The manifests of step `step`'s shards, one per replica that wrote one (`DamagedShards`,
    one line, when one is missing)."""
    d = shard_dir(backup_dir, step, kind)
    found = []
    for path in sorted(tf.io.gfile.glob(os.path.join(d, "rank-*.json"))):
        with tf.io.gfile.GFile(path) as f:
            found.append(json.load(f))
    size = found[0]["replicas"] if found else 0
    missing = sorted(set(range(size)) - {m["rank"] for m in found})
    if not found or missing:
        what = "ZeRO optimizer" if kind == "zero" else "compression state"
        raise DamagedShards(
            short=f"lacks the {what} shard(s) of replica(s) {missing or 'all'}",
            message=(f"backup {backup_dir} at step {step} lacks the {what} shard(s) of "
                     f"replica(s) {missing or 'all'} in {d}; restore that directory, or remove "
                     f"the backup to start over"))
    return found


def wait_for_shards(backup_dir, step, timeout, kind="zero"):
    """Returns once every replica's shard of step `step` is on disk (its manifest, written
    last); TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return manifests(backup_dir, step, kind)
        except DamagedShards as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step}'s shards are incomplete after {timeout:.0f} s: "
                                   f"{e.short}") from None
            time.sleep(0.05)


def restore_slots(backup_dir, step, slots, weights=None):
    """Restores `slots` ({name: variable}), and `weights` (ZeRO-3's), from the shards of step
    `step`. UsageError, one line, when a shard is missing or a variable is in none of them."""
    d = shard_dir(backup_dir, step)
    found = set()  # the names restored
    weights = weights or {}
    for m in manifests(backup_dir, step):
        mine = {k: slots[k] for k in m["names"] if k in slots}
        my_weights = {k: weights[k] for k in m.get("weights", []) if k in weights}
        if mine or my_weights:
            parts = dict(optimizer=mine, **({"weights": my_weights} if my_weights else {}))
            tf.train.Checkpoint(**parts).read(  # (read: no save counter, as written)
                os.path.join(d, f"rank-{m['rank']}")).assert_existing_objects_matched()
        found |= set(mine) | {"weights/" + k for k in my_weights}
    lost = sorted((set(slots) | {"weights/" + k for k in weights}) - found)
    if lost:
        raise UsageError(f"backup {backup_dir} at step {step}: no shard holds {lost[:3]}; it was "
                         f"written for another model")


def shard_weight_names(backup_dir, step):
    """The weights that step `step`'s shards hold (ZeRO-3's; none for stages 1-2)."""
    return {n for m in manifests(backup_dir, step) for n in m.get("weights", [])}


def restore_own(backup_dir, step, variables, rank, size, kind="dp"):
    """Restores `variables` ({name: variable}: each replica's own, under the same names on
    every replica) from replica `rank`'s shard of step `step`, written by `size` replicas.
    Written by another number: only the names in `shared` are read (rank 0's), and the names
    not read are returned (their values stay)."""
    found = manifests(backup_dir, step, kind)
    same = found[0]["replicas"] == size
    source = rank if same else 0
    names = [k for k in next(m for m in found if m["rank"] == source)["names"] if k in variables]
    if not same:
        names = [k for k in names if k in found[0].get("shared", ())]
    tf.train.Checkpoint(optimizer={k: variables[k] for k in names}).read(
        os.path.join(shard_dir(backup_dir, step, kind), f"rank-{source}")).expect_partial()
    return sorted(set(variables) - set(names))


def prune(backup_dir, oldest_kept):
    """Removes the shards of steps before `oldest_kept` (their checkpoints are gone)."""
    for d in tf.io.gfile.glob(os.path.join(backup_dir, "*", "step-*")):
        if os.path.basename(os.path.dirname(d)) in KINDS and \
                int(d.rsplit("-", 1)[1]) < oldest_kept:
            tf.io.gfile.rmtree(d)
