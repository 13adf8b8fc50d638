"""What a backup costs training: synchronous against asynchronous saves
(tfdist/callbacks/backup.py).

    python tools/bench/backup.py                 # gpt_mini and gpt2 (124M): stall, then training
    python tools/bench/backup.py --models=gpt_mini --rounds=1

Stall (in this process, for each model with AdamW, its weights and both moments): --saves backups
in a row, each after an update of every weight (as a training step makes), timed from the call
to `BackupAndRestore.save()` until it returns: the time training is blocked per save. For the
asynchronous saves also the time until the write is on disk, and the host memory of the copy.

Training (`tfdist train`, one process; and `tfdist launch --strategy=horovod`, 2 processes with
ZeRO-1): --steps steps with a backup every 10, synchronous or asynchronous, against the same run
without backups, in interleaved rounds. The overhead is the mean wall time per step (the log's
step end times, the first step aside) over the run without backups', minus 1; --batch
sequences per process, and gpt2's of --gpt2_tokens tokens (its checkpoint is the full 124M
model's either way).

Prints a table and writes bench_results/backup.json.
"""
import json
import os
import statistics
import sys
import tempfile
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.faults import harness  # noqa: E402

_MODELS = flags.DEFINE_list("models", ["gpt_mini", "gpt2"], "Configs under configs/.")
_SAVES = flags.DEFINE_integer("saves", 4, "Stall: saves per mode (the first aside).")
_STEPS = flags.DEFINE_integer("steps", 21, "Training: steps per run (a backup every 10).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Training: interleaved rounds of the variants.")
_GPT2_TOKENS = flags.DEFINE_integer("gpt2_tokens", 128, "Training: gpt2's sequence length.")
_BATCH = flags.DEFINE_integer("batch", 2, "Training: sequences per process and step.")
_PROCESSES = flags.DEFINE_list("processes", ["1", "2"], "Training: 1 (single), 2 (Horovod, "
                               "ZeRO-1).")
_SKIP_TRAINING = flags.DEFINE_bool("skip_training", False, "Stall only.")


def stall(name):
    """{mode: seconds blocked per save, ...} of `name`'s model and AdamW state."""
    import importlib

    import tensorflow as tf

    from tfdist import callbacks as cb
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer
    c = importlib.import_module(f"configs.{name}").get_config()
    # (vocab_size 0: the tokenizer's; 256: the default corpus's bytes)
    c.model.vocab_size = c.model.vocab_size or 256
    model = GPT.from_model_config(c.model)
    model.build()
    model.compile(optimizer=make_optimizer(c.train, 100), loss=loss_fn())
    model.optimizer.build(model.trainable_variables)
    update = tf.function(lambda: [v.assign_add(tf.ones_like(v) * 1e-6)
                                  for v in model.trainable_variables + model.optimizer.variables
                                  if v.dtype == tf.float32 and len(v.shape)])
    out = {"parameters": model.count_params()}
    for asynchronous in (False, True):
        with tempfile.TemporaryDirectory() as d:
            backup = cb.BackupAndRestore(os.path.join(d, "backup"), keep=2,
                                         asynchronous=asynchronous)
            backup.set_model(model)
            blocked, on_disk = [], []
            for i in range(1, _SAVES.value + 2):
                update()  # a training step's update: the next save copies new values
                backup.step.assign(i)
                start = time.perf_counter()
                backup.save()
                blocked.append(time.perf_counter() - start)
                update()  # training goes on while the write runs (copy on write)
                backup.wait()
                on_disk.append(time.perf_counter() - start)
            mode = "async" if asynchronous else "sync"
            out[mode] = {"blocked_s": statistics.median(blocked[1:]),
                         "on_disk_s": statistics.median(on_disk[1:]),
                         "host_copy_bytes": backup.host_bytes}
    return out


def training(name, processes, variant, workdir):
    """Mean wall seconds per step of one run (a backup every 10 steps, or none), and the
    chief's backup line."""
    extra = [f"--config={os.path.join(ROOT, 'configs', name + '.py')}", f"--workdir={workdir}",
             "--overwrite", f"--config.train.steps={_STEPS.value}",
             f"--config.train.steps_per_epoch={_STEPS.value}", "--config.train.eval_steps=1",
             "--config.train.warmup_steps=1", "--config.train.intra_op_threads=1",
             "--config.train.inter_op_threads=1", "--config.backup.every_steps=10",
             f"--config.backup.enabled={variant != 'none'}",
             f"--config.backup.asynchronous={variant == 'async'}",
             f"--config.train.batch_size={_BATCH.value * processes}"]
    if name == "gpt2":
        extra += [f"--config.model.block_size={_GPT2_TOKENS.value}"]
    if processes == 1:
        cmd = harness.tfdist_argv("train", *extra, "--strategy=single")
    else:
        cmd = harness.launch_argv([*extra, "--config.zero.stage=1"], strategy="horovod",
                                  workers=processes, max_restarts=0)
    import subprocess
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if p.returncode:
        sys.exit(f"bench: {name} {variant} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n"
                 f"{p.stderr[-2000:]}")
    steps = harness.metrics(workdir)["steps"]
    per_step = (steps[-1]["time"] - steps[0]["time"]) / (steps[-1]["step"] - steps[0]["step"])
    line = next((x.split("tfdist: ", 1)[1] for x in p.stdout.splitlines()
                 if "tfdist: backups:" in x), "")
    return per_step, line


def main(argv):
    del argv
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # (TF's saver logs each save at INFO)
    rows = {}
    for name in _MODELS.value:
        rows[name] = {"stall": stall(name)}
        s = rows[name]["stall"]
        print(f"{name}: {s['parameters']:,} parameters; blocked per save: sync "
              f"{s['sync']['blocked_s']:.3f} s, async {s['async']['blocked_s']:.3f} s (on disk "
              f"after {s['async']['on_disk_s']:.3f} s; host copy "
              f"{s['async']['host_copy_bytes'] / 2**20:,.1f} MiB)", flush=True)
    if not _SKIP_TRAINING.value:
        for name in _MODELS.value:
            for processes in map(int, _PROCESSES.value):
                times = {v: [] for v in ("none", "sync", "async")}
                lines = {}
                for _ in range(_ROUNDS.value):
                    for variant in times:
                        with tempfile.TemporaryDirectory() as d:
                            t, line = training(name, processes, variant, d)
                        times[variant].append(t)
                        lines[variant] = line
                        print(f"{name} x{processes} {variant:5}: {t:.3f} s/step  {line}",
                              flush=True)
                base = statistics.median(times["none"])
                rows[name][f"training_{processes}"] = {
                    v: {"s_per_step": statistics.median(ts), "all": ts,
                        "overhead": statistics.median(ts) / base - 1, "backup_line": lines[v]}
                    for v, ts in times.items()}
    print(f"\n{'model':9} {'blocked sync s':>15} {'blocked async s':>16} {'on disk s':>10} "
          f"{'host MiB':>9}   overhead, a backup every 10 steps (sync / async)")
    for name, r in rows.items():
        s = r["stall"]
        over = "   ".join(
            f"{k.split('_')[1]} process(es): {r[k]['sync']['overhead']:+.1%} / "
            f"{r[k]['async']['overhead']:+.1%}" for k in r if k.startswith("training_"))
        print(f"{name:9} {s['sync']['blocked_s']:15.3f} {s['async']['blocked_s']:16.3f} "
              f"{s['async']['on_disk_s']:10.3f} {s['async']['host_copy_bytes'] / 2**20:9.1f}   "
              f"{over}")
    from tfdist.data.store import write_atomic
    path = os.path.join(ROOT, "bench_results", "backup.json")
    write_atomic(path, json.dumps({"models": rows, "steps": _STEPS.value, "rounds": _ROUNDS.value,
                                   "command": "python tools/bench/backup.py " + " ".join(
                                       sys.argv[1:])}, indent=1))
    print(f"wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    app.run(main)
