"""`tfdist.train.train` with faults injected on purpose: the program of the fault tests and of
tools/faults/chaos.py. Every change it makes to a run goes through `tfdist.train.Hooks` (and extra
callbacks); it patches nothing.

    python tools/faults/faulty_train.py WORKDIR '{"train.steps": 20, ...}' [--kill-at-step K] ...
    tfdist launch --workers 2 -- python tools/faults/faulty_train.py WORKDIR '{...}' \\
        --kill-at-step 7 --kill-worker 1

Config overrides are a JSON dict of dotted keys applied to configs/<--config>.py (gpt_nano).
Prints one `DRIVER_RESULT {...}` JSON line at the end (with the worker index and the host's
addresses). Every executed step appends a line
`<worker index> <pid> <loss>` to WORKDIR/executed_steps.txt, so a caller can count the steps that
really ran, across restarts.

--slow-write S: each backup's write (the chief's checkpoint) writes its data files, pauses S
  seconds, then writes them again and commits (names them in the index): a slow disk, so that a
  fault can land while a write is in flight (tools/harness.write_in_flight sees it on disk).
--skip-freeze: asynchronous backups write the live variables, not their values at the save
  (BackupAndRestore.freeze), to show that the kill-during-a-write test can fail.
--kill-at-step K: SIGKILL this process right after its K-th step (after that step's backup, if
  any). Under `tfdist launch` only worker --kill-worker does it, and only in the first attempt
  (TFDIST_RESTART_COUNT=0), so the restarted group runs to the end. Under Horovod, where only
  rank 0 writes the backup, every rank first passes an allreduce after each step's backup, so the
  kill comes after rank 0 has written step K's.
--kill-island I: under `tfdist launch --islands`, the faults above are island I's (its worker
  --kill-worker) only. Each island's files are named i<island>w<worker> instead of w<worker>.
--kill-host-at-step K: like --kill-at-step, but the process SIGKILLs its warm agent (its parent
  under `tfdist launch`), which takes down with it every process of its host, and the host's
  keeper: a host lost (tests/test_recovery.py). After step K's snapshot has been sent to its
  keepers (this host's, and a peer's for a ZeRO shard).
--kill-in-save N: SIGKILL inside the N-th backup save, after the checkpoint data files were written
  but before the checkpoint index was updated.
--dump-inputs N: after training, write WORKDIR/inputs-w<i>.npy: this worker's input rows of the
  first N steps, made by the training pipeline with the InputContext the strategy gave it.
--skip-keras-fix 1|2: leave out tfdist.compat's correction of Keras's _maybe_symbolic_build (1)
  or reduce_per_replica (2) under MultiWorkerMirrored, to show that each is needed.
--skip-allreduce: horovod: leave the optimizer without tfdist's allreduce (what Horovod's own
  Keras layer does under Keras 3), to show that the equality tests can fail.
--seed-by-rank: initialise the model with seed + rank (the data keeps the config's seed), so that
  only Horovod's broadcast from rank 0 can make the ranks start alike.
--skip-broadcast: horovod: leave out that broadcast.
--dump-weights: after training, write WORKDIR/weights-w<i>.npz: this worker's model weights, and
  WORKDIR/optimizer-w<i>.json: the bytes of its optimizer's variables and of its training step's
  gradient sums (accumulator_bytes: those alone), and its ZeRO description.
--hash-weights: after every step, append `<step> <sha256 of the weights>` to
  WORKDIR/weight_hashes-w<i>.txt.
--skip-zero-gather: leave out ZeRO-1/2's all-gather of the updated weights (Hooks.zero_options:
  skip all_gather), to show that the equality tests can fail.
--skip-zero3-gather, --skip-zero3-reduce: leave out ZeRO-3's gather of the weights, or the
  reduction of their gradients (skip all_gather, reduce_scatter), to show that the tests can fail.
--kill-before-model-save: SIGKILL when training ends, after the last step's backup and before
  `model.keras` is written (the end window), in the first attempt only.
--signal-at-step K [--signal NAME]: send this process SIGNAME (default TERM) while its K-th step
  runs (at its start), as a scheduler preempting it would. Worker --kill-worker, first attempt.
--corrupt FROM:TO: the training batches of data positions FROM..TO-1 (0-based; the step, moved
  on by any loss spike's skips) hold their windows' tokens shuffled: a stretch of bad data.
--kill-in-offload U:G: SIGKILL during the offloaded optimizer step of update U, once the writes of
  its sub-group G have started (the store's files half written), in the first attempt only.
--fill-disk-at-step K: after step K (its backup on disk), fill the workdir's file system with
  WORKDIR/filler until it is full (in the first attempt only): a disk that fills during a run.
--hold-at-end FILE: the chief, once training has returned, writes WORKDIR/ended and waits (at
  most 300 s) until FILE exists before it exits: a test cuts a worker off in between.
"""
import argparse
import hashlib
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def own_addresses():
    """This host's IPv4 addresses other than loopback (a test host's: its namespace's)."""
    import socket

    import psutil
    return sorted(a.address for addresses in psutil.net_if_addrs().values() for a in addresses
                  if a.family == socket.AF_INET and not a.address.startswith("127."))


def fill(path):
    """Writes zeros into `path` until its file system is full."""
    block = bytes(1 << 20)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError:
            pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("overrides", nargs="?", default="{}")
    ap.add_argument("--config", default="gpt_nano")
    ap.add_argument("--kill-at-step", type=int, default=0)
    ap.add_argument("--kill-worker", type=int, default=0)
    ap.add_argument("--kill-island", type=int, default=-1)
    ap.add_argument("--kill-host-at-step", type=int, default=0)
    ap.add_argument("--kill-in-save", type=int, default=0)
    ap.add_argument("--dump-inputs", type=int, default=0)
    ap.add_argument("--skip-keras-fix", type=int, default=0)
    ap.add_argument("--skip-allreduce", action="store_true")
    ap.add_argument("--dump-weights", action="store_true")
    ap.add_argument("--seed-by-rank", action="store_true")
    ap.add_argument("--skip-broadcast", action="store_true")
    ap.add_argument("--hash-weights", action="store_true")
    ap.add_argument("--skip-zero-gather", action="store_true")
    ap.add_argument("--skip-zero3-gather", action="store_true")
    ap.add_argument("--skip-zero3-reduce", action="store_true")
    ap.add_argument("--kill-before-model-save", action="store_true")
    ap.add_argument("--slow-write", type=float, default=0.0)
    ap.add_argument("--skip-freeze", action="store_true")
    ap.add_argument("--drop-dp-state", action="store_true")
    ap.add_argument("--drop-outer-state", action="store_true")
    ap.add_argument("--signal-at-step", type=int, default=0)
    ap.add_argument("--signal", default="TERM")
    ap.add_argument("--hold-at-end", default="")
    ap.add_argument("--corrupt", default="")
    ap.add_argument("--kill-in-offload", default="")
    ap.add_argument("--fill-disk-at-step", type=int, default=0)
    args = ap.parse_args()

    import importlib

    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist import config as config_lib
    from tfdist.parallel import zero
    from tfdist.runtime import cluster
    from tfdist.train import Hooks, train

    spec = cluster.from_environment()
    # A Horovod rank (horovodrun sets HOROVOD_RANK, mpirun OMPI_COMM_WORLD_RANK) has no TF_CONFIG.
    rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    worker = spec.worker_index if spec else int(rank)
    island, islands, _ = cluster.island()  # (tfdist launch --islands: this one's)
    me = f"i{island}w{worker}" if islands > 1 else f"w{worker}"  # (its files' names)
    first_attempt = os.environ.get("TFDIST_RESTART_COUNT", "0") == "0"
    if args.kill_island >= 0 and island != args.kill_island:
        first_attempt = False  # (the faults are another island's)
    kill_here = args.kill_at_step and worker == args.kill_worker and first_attempt
    host_here = args.kill_host_at_step and worker == args.kill_worker and first_attempt
    signal_here = args.signal_at_step and worker == args.kill_worker and first_attempt

    sync_ranks = args.kill_at_step and strategy_is_horovod(args.overrides)
    if sync_ranks:
        import horovod.tensorflow as hvd

    class Faults(Hooks):
        disable_patches = {0: (), 1: ("symbolic_build_under_mwms",),
                           2: ("reduce_per_replica_under_mwms",)}[args.skip_keras_fix]
        zero_options = {"skip": [name for name, skip in (
            ("all_gather", args.skip_zero_gather or args.skip_zero3_gather),
            ("reduce_scatter", args.skip_zero3_reduce)) if skip]}

        def model_seed(self, seed, strategy):
            return seed + strategy.worker_index if args.seed_by_rank else seed

        def reduction(self, strategy):
            if args.skip_allreduce:
                # each replica applies its own gradients (the corrections of tfdist.step stay)
                return lambda grads_and_vars: list(grads_and_vars)
            return strategy.reduce_gradients

        def strategy_callbacks(self, callbacks):
            if args.skip_broadcast:
                return [cb for cb in callbacks if getattr(cb, "name", "") != "broadcast_from_root"]
            return callbacks

        def on_input(self, windows, input_context):
            contexts.append((windows, input_context))
            if args.corrupt and not hasattr(windows, "clean_batch"):
                corrupt(windows, *map(int, args.corrupt.split(":")))

        def on_backup(self, backup):
            backup.freeze = not args.skip_freeze
            if args.drop_dp_state:  # a companion: the compression's errors lost at a restore
                restore = backup._restore_compression

                def restore_without_errors(directory, step):
                    restore(directory, step)
                    for name, v in backup._dp.state.items():
                        if name.startswith("tfdist_dp/error/"):
                            v.assign(tf.zeros_like(v))
                backup._restore_compression = restore_without_errors
            if args.drop_outer_state:  # a companion: the islands' outer momentum lost at a restore
                restore_from = backup._restore_from

                def restore_without_momentum(path, directory=None):
                    restore_from(path, directory)
                    momentum = backup._parts["islands"]["tfdist_outer/momentum"]
                    momentum.assign(tf.zeros_like(momentum))
                backup._restore_from = restore_without_momentum
            backups.append(backup)

        def on_memory(self, snapshots):
            memories.append(snapshots)

        def on_offload(self, offload):
            if args.kill_in_offload and first_attempt and worker == args.kill_worker:
                update, group = map(int, args.kill_in_offload.split(":"))

                def kill(u, g):
                    if (u, g) == (update, group):
                        os.kill(os.getpid(), signal.SIGKILL)
                offload.after_group = kill

        def save_checkpoint(self, manager, step):
            saves[0] += 1
            if saves[0] == args.kill_in_save:  # the data files, not the index: then die
                manager.checkpoint.write(os.path.join(manager.directory, f"ckpt-{step}"))
                os.kill(os.getpid(), signal.SIGKILL)
            if args.slow_write:  # a slow disk: the data files, a pause, then the commit
                manager.checkpoint.write(os.path.join(manager.directory, f"ckpt-{step}"))
                time.sleep(args.slow_write)
            manager.save(checkpoint_number=step)

    c = importlib.import_module(args.config).get_config()
    for key, value in json.loads(args.overrides).items():
        section, _, name = key.rpartition(".")
        (c[section] if section else c)[name] = value
    config_lib.validate(c)
    os.makedirs(args.workdir, exist_ok=True)
    steps_file = open(os.path.join(args.workdir, "executed_steps.txt"), "a")

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.n = 0

        def on_train_batch_begin(self, batch, logs=None):
            if signal_here and self.n + 1 == args.signal_at_step:
                os.kill(os.getpid(), getattr(signal, "SIG" + args.signal))

        def on_train_end(self, logs=None):
            if args.kill_before_model_save and first_attempt and self.n:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            self.n += 1
            # every process: step n's backup on disk before the kill (asynchronous saves)
            if args.kill_at_step == self.n and first_attempt and backups:
                backups[0].wait()
            if sync_ranks:  # every rank is past step n's backup (rank 0 writes it) before a kill
                hvd.allreduce(tf.constant(0.0), name="faulty_train_sync")
            steps_file.write(f"{worker} {os.getpid()} {logs['loss']!r}\n")
            steps_file.flush()
            if args.hash_weights:
                sharded = zero.of(self.model)  # ZeRO-3: the joined weights (a collective)
                if sharded:
                    values = sharded.full_values()
                else:
                    values = [v.numpy() for v in self.model.weights]
                digest = hashlib.sha256(b"".join(v.tobytes() for v in values))
                with open(os.path.join(args.workdir, f"weight_hashes-{me}.txt"), "a") as f:
                    f.write(f"{self.n} {digest.hexdigest()}\n")
            if kill_here and self.n == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if host_here and self.n == args.kill_host_at_step:
                if memories:  # step K's snapshot in its keepers (this host's and a peer's)
                    memories[0].wait(timeout=60)
                os.kill(os.getppid(), signal.SIGKILL)  # the agent: its processes die with it
                time.sleep(60)
            if args.fill_disk_at_step == self.n and first_attempt and worker == 0:
                if backups:
                    backups[0].wait()
                fill(os.path.join(args.workdir, "filler"))

    contexts = []  # (Windows, InputContext) of the training pipeline
    saves = [0]  # saves so far
    backups = []  # the run's backup
    memories = []  # the run's memory snapshots
    record = Record()
    result = train(c, args.workdir, verbose=0, extra_callbacks=[record], hooks=Faults())
    if args.dump_weights:
        np.savez(os.path.join(args.workdir, f"weights-{me}.npz"),
                 *[v.numpy() for v in record.model.weights])
        optimizer = record.model.optimizer
        sums = [a for a in getattr(record.model.train_step, "accumulators", []) if a is not None]
        accumulator_bytes = sum(a.numpy().nbytes for a in sums)  # the step's gradient sums
        with open(os.path.join(args.workdir, f"optimizer-{me}.json"), "w") as f:
            json.dump({"bytes": sum(v.numpy().nbytes for v in optimizer.variables)
                       + accumulator_bytes, "accumulator_bytes": accumulator_bytes,
                       "zero": zero.describe(record.model)}, f)
    if args.dump_inputs:
        windows, ctx = contexts[0]
        windows.on_input = None
        rows = [x.numpy() for x, _ in windows.dataset_fn(0, args.dump_inputs)(ctx)]
        np.save(os.path.join(args.workdir, f"inputs-{me}.npy"), np.stack(rows))
    print("DRIVER_RESULT " + json.dumps({**result, "worker": worker,
                                         "addresses": own_addresses()}), flush=True)
    if args.hold_at_end and spec is not None and spec.is_chief:
        open(os.path.join(args.workdir, "ended"), "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(args.hold_at_end) and time.monotonic() < deadline:
            time.sleep(0.1)


def corrupt(windows, first, end):
    """`windows`' batches of data positions first..end-1 with each window's tokens shuffled."""
    import tensorflow as tf
    windows.clean_batch = clean = windows.batch

    def batch(step, replica=0, replicas=1):
        x, y = clean(step, replica, replicas)
        position = windows.position(step)
        w = tf.concat([x, y[:, -1:]], 1)
        keys = tf.random.stateless_uniform(tf.shape(w), seed=tf.stack(
            [tf.constant(7, tf.int64), position]))
        shuffled = tf.gather(w, tf.argsort(keys, axis=1), batch_dims=1)
        w = tf.where((position >= first) & (position < end), shuffled, w)
        return w[:, :-1], w[:, 1:]
    windows.batch = batch


def strategy_is_horovod(overrides):
    return json.loads(overrides).get("strategy.name") == "horovod"


if __name__ == "__main__":
    main()
