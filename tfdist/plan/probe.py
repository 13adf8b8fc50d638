"""The short benches at first use: on a CPU model whose benches are not in `bench_results/`,
`--config.layout=auto` measures here what its planner needs of the CPU, once (about half a
minute), and caches it per CPU model and core count in ~/.cache/tfdist ($XDG_CACHE_HOME/tfdist
where that is set):

* `peak`: FLOP/s of a 2048^3 float32 matmul on every core (the median after a warm-up);
* `efficiency`: the fraction of one core's share of that peak which tfdist's training step of a
  gpt_mini-shaped GPT reaches on one core (one thread, float32; `tfdist.plan.machine.one_core`,
  the definition the benches' `scaling.json` is fitted with);
* `contention`: how much slower that step runs on one core while the same step runs on another
  (two processes side by side, started together) than alone: 1.0 on one core.

Each is measured in a process of its own (the thread pools of TensorFlow are fixed at its start)
with a bound on its time; a probe that fails or times out says why in one line and the planner
falls back on this project's machine's figures. The all-reduce between processes, the disk and
the CPU optimizer are not probed (`make bench-allreduce`, `make bench-disk` measure them).

    >>> from tfdist.plan import probe
    >>> p = probe.cache_path("Some CPU", 4)
    >>> p.endswith(".json") and "machine-" in p
    True
"""
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

from tfdist.plan.machine import FP32
from tfdist.plan.model import Cluster, Device, Model, planned
from tfdist.plan.published import CPU, fit_efficiency
from tfdist.runtime import host

#: The probed step: gpt_mini's shape (configs/gpt_mini.py) with the default corpus's byte
#: vocabulary, 8 sequences on one core.
SHAPE = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=256)
BATCH = 8
#: Bound on each probe process (TensorFlow's import, the step's trace and its timed steps).
TIMEOUT_S = 240


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the probe measured on this CPU (`cpu`, `cores`), and when."""
    cpu: str
    cores: int
    peak: float  # FLOP/s, every core
    efficiency: float  # of one core's share of `peak`, by the GPT's step on one core
    contention: float  # the step's time beside another busy core over its time alone
    step_seconds: float  # the probed step's time alone (BATCH x SHAPE's block_size tokens)
    when: float = 0.0

    def describe(self):
        return (f"probed here: matmul {self.peak / 1e9:.0f} GFLOP/s, the step at "
                f"{self.efficiency:.2f} of a core's peak, contention {self.contention:.3f}")


def cache_path(cpu, cores, cache=None):
    key = hashlib.sha1(f"{cpu}/{cores}".encode()).hexdigest()[:12]
    return os.path.join(cache or host.cache_dir(), f"machine-{key}.json")


def cached(cpu, cores, cache=None):
    """The Probe cached for this CPU model and core count, or None (none, unreadable, or written
    for another CPU: its own fields must name this one)."""
    try:
        with open(cache_path(cpu, cores, cache)) as f:
            d = json.load(f)
        p = Probe(**{f.name: d[f.name] for f in dataclasses.fields(Probe)})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return p if (p.cpu, p.cores) == (cpu, cores) else None


def efficiency(peak, cores, step_seconds, batch=BATCH, shape=None):
    """The fraction of one core's share of `peak` at which one core takes `step_seconds` for a
    training step of `batch` sequences of a GPT of `shape` (default SHAPE)."""
    s = shape or SHAPE
    model = Model(name="probe", n_layer=s["n_layer"], n_embd=s["n_embd"], n_head=s["n_head"],
                  vocab_size=s["vocab_size"], seq_len=s["block_size"])
    dev = Device(CPU, peak / cores, 0.0, None, 1.0, 1.0, 1, "probe", fp32_flops=peak / cores)
    return fit_efficiency(model, Cluster(dev, 1), planned(batch, 1, microbatch=batch),
                          step_seconds, FP32)


#: The three settings of a step the recommendations compare (`tfdist.runtime.cpu`): config keys.
VARIANTS = {"float32": {}, "xla": {"train.jit_compile": True},
            "bfloat16": {"train.precision": "mixed_bfloat16"}}


def model_shape(c):
    """The config's model keys that decide its step's time (`tfdist.plan.model.config_of`'s),
    with the config's batch a process: what a step cache is keyed by."""
    keys = ("arch", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "n_kv_head",
            "ffn_hidden", "bias", "tie_embeddings")
    shape = {k: c.model[k] for k in keys if k in c.model}
    shape["vocab_size"] = shape.get("vocab_size") or 256
    return shape


def steps_path(cpu, cores, shape, batch, cache=None):
    key = hashlib.sha1(json.dumps([cpu, cores, shape, batch], sort_keys=True).encode())
    return os.path.join(cache or host.cache_dir(), f"step-{key.hexdigest()[:12]}.json")


def cached_steps(c, cpu=None, cores=None, cache=None):
    """{variant: seconds a step} of this config's model and batch probed on this CPU model and
    core count (`measure_steps`), with the cache file's path and time; None where there is none
    (or it was written for another CPU: its own fields must name this one)."""
    if cpu is None:
        cpu, cores = host.this_cpu()
    shape, batch = model_shape(c), c.train.batch_size
    path = steps_path(cpu, cores, shape, batch, cache)
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    if [d.get("cpu"), d.get("cores"), d.get("shape"), d.get("batch")] != [cpu, cores, shape,
                                                                         batch]:
        return None
    return {**d, "path": path}


def measure_steps(c, say=print, cache=None, seconds=2.0):
    """Times this config's model step (its batch a process) in float32, with XLA and in
    bfloat16, in one bounded process of its own (never the run's), caches and returns
    `cached_steps`'s dict. bfloat16 is left out (None) where a oneDNN cap would crash it."""
    from tfdist.runtime import cpu as cpu_lib
    cpu, cores = host.this_cpu()
    shape, batch = model_shape(c), c.train.batch_size
    variants = [v for v in VARIANTS if v != "bfloat16" or not cpu_lib.bf16_blocked()]
    say(f"tfdist: probing this model's step here in {', '.join(variants)} (about "
        f"{5 + 4 * len(variants)} s; cached)", flush=True)
    out = _run([["--variants", f"--seconds={seconds}", f"--batch={batch}",
                 f"--shape={json.dumps(shape)}", f"--names={','.join(variants)}"]])[0]
    d = {"cpu": cpu, "cores": cores, "shape": shape, "batch": batch,
         "seconds": {v: out.get(v) for v in VARIANTS}, "when": time.time()}
    path = steps_path(cpu, cores, shape, batch, cache)
    _save(path, d)
    return {**d, "path": path}


def measure(cpu, cores, say=print, cache=None, seconds=3.0, batch=BATCH, shape=None):
    """Runs the probe's processes here (peak, the step alone, two steps side by side), caches and
    returns the Probe. Raises RuntimeError with one line if a process fails or times out."""
    shape, cache = shape or SHAPE, cache or host.cache_dir()
    say(f"tfdist: layout=auto: this CPU has no benches in bench_results/ ({cpu}, {cores} cores): "
        f"measuring its matmul peak and tfdist's step here, once (about 30 s; cached in "
        f"{cache})", flush=True)
    peak = _run([["--peak", f"--seconds={seconds}"]])[0]["flops"]
    step = ["--step", f"--seconds={seconds}", f"--batch={batch}", f"--shape={json.dumps(shape)}"]
    alone = _run([step + ["--core=0"]])[0]["seconds"]
    contention = 1.0
    if cores > 1:
        pair = _run([step + ["--core=0"], step + ["--core=1"]])
        contention = sum(r["seconds"] for r in pair) / len(pair) / alone
    p = Probe(cpu, cores, peak, efficiency(peak, cores, alone, batch, shape), contention, alone,
              time.time())
    _save(cache_path(cpu, cores, cache), dataclasses.asdict(p))
    return p


def _save(path, d):
    from tfdist.data.store import write_atomic
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, json.dumps(d, indent=1))


def _run(arg_lists):
    """Starts one probe process per argument list together, releases them at once when every one
    has warmed up (a line "ready" each, "go" to each), and returns their JSON results; each wait
    is bounded by TIMEOUT_S."""
    procs = [subprocess.Popen([sys.executable, "-m", "tfdist.plan.probe", *args],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
             for args in arg_lists]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            _expect(p, "ready", deadline)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"the probe process exited with {p.returncode}: "
                                   f"{(stderr.strip().splitlines() or [''])[-1]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"the probe took longer than {TIMEOUT_S} s") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def _expect(p, word, deadline):
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(timeout=left):
            raise subprocess.TimeoutExpired(p.args, TIMEOUT_S)
        line = p.stdout.readline()
        if not line:
            p.wait(timeout=30)
            raise RuntimeError(f"the probe process exited with {p.returncode} before it was "
                               f"ready: {(p.stderr.read().strip().splitlines() or [''])[-1]}")
        if line.strip() == word:
            return


# ---------------------------------------------------------------------------------------------
# The probe's processes.


def _timed(fn, seconds):
    """The median of fn's times (after one untimed call) over `seconds`, at least 3 calls."""
    fn()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _peak_process(seconds):
    import tensorflow as tf
    n = 2048
    a = tf.random.normal((n, n))
    tf.linalg.matmul(a, a).numpy()
    _ready()
    return {"flops": 2 * n ** 3 / _timed(lambda: tf.linalg.matmul(a, a).numpy(), seconds)}


def _gpt_step(shape, batch, jit=False):
    """tfdist's GPT of `shape` with tfdist's training step on one device, compiled (under the
    dtype policy set now), and a batch of `batch` random sequences (x, y)."""
    import keras
    import numpy as np

    from tfdist import config as config_lib
    from tfdist import strategies
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep

    c = config_lib.default_config()
    c.model.update(dropout=0.0, **shape)
    strategy = strategies.get("single")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = GPT.from_model_config(c.model)
        model.build()
        model.compile(optimizer=make_optimizer(c.train, 1000), loss=loss_fn(), jit_compile=jit)
        TrainStep(model, strategy, Layout(batch=batch, jit_compile=jit), clipnorm=1.0).install()
    tokens = np.random.default_rng(0).integers(0, shape["vocab_size"],
                                               (batch, shape["block_size"] + 1))
    return model, (tokens[:, :-1], tokens[:, 1:])


def _step_process(seconds, batch, shape, core):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[core]})
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    model, (x, y) = _gpt_step(shape, batch)
    x, y = tf.constant(x), tf.constant(y)
    model.train_on_batch(x, y)  # trace
    model.train_on_batch(x, y)
    _ready()
    return {"seconds": _timed(lambda: model.train_on_batch(x, y), seconds)}


def _variants_process(seconds, batch, shape, names):
    """Each variant's step time (`VARIANTS`): the model built, traced and timed one variant after
    another in this process on all its cores, as a run would (keras's dtype policy set before
    each model), by Keras `fit`'s own loop on an in-memory dataset: the median of a batch's time
    over about `seconds`."""
    import keras
    import tensorflow as tf

    class Times(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    models = {}
    for name in names:
        over = VARIANTS[name]
        keras.mixed_precision.set_global_policy(over.get("train.precision", "float32"))
        model, batch_xy = _gpt_step(shape, batch, over.get("train.jit_compile", False))
        data = tf.data.Dataset.from_tensors(batch_xy).repeat()
        times = Times()
        times.times = []
        model.fit(data, epochs=1, steps_per_epoch=3, callbacks=[times], verbose=0)  # (traced)
        models[name] = (model, max(times.times[1:]))
    _ready()
    out = {}
    for name, (model, guess) in models.items():
        keras.mixed_precision.set_global_policy(
            VARIANTS[name].get("train.precision", "float32"))
        times = Times()
        times.times = []
        n = 3 + int(min(200, max(5, seconds / max(guess, 1e-4))))  # (3 untimed: caches warm)
        model.fit(data, epochs=1, steps_per_epoch=n, callbacks=[times], verbose=0)
        timed = sorted(times.times[3:])
        out[name] = timed[len(timed) // 2]
    keras.mixed_precision.set_global_policy("float32")
    return out


def _ready():
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(3)


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tfdist.plan.probe")
    ap.add_argument("--peak", action="store_true")
    ap.add_argument("--step", action="store_true")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--shape", default=json.dumps(SHAPE))
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--names", default=",".join(VARIANTS))
    a = ap.parse_args(argv)
    out = (_peak_process(a.seconds) if a.peak else
           _variants_process(a.seconds, a.batch, json.loads(a.shape), a.names.split(","))
           if a.variants else _step_process(a.seconds, a.batch, json.loads(a.shape), a.core))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
