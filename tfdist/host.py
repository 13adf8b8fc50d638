"""What this host's CPU runs fastest: the settings `tfdist train` recommends on the console.

They are said, not applied: each changes the numbers a run computes (bfloat16 rounds; XLA
fuses in another order), so a run keeps the config it was given and a user opts in. A
strategy's own recommended values (TPU's) are applied, as before (`tfdist.train`). The
figures are `make bench-peer`'s on this project's machines (bench_results/peer.json).

    >>> from tfdist import config
    >>> c = config.default_config()
    >>> c.model.n_embd = 128
    >>> [key for key, _, _ in recommendations(c, flags={"avx512f", "amx_bf16"})]
    ['train.precision', 'train.jit_compile']
    >>> c.model.n_embd = 384
    >>> recommendations(c, flags={"avx2"})
    []
"""

#: CPU flags (/proc/cpuinfo) of a native bfloat16 matmul: oneDNN then runs bf16 at about 4x the
#: fp32 rate (1,051-1,156 against 280-318 GFLOP/s for a 2048^3 matmul here).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: The widest model for which XLA (jit_compile) ran the fp32 step faster here: gpt_demo (width
#: 128) 1.07x (1.26x before GELU was fused: tfdist.models.fused); gpt_mini (width 384) 0.95x; in
#: bf16 XLA was slower (0.76x and 0.45x: its CPU matmuls do not use AMX).
XLA_MAX_WIDTH = 128


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


def recommendations(c, flags=None, device="cpu"):
    """[(config key, value, why)] for config `c` on this host's CPU, where `c` still differs."""
    if device != "cpu":
        return []
    flags = cpu_flags() if flags is None else flags
    t, found = c.train, []
    bf16 = sorted(set(BF16_FLAGS) & set(flags))
    if bf16 and t.precision == "float32":
        found.append(("train.precision", "mixed_bfloat16",
                      f"this CPU has {' and '.join(bf16)}; in bfloat16 the step ran 1.3x (gpt_demo) "
                      f"to 2.1x (gpt_mini) faster here, and `make demo` ended within 0.2 % of float32's loss"))
    if t.precision == "float32" and not t.jit_compile and c.model.n_embd <= XLA_MAX_WIDTH:
        found.append(("train.jit_compile", True,
                      ("if you keep float32: " if bf16 else "") + f"a model {c.model.n_embd} "
                      f"wide ran 1.07x faster in float32 with XLA here"))
    return found
