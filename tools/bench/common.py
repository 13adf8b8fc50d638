"""What the benchmarks share (`tools/bench_*.py`): their common flags, the machine's matmul peak,
one `tfdist train` or `tfdist launch` run and its per-step log (on this machine's loopback, or on
the shaped links of tools/cluster/netcluster.py's hosts), and writing a result's JSON.
"""
import json
import os
import re
import subprocess
import sys

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist import cli  # noqa: E402
from tools.bench.matmul_peak import measure as matmul_peak  # noqa: E402,F401
from tools.faults import harness  # noqa: E402

_CONFIG = cli.define_config_flag(
    "config", os.path.join(ROOT, "configs", "gpt_mini.py"), "Model/training config to benchmark.")
STEPS = flags.DEFINE_integer("steps", 6, "Timed steps per variant per round.")
ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps per variant before the rounds.")
OUT = flags.DEFINE_string("out", None, "Where to write the JSON results (default: the mode's "
                          "file in bench_results/).")
WORKERS = flags.DEFINE_integer("workers", 2, "Processes of the multi-process runs.")
HOROVOD = flags.DEFINE_bool("horovod", False, "Horovod ranks instead of multi_worker_mirrored "
                            "workers.")
COMPRESSION = flags.DEFINE_enum("compression", "none", ["none", "fp16"],
                                "--horovod: gradient compression.")
LINK = flags.DEFINE_string("link", None, "Run the multi-process runs on "
                           "tools/cluster/netcluster.py's hosts, one process per host, on links "
                           "shaped to this rate (1gbit, 10gbit; root), through `tfdist launch "
                           "--hosts`.")
STRAGGLER = flags.DEFINE_string("straggler", None, "--link: the last worker's host gets this rate "
                                "instead (100mbit: a tenth of 1gbit), a straggler; the baseline "
                                "runs keep --link.")
INTER = flags.DEFINE_integer("inter_op_threads", 1, "Inter-op threads per process. With TF's "
                             "default (0: one per core) a process with 1 intra-op thread still "
                             "runs independent ops in parallel, on ~1.4 of 2 cores.")

#: The instruction sets a result's `host` lists when the CPU has them (/proc/cpuinfo's flags).
ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def config():
    return _CONFIG.value


def train_flags(workdir, steps, batch, inter, extra=()):
    """`tfdist train` flags of a timed run: `steps` steps of `batch` sequences, 1 intra-op and
    `inter` inter-op thread(s) per process, no backup."""
    return [f"--config={config_filename()}", f"--workdir={workdir}", "--overwrite",
            f"--config.train.steps={steps}", f"--config.train.steps_per_epoch={steps}",
            f"--config.train.batch_size={batch}", "--config.train.warmup_steps=1",
            "--config.train.eval_steps=1", "--config.train.intra_op_threads=1",
            f"--config.train.inter_op_threads={inter}", "--config.backup.enabled=false", *extra]


def train_run(workdir, workers, steps, inter=None, extra=(), horovod=None):
    """One `tfdist train` (workers=1, strategy single) or `tfdist launch` run
    (multi_worker_mirrored, or horovod: --horovod unless `horovod` says) of the same batch per
    process; its per-step log."""
    inter = INTER.value if inter is None else inter
    horovod = HOROVOD.value if horovod is None else horovod
    flags_ = train_flags(workdir, steps, _CONFIG.value.train.batch_size * workers, inter, extra)
    if workers == 1:
        cmd = harness.tfdist_argv("train", *flags_, "--strategy=single")
    elif horovod:
        cmd = harness.launch_argv([*flags_, f"--config.dp.compression={COMPRESSION.value}"],
                                  strategy="horovod", workers=workers, max_restarts=0)
    else:
        cmd = harness.launch_argv(flags_, workers=workers, max_restarts=0)
    p = run_on_hosts(cmd, workers, straggler_host=workers - 1 if workers > 1 else None)
    train_run.stdout = p.stdout
    if p.returncode:
        sys.exit(f"bench: {' '.join(cmd[2:5])} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n"
                 f"{p.stderr[-2000:]}")
    return harness.metrics(workdir)["steps"]


def ps_run(workdir, workers, steps):
    """Steps/s of one parameter-server run (its progress reports after the first)."""
    cmd = harness.launch_argv(train_flags(workdir, steps, _CONFIG.value.train.batch_size,
                                          INTER.value),
                              strategy="parameter_server", workers=workers, ps=1, max_restarts=0)
    # workers + 2: chief, workers, ps
    p = run_on_hosts(cmd, workers + 2, straggler_host=workers if workers > 1 else None)
    if p.returncode:
        sys.exit(f"bench: parameter_server run failed (exit {p.returncode}):\n{p.stdout[-2000:]}")
    log = harness.metrics(workdir)["steps"][1:]
    ps_run.worker_steps = log[-1].get("worker_steps")
    return (log[-1]["step"] - log[0]["step"]) / (log[-1]["time"] - log[0]["time"])


def run_on_hosts(cmd, processes, straggler_host=None):
    """Runs `cmd`; with --link, a `tfdist launch` runs on host 0 of a tools/cluster/netcluster.py
    cluster of `processes` hosts with --hosts=<all of them>, its links shaped to --link (and host
    `straggler_host`'s to --straggler, if given)."""
    launch = cmd.index("launch") if "launch" in cmd else None
    if not LINK.value or launch is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    from tools.cluster.netcluster import NetCluster
    with NetCluster(processes, rate=LINK.value) as net:
        if STRAGGLER.value and straggler_host is not None:
            net.shape(straggler_host, rate=STRAGGLER.value)
        hosts = ",".join(net.address(i) for i in range(processes))
        env = {**os.environ, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"]}
        return net.run(0, [*cmd[:launch + 1], f"--hosts={hosts}", *cmd[launch + 1:]],
                       timeout=3600, env=env, cwd=ROOT)


def link_suffix():
    return ((f"-{LINK.value}" if LINK.value else "") +
            (f"-straggler{STRAGGLER.value}" if LINK.value and STRAGGLER.value else ""))


def params(stdout):
    """The model's parameter count from a run's log line ("model 10,818,816 parameters"), or
    None."""
    found = re.search(r"model ([\d,]+) parameters", stdout or "")
    return int(found.group(1).replace(",", "")) if found else None


def host():
    """The CPU a result was measured on: /proc/cpuinfo's model name (None where there is no
    /proc/cpuinfo), the cores, and which of `ISA` it has."""
    cpu = None
    have = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and cpu is None:
                    cpu = value.strip()
                elif key.strip() == "flags" and not have:
                    have = set(value.split())
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": [x for x in ISA if x in have]}


def write_json(result, default_path):
    """Writes `result` to --out (else `default_path`), a dict with the `host` it was measured on
    added (unless it has one)."""
    if isinstance(result, dict) and "host" not in result:
        result = {**result, "host": host()}
    out = OUT.value or default_path
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


def config_filename():
    from ml_collections import config_flags
    return config_flags.get_config_filename(flags.FLAGS["config"])
