"""What ZeRO-Offload's disk and CPU step cost here: the rates the planner prices offload with.

    python tools/bench/disk.py          # make bench-disk

* the disk: --gib GiB written then read back through tfdist's offload store
  (`tfdist.parallel.zero.store.Store`, O_DIRECT where the file system allows it, 4 I/O
  threads), in arrays of --array_mib MiB, as the offloaded step moves them;
* the CPU optimizer step: AdamW (tfdist's, one fused `ResourceApplyAdam` per variable) over
  sub-groups of the state, parameters updated per second, with the state in host memory
  (`Offload("host")`) and on the disk (`Offload("disk")`: its reads and writes overlapped with
  the update, and competing with it for the cores: what an offloaded update takes here).

Each is measured --rounds times, interleaved; the median is kept. Prints a table and writes
bench_results/disk.json, which `tfdist plan` reads (tfdist.plan.machine.offload_rates).
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

_GIB = flags.DEFINE_float("gib", 4.0, "GiB written and read per round.")
_ARRAY = flags.DEFINE_integer("array_mib", 64, "MiB per array (a variable's slot).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds.")
_PARAMS = flags.DEFINE_integer("adam_params", 1 << 26, "Parameters of the CPU step.")
_DIR = flags.DEFINE_string("dir", "", "Where the files go (default: a temporary directory on "
                           "the disk of bench_results/).")


def disk_round(directory, gib, array_mib):
    import numpy as np

    from tfdist.parallel.zero.store import Store
    n = max(1, int(gib * 1024 / array_mib))
    array = np.random.default_rng(0).random(array_mib * 2**18, dtype=np.float32)
    store = Store("disk", os.path.join(directory, "store"))
    start = time.perf_counter()
    for i in range(n):
        store.write_behind(f"a{i}", array)
        if i >= 4:  # (4 writes in flight, as the step's sub-groups)
            store.wait([f"a{i - 4}"])
    store.flush()
    os.sync()
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(n):
        store.prefetch([f"a{j}" for j in range(i, min(n, i + 4))])
        store.get(f"a{i}")
    read = time.perf_counter() - start
    nbytes = n * array.nbytes
    direct = store._direct  # noqa: SLF001 (the bench reports which path ran)
    store.close()
    return nbytes / wrote, nbytes / read, direct


def adam_round(params, kind="host", directory=None):
    import keras
    import numpy as np

    from tfdist.optimizers import AdamW
    from tfdist.parallel.zero.offload import Offload
    keras.utils.set_random_seed(0)
    width = 4096
    variables = [keras.Variable(np.zeros((params // width // 8, width), "float32"))
                 for _ in range(8)]
    offload = Offload(kind, directory and os.path.join(directory, "adam"), subgroup=params // 8)
    opt = AdamW(1e-3, weight_decay=0.1)
    offload.build(opt, variables)
    grads = {i: np.ones(v.shape, "float32") for i, v in enumerate(variables)}
    weights = {i: v.numpy() for i, v in enumerate(variables)}
    offload.step(0, 1e-3, grads, weights)  # (warm)
    start = time.perf_counter()
    offload.step(1, 1e-3, grads, weights)
    seconds = time.perf_counter() - start
    offload.close()
    return params / seconds


def main(argv):
    del argv
    directory = _DIR.value or tempfile.mkdtemp(dir=os.path.join(ROOT, "bench_results"),
                                               prefix=".disk-")
    rows = {"write_GBps": [], "read_GBps": [], "adam_Mparams_per_s": [],
            "adam_disk_Mparams_per_s": []}
    direct = None
    try:
        for r in range(_ROUNDS.value):
            w, rd, direct = disk_round(directory, _GIB.value, _ARRAY.value)
            rows["write_GBps"].append(w / 1e9)
            rows["read_GBps"].append(rd / 1e9)
            rows["adam_Mparams_per_s"].append(adam_round(_PARAMS.value) / 1e6)
            rows["adam_disk_Mparams_per_s"].append(
                adam_round(_PARAMS.value, "disk", directory) / 1e6)
            print(f"round {r + 1}: write {w / 1e9:.2f} GB/s, read {rd / 1e9:.2f} GB/s, CPU AdamW "
                  f"{rows['adam_Mparams_per_s'][-1]:.0f} M parameters/s (state on disk: "
                  f"{rows['adam_disk_Mparams_per_s'][-1]:.0f})", flush=True)
    finally:
        import shutil
        shutil.rmtree(directory, ignore_errors=True)
    result = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    result.update(rounds=rows, gib=_GIB.value, array_mib=_ARRAY.value, o_direct=direct,
                  adam_params=_PARAMS.value, cpu=os.cpu_count())
    print(f"\n| disk write | disk read | CPU AdamW, state in memory | state on disk |\n"
          f"|---|---|---|---|\n| {result['write_GBps']:.2f} GB/s | {result['read_GBps']:.2f} GB/s "
          f"| {result['adam_Mparams_per_s']:.0f} M parameters/s | "
          f"{result['adam_disk_Mparams_per_s']:.0f} M parameters/s |")
    os.makedirs(os.path.join(ROOT, "bench_results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench_results", "disk.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
