"""What the planner knows from the outside: the devices (from their datasheets), the published
models, the published runs, and the one fitted number, calibrated on one of those runs and then
checked against the others (`tfdist plan --validate`).
"""
import dataclasses

from tfdist.plan.model import (
    GB,
    Cluster,
    Device,
    Model,
    Options,
    evaluate,
    memory,
    planned,
    search,
    step_time,
)

# ---------------------------------------------------------------------------------------------
# Devices (the fields: tfdist.plan.model.Device).

MiB = 2**20
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s bf16 dense, 156 TF32, {mem}, "
         "NVLink 600 GB/s bidirectional; DGX A100 user guide: 8 x 200 Gb/s HDR InfiniBand for 8 "
         "GPUs (25 GB/s each)")
_H = ("NVIDIA {name} datasheet (SXM): 989 TFLOP/s bf16 dense, 494 TF32, {mem}, NVLink 900 GB/s "
      "bidirectional; DGX H100: 8 x 400 Gb/s NDR for 8 GPUs (50 GB/s each)")
DEVICES = {
    "a100-40gb": Device("a100-40gb", 312e12, 40960 * MiB, 1.555e12, 300 * GB, 25 * GB, 8,
                        _A100.format(mem="40 GB HBM2 (40,960 MiB) at 1,555 GB/s"), 156e12),
    "a100-80gb": Device("a100-80gb", 312e12, 81920 * MiB, 2.039e12, 300 * GB, 25 * GB, 8,
                        _A100.format(mem="80 GB HBM2e (81,920 MiB) at 2,039 GB/s"), 156e12),
    "h100": Device("h100", 989e12, 81559 * MiB, 3.35e12, 450 * GB, 50 * GB, 8,
                   _H.format(name="H100", mem="80 GB HBM3 (81,559 MiB) at 3.35 TB/s"), 494e12),
    "h200": Device("h200", 989e12, 143771 * MiB, 4.8e12, 450 * GB, 50 * GB, 8,
                   _H.format(name="H200", mem="141 GB HBM3e (143,771 MiB) at 4.8 TB/s"), 494e12),
    "tpu-v4": Device("tpu-v4", 275e12, 32 * 2**30, 1.2e12, 150 * GB, 150 * GB, 4,
                     "Cloud TPU v4 docs (cloud.google.com/tpu/docs/v4): 275 TFLOP/s bf16, "
                     "32 GiB HBM2 at 1,200 GB/s, 4 chips per host; ICI 2,400 Gb/s per chip "
                     "(half each way). A slice is all ICI, so 'inter-node' is ICI too"),
    "tpu-v5e": Device("tpu-v5e", 197e12, 16 * GB, 819 * GB, 200 * GB, 200 * GB, 8,
                      "Cloud TPU v5e docs (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16, "
                      "16 GB HBM2 at 819 GB/s, 8 chips per host, ICI 400 GB/s bidirectional per "
                      "chip; a slice is all ICI"),
}
CPU = "cpu"  # one core of this machine, as measured by `make bench` (see measured.cpu_device)

# ---------------------------------------------------------------------------------------------
# Models: a decoder-only transformer's sizes.


def _m(name, **kw):
    return Model(name=name, **kw)


_MEGATRON = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters "
             "Using Megatron-LM, SC21, arXiv:2104.04473, Table 1 and section 5")
MODELS = {
    "gpt3-175b": _m("gpt3-175b", n_layer=96, n_embd=12288, n_head=96, vocab_size=51200,
                    seq_len=2048,
                    source="Brown et al. 2020 (GPT-3), sizes as trained in " + _MEGATRON),
    "megatron-1t": _m("megatron-1t", n_layer=128, n_embd=25600, n_head=160, vocab_size=51200,
                      seq_len=2048, source=_MEGATRON),
    "llama2-70b": _m("llama2-70b", n_layer=80, n_embd=8192, n_head=64, n_kv_head=8, ffn=28672,
                     gated_mlp=True, bias=False, tied_embeddings=False, learned_positions=False,
                     rms_norm=True, dropout=False, flash_attention=True, vocab_size=32000,
                     seq_len=4096,
                     source="Touvron et al., Llama 2, arXiv:2307.09288 (sizes: the released "
                            "config.json; xformers memory-efficient attention)"),
}
# Llama 3 (grouped-query attention, SwiGLU, RMSNorm, rotary positions, an untied head), as Meta
# trained it (memory-efficient attention, no dropout); their tfdist configs: configs/llama3_*.py.
_LLAMA3 = ("Llama Team, The Llama 3 Herd of Models, arXiv:2407.21783, Table 3, and Meta's Llama 3 "
           "model card (sizes: the released config.json of meta-llama/Meta-Llama-3-{}; {} "
           "parameters)")
_LLAMA = dict(n_kv_head=8, gated_mlp=True, bias=False, tied_embeddings=False,
              learned_positions=False, rms_norm=True, dropout=False, flash_attention=True,
              vocab_size=128256, seq_len=8192)
MODELS.update({
    "llama3-8b": _m("llama3-8b", n_layer=32, n_embd=4096, n_head=32, ffn=14336, **_LLAMA,
                    config="configs/llama3_8b.py", source=_LLAMA3.format("8B", "8,030,261,248")),
    "llama3-70b": _m("llama3-70b", n_layer=80, n_embd=8192, n_head=64, ffn=28672, **_LLAMA,
                     config="configs/llama3_70b.py",
                     source=_LLAMA3.format("70B", "70,553,706,496")),
})

# ---------------------------------------------------------------------------------------------
# Calibration and validation against published runs.

PUBLISHED = {
    "calibration": dict(model="gpt3-175b", device="a100-80gb", devices=1024, batch=1536,
                        layout=planned(1536, dp=8, tp=8, pp=16, microbatch=1, recompute=True,
                                       schedule="1f1b"),
                        tflops=138.0,
                        source=_MEGATRON + " (GPT-3 175B: 138 TFLOP/s per GPU, 44 % of peak)"),
    "megatron-1t": dict(model="megatron-1t", device="a100-80gb", devices=3072, batch=3072,
                        layout=planned(3072, dp=6, tp=8, pp=64, microbatch=1, recompute=True,
                                       schedule="1f1b"),
                        tflops=163.0,
                        source=_MEGATRON + " (1T: 163 TFLOP/s per GPU, 52 % of peak)"),
    "llama2-70b": dict(model="llama2-70b", device="a100-80gb", devices=2048, batch=1024,
                       tokens=2e12, gpu_hours=1_720_320,
                       source="Touvron et al. 2023, Llama 2, arXiv:2307.09288, Table 2: "
                              "1,720,320 A100-80GB GPU-hours for 70B (2T tokens, 4M-token "
                              "batches); GPU count not published, 2048 as for LLaMA-1 65B"),
}
MEGATRON_OPTIONS = Options(schedule="1f1b")


def fit_efficiency(model, cluster, layout, seconds, opts):
    """The fraction of peak at which the model's step takes `seconds` (time falls as it grows)."""
    lo, hi = 1e-3, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        t = step_time(model, cluster, layout, dataclasses.replace(opts, efficiency=mid))["total"]
        lo, hi = (mid, hi) if t > seconds else (lo, mid)
    return (lo + hi) / 2


_CALIBRATED = {}  # calibrated()'s result, computed once


def calibrated():
    """The fraction of peak that makes the model reproduce Megatron-LM's 175B run."""
    if "f" not in _CALIBRATED:
        run = PUBLISHED["calibration"]
        model, cluster = MODELS[run["model"]], Cluster(DEVICES[run["device"]], run["devices"])
        p = evaluate(model, cluster, run["layout"],
                     dataclasses.replace(MEGATRON_OPTIONS, efficiency=0.5))
        flops = p.tflops_per_device * 1e12 * p.time["total"]  # per device per step, any efficiency
        _CALIBRATED["f"] = fit_efficiency(model, cluster, run["layout"],
                                          flops / (run["tflops"] * 1e12), MEGATRON_OPTIONS)
    return _CALIBRATED["f"]


def calibrated_options(opts=None):
    """`opts` with the calibrated fraction of peak, unless it gives one."""
    opts = Options() if opts is None else opts
    return opts if opts.efficiency else dataclasses.replace(opts, efficiency=calibrated())


def validate():
    """Rows of (what, published, predicted, error) for the published runs."""
    rows = []
    for key in ("calibration", "megatron-1t"):
        run = PUBLISHED[key]
        model, cluster = MODELS[run["model"]], Cluster(DEVICES[run["device"]], run["devices"])
        p = evaluate(model, cluster, run["layout"], calibrated_options(MEGATRON_OPTIONS))
        rows.append({"run": f"{run['model']} on {run['devices']} A100, {run['layout']}",
                     "metric": "TFLOP/s per GPU", "published": run["tflops"],
                     "predicted": p.tflops_per_device,
                     "role": "calibration" if key == "calibration" else "prediction",
                     "source": run["source"]})
    run = PUBLISHED["llama2-70b"]
    model, cluster = MODELS[run["model"]], Cluster(DEVICES[run["device"]], run["devices"])
    best = search(model, cluster, run["batch"], opts=calibrated_options(MEGATRON_OPTIONS))[0]
    hours = run["tokens"] / best.tokens_per_sec * cluster.count / 3600
    rows.append({"run": f"llama2-70b, 2T tokens on {run['devices']} A100-80GB, "
                        f"best layout {best.layout}",
                 "metric": "GPU-hours", "published": run["gpu_hours"], "predicted": hours,
                 "role": "prediction", "source": run["source"]})
    for r in rows:
        r["error"] = r["predicted"] / r["published"] - 1
    return rows


def zero_figure1(params=7.5e9, dp=64):
    """ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054) Figure 1: GB per device for 7.5B
    parameters on 64 devices, baseline and ZeRO-1/2/3."""
    model = Model(name="zero-7.5b", n_layer=0, n_embd=0, n_head=1, vocab_size=0, seq_len=0,
                  params_override=params)
    return {z: memory(model, planned(dp, dp, zero=z))["total"] / GB for z in (0, 1, 2, 3)}
