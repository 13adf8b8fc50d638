"""The training state in memory, on other processes and hosts: each step's snapshot in this
host's keeper (and a ZeRO shard's in a peer host's), and a restarted group's state taken from
there instead of from disk.

Under `tfdist launch` each host has a keeper (`tfdist.runtime.keeper`), a process that outlives
the training processes of its host (a failed group's restart stops them) and dies with the host.

* **Snapshots** (`MemorySnapshots`, a callback after the backup's): after every
  `backup.memory_every_steps` steps (at update boundaries) each process reads its state into host
  memory (`BackupAndRestore.frozen_state`: the same read as an asynchronous backup's), and one
  background thread writes it as that process's own backup files (TF's ram:// file system) and
  sends them to its host's keeper, with the step records metrics.json does not hold yet. A
  process whose state is a ZeRO shard that no other replica holds also sends every
  `backup.peer_every_steps`-th to the keeper of a peer on another host (Gemini, SOSP 2023). A
  newer snapshot replaces one not yet sent; training never waits for one.
* **Recovery** (`restore`): after a failure the launcher asks the keepers still there what they
  hold and picks the newest step at which every replica's state is held by one of them (any
  replica's under data parallelism, which holds it whole; each shard's under ZeRO)
  (`tfdist.launch.recovery`). Every process of the new group, a spare's included, fetches what it
  needs of that step (its own shard and the others' manifests, or everything when the group's
  size changed), lays it out as a backup dir in memory and restores it with
  `BackupAndRestore.restore`: the same code as from disk, so the state is restored exactly, into
  any layout, with its data position (the step). A fetch that fails (a keeper lost meanwhile)
  ends the process as a lost peer (exit 69); the launcher then plans again, from the disk
  backup when no complete set is left in memory.

Example (a snapshot sent to a keeper, and the backup it makes restored from there):

    >>> import tempfile, keras
    >>> from tfdist.callbacks import BackupAndRestore
    >>> from tfdist.callbacks import memory
    >>> from tfdist.runtime import keeper
    >>> server = keeper.serve_in_thread("127.0.0.1")
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse"); model.optimizer.build(model.trainable_variables)
    >>> backup = BackupAndRestore(tempfile.mkdtemp()); backup.set_model(model)
    >>> snaps = memory.MemorySnapshots(backup, {"local": server.address}, rank=0, size=1)
    >>> _ = backup.step.assign(3); snaps.take(3); snaps.wait(timeout=60)
    >>> plan = {"step": 3, "size": 1, "sharded": False, "sources": {"0": [server.address]}}
    >>> memory.restore(backup, model, plan, rank=0, size=1)[0]
    3
    >>> snaps.close(); server.shutdown()
"""
import os
import threading
import time

import keras
import tensorflow as tf

from tfdist.errors import PeerLost
from tfdist.parallel.zero import shards
from tfdist.runtime import keeper


class MemorySnapshots(keras.callbacks.Callback):
    """Sends this process's state after every `every`-th step to its host's keeper (`keepers`:
    {"local": address, "peer": address or None}), and every `peer_every`-th to its peer's when
    it holds a shard no other replica holds. Goes after `backup` (a `BackupAndRestore`, whose
    step it reads) among the callbacks; `log`: the run's `TrainingLog`, whose records not yet in
    metrics.json go with each snapshot."""

    def __init__(self, backup, keepers, *, rank, size, every=1, peer_every=1, accumulate=1,
                 log=None):
        super().__init__()
        self.backup, self.rank, self.size, self.log = backup, rank, size, log
        self.every, self.peer_every, self.accumulate = every, peer_every, accumulate
        self.local = keeper.Client(keepers["local"])
        self.peer = keeper.Client(keepers["peer"]) if keepers.get("peer") else None
        self._newest = None  # (step, frozen state, log records) not yet sent
        self._sent = 0  # the newest step sent to the local keeper
        self._busy = False
        self._cv = threading.Condition()
        self._thread = None
        self._closed = False
        self.failed = None  # the last send's error (a keeper lost: the disk backup remains)
        self.seconds = []  # each send's time

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.backup.step.numpy())
        if step % self.every == 0 and step % self.accumulate == 0:
            self.take(step)

    def take(self, step):
        """Reads the state of `step` (now) into memory; the background thread sends it."""
        frozen = self.backup.frozen_state()
        records = self.log.unflushed() if self.log is not None else []
        with self._cv:
            self._newest = (step, frozen, records)
            self._cv.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                                name="tfdist-memory-snapshots")
                self._thread.start()

    def _send_loop(self):
        scratch = f"ram://tfdist-snapshot-{os.getpid()}-{id(self)}"
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._newest is not None or self._closed)
                if self._newest is None:
                    return
                (step, frozen, records), self._newest = self._newest, None
                self._busy = True
            start = time.perf_counter()
            try:
                self.local.pending(self.rank, step)
                files = self.backup.snapshot_files(step, frozen, scratch)
                meta = {"size": self.size, "sharded": self.backup.sharded, "log": records,
                        "anchor": self.peer_every if self.backup.sharded else 0}
                self.local.put(self.rank, step, meta, files)
                if self.peer is not None and self.backup.sharded and step % self.peer_every == 0:
                    self.peer.put(self.rank, step, {**meta, "copy": True}, files)
                self.failed = None
            except Exception as e:  # noqa: BLE001 (said at the end; the disk backup remains)
                self.failed = f"{type(e).__name__}: {e}"
            finally:
                self.seconds.append(time.perf_counter() - start)
                with self._cv:
                    self._busy = False
                    self._sent = max(self._sent, step)
                    self._cv.notify_all()

    def wait(self, timeout):
        """Returns once the newest snapshot taken has been sent (or `timeout` s have passed)."""
        with self._cv:
            self._cv.wait_for(lambda: self._newest is None and not self._busy, timeout)

    def on_train_end(self, logs=None):
        self.wait(timeout=30)

    def close(self, timeout=10.0):
        """Ends the background thread once the snapshot in flight is sent (within `timeout` s),
        then the connections. A thread left inside TensorFlow when Python exits makes Python
        3.11's finalisation end it there (pthread_exit, cpython#87135), which TF's C++ code
        turns into SIGABRT ("FATAL: exception not rethrown"): a preempted run raising
        `Preempted` out of `train` exited so."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.local.close()
        if self.peer is not None:
            self.peer.close()

    def describe(self):
        """One line: the snapshots sent, their time, and a failure if the last one failed."""
        if not self.seconds:
            return "memory snapshots: none sent"
        self.seconds.sort()
        text = (f"memory snapshots: {len(self.seconds)} sent to this host's keeper"
                + (" and a peer's" if self.peer is not None and self.backup.sharded else "")
                + f", {self.seconds[len(self.seconds) // 2] * 1000:.0f} ms each (median, in "
                  f"the background)")
        return text + (f"; the last failed: {self.failed}" if self.failed else "")


def restore(backup, model, plan, *, rank, size, local=None):
    """Restores `model` from the keepers' snapshots of `plan` (`tfdist.launch.recovery`: the
    step, and the keepers that hold each replica's state), as this process (`rank` of `size`)
    needs them; `local`: this host's keeper, asked first. Returns (step, the step records the
    snapshots carried). `PeerLost` when a keeper cannot give what it was said to hold."""
    step = int(plan["step"])
    scratch = f"ram://tfdist-restore-{os.getpid()}"
    owners = sorted(int(o) for o in plan["sources"])
    records = []
    try:
        if plan["sharded"]:  # each replica's shard: this one's whole, the others' manifests
            whole = plan["size"] != size or rank not in owners  # (another size: every shard)
            for owner in (owners if whole else [rank, *(o for o in owners if o != rank)]):
                names = None if whole or owner == rank else [
                    f"{kind}/step-{step}/rank-{owner}.json" for kind in shards.KINDS]
                meta = _fetch(plan, owner, step, scratch, local, names)
                records = records or meta.get("log", [])
        else:  # any replica's snapshot is the whole state: the nearest
            owner = rank if rank in owners else owners[0]
            records = _fetch(plan, owner, step, scratch, local, None).get("log", [])
        restored = backup.restore(model, directory=scratch)
    finally:
        if tf.io.gfile.exists(scratch):
            tf.io.gfile.rmtree(scratch)
    return restored, records


def _fetch(plan, owner, step, scratch, local, names):
    """Writes `owner`'s snapshot of `step` (only `names`, if given) into `scratch`, from the
    first keeper of the plan that gives it; returns its metadata."""
    sources = list(plan["sources"][str(owner)])
    if local in sources:  # this host's keeper first
        sources.remove(local)
        sources.insert(0, local)
    errors = []
    for address in sources:
        client = keeper.Client(address, timeout=30.0)
        try:
            files, meta = client.fetch(owner, step, names)
        except keeper.KeeperError as e:
            errors.append(str(e))
            continue
        finally:
            client.close()
        for name, data in files.items():
            path = os.path.join(scratch, name)
            tf.io.gfile.makedirs(os.path.dirname(path))
            with tf.io.gfile.GFile(path, "wb") as f:
                f.write(data)
        return meta
    raise PeerLost(f"the state of replica {owner} at step {step} could not be read from the "
                   f"keepers that held it ({'; '.join(errors) or 'none'})")
