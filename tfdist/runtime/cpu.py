"""This host's CPU: what it runs fastest (the settings `tfdist train` recommends on the console),
and whether its bfloat16 path works under a oneDNN cap.

The recommendations are said, not applied: each changes the numbers a run computes (bfloat16
rounds; XLA fuses in another order), so a run keeps the config it was given and a user opts in.
A strategy's own recommended values (TPU's) are applied (`tfdist.train`). Each figure is this
host's: this model's step timed here in float32, with XLA and in bfloat16
(`tfdist train --probe`, `tfdist.plan.probe.measure_steps`, cached per CPU model and model
shape). Where it has not been timed here, the run says so and how to time it, instead of citing
another machine.

    >>> from tfdist import config
    >>> from tfdist.runtime import cpu
    >>> c = config.default_config()
    >>> probed = {"seconds": {"float32": 1.0, "xla": 0.8, "bfloat16": 0.5}, "path": "p.json",
    ...           "when": 0}
    >>> [key for key, _, _ in cpu.recommendations(c, probed, flags={"avx512_bf16"}, environ={})]
    ['train.precision', 'train.jit_compile']
    >>> cpu.recommendations(c, None) == [] and "not measured here" in cpu.not_measured(c)
    True
    >>> cpu.bf16_blocked({"avx512f", "avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"})[:35]
    'ONEDNN_MAX_CPU_ISA=AVX2 caps oneDNN'
    >>> cpu.bf16_blocked({"avx2", "fma"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) is None  # a real AVX2 CPU
    True
"""
import os
import time

#: CPU flags (/proc/cpuinfo) of a native bfloat16 matmul: oneDNN then runs bf16 at about 4x the
#: fp32 rate (1,051-1,156 against 280-318 GFLOP/s for a 2048^3 matmul on the AMX machine).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: How much faster a setting's step must be to be recommended (the probe's own spread: a few %).
FASTER = 1.05

#: oneDNN's instruction-set caps (ONEDNN_MAX_CPU_ISA), lowest first; oneDNN has a bfloat16
#: matmul from AVX512_CORE up (AVX2_VNNI_2 with AVX-NE-CONVERT).
_ISA_RANK = {"SSE41": 0, "AVX": 1, "AVX2": 2, "AVX2_VNNI": 3, "AVX2_VNNI_2": 4, "AVX512_CORE": 5,
             "AVX512_CORE_VNNI": 6, "AVX512_CORE_BF16": 7, "AVX10_1_512": 8,
             "AVX512_CORE_FP16": 8, "AVX10_1_512_AMX": 9, "AVX512_CORE_AMX": 9,
             "AVX10_1_512_AMX_FP16": 10, "AVX512_CORE_AMX_FP16": 10, "ALL": 99, "DEFAULT": 99}


def cpu_flags():
    """This CPU's feature flags (empty where /proc/cpuinfo is not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_blocked(flags=None, environ=None):
    """Why this process's bfloat16 matmuls would crash it, or None. TensorFlow 2.21 hands them to
    oneDNN when the CPU's own flags have AVX-512 (or AVX-NE-CONVERT), oneDNN being on (it is by
    default with AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX; TF_ENABLE_ONEDNN_OPTS decides
    otherwise). A cap below AVX512_CORE (ONEDNN_MAX_CPU_ISA) leaves oneDNN no bfloat16 matmul,
    and TF's MatMul does not catch oneDNN's error: the process dies (measured: exit 139). A real
    CPU without AVX-512 takes TF's Eigen kernels instead and runs (measured under QEMU's
    Haswell, an AVX2-only CPU)."""
    flags = cpu_flags() if flags is None else flags
    environ = os.environ if environ is None else environ
    cap = next((environ[v].strip().upper() for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
                if environ.get(v, "").strip().upper() in _ISA_RANK), None)
    if cap is None:
        return None
    opts = environ.get("TF_ENABLE_ONEDNN_OPTS")
    onednn = (opts.strip().lower() in ("1", "true") if opts is not None else
              bool(flags & {"avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_tile"}))
    if not onednn or not flags & {"avx512f", "avx_ne_convert"}:
        return None
    if _ISA_RANK[cap] >= _ISA_RANK["AVX512_CORE"] or (
            cap == "AVX2_VNNI_2" and "avx_ne_convert" in flags):
        return None
    return (f"ONEDNN_MAX_CPU_ISA={cap} caps oneDNN below its bfloat16 matmul (AVX512_CORE), "
            f"while TensorFlow picks oneDNN's bfloat16 kernels from this CPU's own flags; "
            f"bfloat16 would crash the process")


def recommendations(c, probed, flags=None, device="cpu", environ=None):
    """[(config key, value, why)] for config `c` on this host's CPU, where `c` still differs and
    this host's probe of the model's step (`probed`: `tfdist.plan.probe.cached_steps`'s dict, or
    None: nothing is recommended) found the setting faster. `flags`, `environ`: the CPU's flags
    and the environment (default: this host's, this process's: a oneDNN cap there may block
    bfloat16, `bf16_blocked`)."""
    if device != "cpu" or not probed:
        return []
    flags = cpu_flags() if flags is None else flags
    t, seconds = c.train, probed["seconds"]
    when = time.strftime("%Y-%m-%d", time.gmtime(probed.get("when", 0)))
    where = f"this host, probed {when}: {probed.get('path')}"
    found = []
    fp32 = seconds.get("float32")
    bf16 = seconds.get("bfloat16")
    if (t.precision == "float32" and fp32 and bf16 and fp32 / bf16 >= FASTER
            and not bf16_blocked(flags, environ)):
        found.append(("train.precision", "mixed_bfloat16",
                      f"this model's step ran {fp32 / bf16:.2f}x faster in bfloat16 than in "
                      f"float32 ({where})"))
    xla = seconds.get("xla")
    if t.precision == "float32" and not t.jit_compile and fp32 and xla and fp32 / xla >= FASTER:
        found.append(("train.jit_compile", True,
                      ("if you keep float32: " if found else "") + f"this model's step ran "
                      f"{fp32 / xla:.2f}x faster in float32 with XLA ({where})"))
    return found


def not_measured(c, device="cpu"):
    """What `tfdist train` says when this model's step has not been probed on this host: that it
    is not measured here, and how to measure it; None where there is nothing to choose (a
    config already in bfloat16 with XLA, or a GPU)."""
    if device != "cpu" or (c.train.precision != "float32" and c.train.jit_compile):
        return None
    return ("not measured here: whether bfloat16 or XLA runs this model's step faster on this "
            "CPU; `tfdist train --probe ...` times it here in float32, with XLA and in bfloat16 "
            "before the run (about 20 s, once: cached in ~/.cache/tfdist), and the run then says")
