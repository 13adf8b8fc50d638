"""Benchmarks of the data path: memory against corpus size, input cost, tokenizers.

    python tools/bench/data.py --memory       # a generated 2.6 G-token store vs a 10 MB store:
                                              # each process's peak RSS, single / 2-worker MWMS /
                                              # parameter server (2 workers + 1 ps), gpt_nano
    python tools/bench/data.py --input        # gpt_mini step time, store-backed vs in-memory
                                              # batches (interleaved); windows/s from the big store
                                              # against GPT-2 124M on 8 A100s (tfdist plan)
    python tools/bench/data.py --tokenizers   # byte vs BPE-8192 on gpt_mini, same steps and batch:
                                              # validation bits per byte and tokens/s

The big store is written once into --scratch (default /tmp/tfdist-bench-data, ~5 GB): the stdlib's
bytes, repeated until there are --big_tokens tokens. Each mode prints a table and writes
bench_results/data-<mode>.json.
"""
import json
import os
import re
import subprocess
import sys
import threading
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist.launch.local import descendants, task_of  # noqa: E402
from tools.faults import harness  # noqa: E402

_MEMORY = flags.DEFINE_bool("memory", False, "Peak RSS per process, big store vs small store.")
_INPUT = flags.DEFINE_bool("input", False, "Input cost in the step, and reader windows/s.")
_TOKENIZERS = flags.DEFINE_bool("tokenizers", False, "Byte vs BPE-8192 on gpt_mini.")
_SCRATCH = flags.DEFINE_string("scratch", "/tmp/tfdist-bench-data", "Where the stores go.")
_BIG = flags.DEFINE_integer("big_tokens", 2_600_000_000, "Tokens in the big store.")
_STEPS = flags.DEFINE_integer("steps", 200, "--tokenizers: training steps of each run.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "--input: interleaved rounds.")
_STRATEGIES = flags.DEFINE_list("strategies",
                                ["single", "multi_worker_mirrored", "parameter_server"],
                                "--memory: strategies to run.")

PY = sys.executable


def write_json(obj, name):
    os.makedirs(os.path.join(ROOT, "bench_results"), exist_ok=True)
    path = os.path.join(ROOT, "bench_results", name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"wrote {path}")


def stdlib_bytes():
    from tfdist.data import sources
    return b"".join(open(f, "rb").read() + b"\n" for f in sources.stdlib_files())


def make_store(directory, n_tokens):
    """A byte store of `n_tokens` train tokens (the stdlib repeated) and 1 M validation tokens."""
    import numpy as np

    from tfdist.data import store
    m = store.read_manifest(directory)
    if m is not None and m["splits"]["train"]["tokens"] == n_tokens:
        return directory
    text = np.frombuffer(stdlib_bytes(), np.uint8)
    t0 = time.perf_counter()
    splits = {}
    for name, n in (("train", n_tokens), ("val", 1 << 20)):
        w = store.ShardWriter(directory, name, "uint16")
        left = n
        while left:
            part = text[:left] if name == "val" else text[:min(left, len(text))]
            w.write(part)
            left -= len(part)
        splits[name] = {**w.close(), "documents": None, "bytes": n}
    store.write_manifest(directory, source=f"generated: the stdlib repeated to {n_tokens:,} tokens",
                         key=f"bench-{n_tokens}", splits=splits, shard_tokens=store.SHARD_TOKENS,
                         tokenizer={"kind": "byte", "vocab_size": 256, "eot": None})
    print(f"wrote {directory}: {n_tokens:,} tokens in {time.perf_counter() - t0:.0f} s")
    return directory


def vm_hwm_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(f.read().split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        return None


def role(pid):
    task = task_of(pid)
    if task:
        return f"{task[0]} {task[1]}"
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return None
    if "--prepare_only" in cmd:
        return "prepare"
    if "tfdist train" in cmd or "-m tfdist train" in cmd:
        return "train"
    return None  # the launcher itself, shells


def run_sampled(cmd, timeout=900):
    """Runs `cmd`; samples every descendant's VmHWM (its peak RSS) every 0.2 s. Returns
    (returncode, output, {role: peak MiB})."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                         start_new_session=True)
    peaks = {}
    done = threading.Event()

    def sample():
        while not done.is_set():
            for pid in [p.pid] + descendants(p.pid):
                r, hwm = role(pid), vm_hwm_mib(pid)
                if r and hwm:
                    peaks[r] = max(peaks.get(r, 0), hwm)
            time.sleep(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        done.set()
        t.join()
        if p.poll() is None:
            os.killpg(p.pid, 9)
    return p.returncode, out, peaks


def memory_main():
    big = make_store(os.path.join(_SCRATCH.value, f"big-{_BIG.value}"), _BIG.value)
    small = make_store(os.path.join(_SCRATCH.value, "small-10mb"), 5 << 20)  # 10 MB as uint16
    train = ["--config=configs/gpt_nano.py", "--config.train.steps=40",
             "--config.train.steps_per_epoch=20", "--config.train.eval_steps=4", "--overwrite"]
    rows = []
    for strategy in _STRATEGIES.value:
        for name, directory in (("10 MB", small), (f"{_BIG.value / 1e9:.1f} G tokens", big)):
            wd = os.path.join(_SCRATCH.value, f"run-{strategy}")
            args = train + [f"--config.data.source=store:{directory}", f"--workdir={wd}"]
            if strategy == "single":
                cmd = [PY, "-m", "tfdist", "train", *args]
            else:
                cmd = [PY, "-m", "tfdist", "launch", f"--strategy={strategy}", "--workers=2", "--",
                       *args]
            t0 = time.perf_counter()
            code, out, peaks = run_sampled(cmd)
            if code != 0:
                raise SystemExit(f"{cmd} exited {code}:\n{out[-3000:]}")
            val = re.findall(r"validation loss ([0-9.]+) nats/token", out)
            rows.append({"strategy": strategy, "store": name,
                         "store_dir": harness.relative(directory),
                         "seconds": round(time.perf_counter() - t0, 1),
                         "val_loss": float(val[-1]) if val else None,
                         "peak_rss_mib": {k: round(v) for k, v in sorted(peaks.items())
                                          if k != "prepare"}})
            print(rows[-1], flush=True)
    print(f"\n{'strategy':<24}{'process':<12}{'10 MB store':>14}{'big store':>14}"
          f"{'difference':>12}")
    result = []
    for strategy in _STRATEGIES.value:
        small_row, big_row = [r for r in rows if r["strategy"] == strategy]
        for proc, mib in small_row["peak_rss_mib"].items():
            other = big_row["peak_rss_mib"].get(proc)
            diff = None if other is None else other - mib
            result.append({"strategy": strategy, "process": proc, "small_mib": mib,
                           "big_mib": other, "difference_mib": diff})
            print(f"{strategy:<24}{proc:<12}{mib:>12,} M{other:>12,} M{diff:>+10,} M")
    worst = max(abs(r["difference_mib"]) for r in result)
    print(f"largest difference: {worst} MiB (target: within 100)")
    write_json({"command": "python tools/bench/data.py --memory", "big_tokens": _BIG.value,
                "small_tokens": 5 << 20, "model": "gpt_nano, 40 steps", "runs": rows,
                "table": result, "largest_difference_mib": worst}, "data-memory.json")


def input_main():
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist import config as config_lib
    from tfdist import plan, strategies
    from tfdist.callbacks import TrainingLog  # noqa: F401  (the same imports as tfdist train)
    from tfdist.data import Windows, open_store, store
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep

    # 1. windows/s read from the big store, GPT-2 shapes (1,025 tokens a window, 64 a batch)
    big = store.TokenStore(make_store(os.path.join(_SCRATCH.value, f"big-{_BIG.value}"),
                                      _BIG.value))
    w = Windows(big.split("train"), 1024, 64, seed=0)
    ds = w.dataset_fn(0, 10_000)(None)
    it = iter(ds)
    for _ in range(3):
        next(it)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 15:
        next(it)
        n += 64
    reader = n / (time.perf_counter() - t0)
    c2 = config_lib.validate(_config("gpt2"))
    cluster = plan.Cluster(plan.DEVICES["a100-80gb"], 8)
    best = [p for p in plan.search(plan.model_from_config(c2, "gpt2"), cluster, batch=512,
                                   opts=plan.calibrated_options())
            if p.fits and plan.runnable(p, cluster)][0]
    need = best.tokens_per_sec / 1024
    print(f"reader: {reader:,.0f} windows/s of 1,025 tokens from {big.dir}; GPT-2 124M on 8 A100 "
          f"({best.layout}) consumes {best.tokens_per_sec:,.0f} tokens/s = {need:,.0f} windows/s")

    # 2. gpt_mini step time: store-backed input vs the same batches from memory, interleaved
    c = config_lib.validate(_config("gpt_mini"))
    t, m = c.train, c.model
    data = open_store(c.data)
    m.vocab_size = data.vocab_size
    windows = Windows(data.split("train"), m.block_size, t.batch_size, seed=c.seed)
    steps = 8
    strategy = strategies.get("single")
    with strategy.scope():
        keras.utils.set_random_seed(c.seed)
        model = GPT.from_model_config(m)
        model.build()
        model.compile(optimizer=make_optimizer(t, 10_000), loss=loss_fn())
        model.train_step = TrainStep(model, strategy, Layout(batch=t.batch_size),
                                     clipnorm=t.grad_clip)
    batches = list(windows.dataset_fn(0, steps)(None))
    in_memory = tf.data.Dataset.from_tensor_slices((tf.stack([b[0] for b in batches]),
                                                    tf.stack([b[1] for b in batches])))

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.t)

    variants = {"store": lambda: strategy.distribute(windows.dataset_fn(0, steps)),
                "memory": lambda: in_memory}
    times = {k: [] for k in variants}
    for r in range(_ROUNDS.value + 1):
        for name, make in variants.items():
            timer = Timer()
            timer.times = []
            model.fit(make(), epochs=1, steps_per_epoch=steps, callbacks=[timer], verbose=0,
                      shuffle=False)
            if r:  # round 0 warms up (tracing)
                times[name] += timer.times[2:]
    med = {k: float(np.median(v)) for k, v in times.items()}
    overhead = med["store"] / med["memory"] - 1
    print(f"\n{'input':<10}{'median step (s)':>18}")
    for k, v in med.items():
        print(f"{k:<10}{v:>18.4f}")
    print(f"store-backed input costs {overhead * 100:+.2f} % of the step (target <= 3 %)")
    write_json({"command": "python tools/bench/data.py --input",
                "model": "gpt_mini, batch 16 x 256",
                "rounds": _ROUNDS.value, "steps_per_round": steps - 2, "median_step_s": med,
                "step_times_s": times, "store_overhead": overhead,
                "reader_windows_per_s": reader, "reader_window_tokens": 1025, "reader_batch": 64,
                "big_store_tokens": _BIG.value,
                "gpt2_124m_8xa100": {"layout": str(best.layout),
                                     "tokens_per_s": best.tokens_per_sec,
                                     "windows_per_s": need}}, "data-input.json")


def _config(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def tokenizers_main():
    rows = []
    for tok in ("byte", "bpe"):
        wd = os.path.join(_SCRATCH.value, f"tok-{tok}")
        cmd = [PY, "-m", "tfdist", "train", "--config=configs/gpt_mini.py", f"--workdir={wd}",
               "--overwrite", f"--config.data.tokenizer={tok}", "--config.data.vocab_size=8192",
               f"--config.train.steps={_STEPS.value}",
               f"--config.train.steps_per_epoch={_STEPS.value // 2}",
               "--config.train.warmup_steps=20", "--config.train.eval_steps=20"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=7200)
        if p.returncode:
            raise SystemExit(f"{cmd} exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        m = json.load(open(os.path.join(wd, "metrics.json")))
        last = m["evals"][-1]
        rates = [r["tokens_per_sec"] for r in m["steps"][3:]]
        bytes_per_token = last["loss"] / 0.6931471805599453 / last["bits_per_byte"]
        rows.append({"tokenizer": tok if tok == "byte" else "bpe-8192", "steps": _STEPS.value,
                     "val_loss_nats_per_token": last["loss"],
                     "val_bits_per_byte": last["bits_per_byte"],
                     "bytes_per_token": bytes_per_token,
                     "tokens_per_s": sorted(rates)[len(rates) // 2],
                     "bytes_per_s": sorted(rates)[len(rates) // 2] * bytes_per_token,
                     "seconds": round(time.perf_counter() - t0)})
        print(rows[-1], flush=True)
    print(f"\n{'tokenizer':<12}{'val nats/token':>16}{'val bits/byte':>15}{'bytes/token':>13}"
          f"{'tokens/s':>10}{'text bytes/s':>14}")
    for r in rows:
        print(f"{r['tokenizer']:<12}{r['val_loss_nats_per_token']:>16.4f}{r['val_bits_per_byte']:>15.4f}"
              f"{r['bytes_per_token']:>13.2f}{r['tokens_per_s']:>10,.0f}{r['bytes_per_s']:>14,.0f}")
    write_json({"command": "python tools/bench/data.py --tokenizers",
                "model": "gpt_mini, batch 16 x 256", "rows": rows}, "data-tokenizers.json")


def main(argv):
    del argv
    if _MEMORY.value:
        memory_main()
    if _INPUT.value:
        input_main()
    if _TOKENIZERS.value:
        tokenizers_main()
    if not (_MEMORY.value or _INPUT.value or _TOKENIZERS.value):
        raise app.UsageError("choose --memory, --input or --tokenizers")


if __name__ == "__main__":
    app.run(main)
