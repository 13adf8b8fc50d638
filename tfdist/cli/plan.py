"""`tfdist plan`: for a model and a cluster, which parallel layout fits in memory, and which is
fastest.

A first-principles model: devices, models, layouts, memory per device, time per step and the
search (tfdist/plan/model.py), the published devices, models and runs (published.py), this
machine's benches (machine.py), and the command line (this file). It covers data parallelism
(DP), pipeline stages (PP: K stages, M microbatches), tensor parallelism (TP) and ZeRO-1/2/3
sharding of the optimizer state, the gradients and (ZeRO-3) the weights, whose gathered layers
it counts too. The recommended command is the best layout tfdist runs
(`tfdist.parallel.layout.Layout` accepts it: ZeRO-2 without pipeline stages, a process's stages
and tensor-parallel devices on one node, the embedding and head kept whole as tfdist keeps them,
the attention scores stored as tfdist's attention stores them). GPT-2's kind and Llama's
(grouped-query attention, SwiGLU: configs/llama3_8b.py, --model=llama3-70b) are priced alike.
The transformer's arithmetic (parameters, FLOPs, activation and model-state bytes) is
tfdist.models.arithmetic's, which the GPT and the pipeline's memory estimate use too.

One number is fitted: the fraction of peak FLOP/s that matrix multiplies reach. It is calibrated
on Megatron-LM's GPT-3 175B run and then checked, without refitting, against Megatron's 1T run and
LLaMA-2 70B's published cost (`tfdist plan --validate`). On this machine it is fitted to the
bench's measured step time instead, and the bench's other figures are predicted
(`tfdist plan --measured`).

    tfdist plan --config=configs/gpt2_xl.py --device=a100-80gb --devices=16 --batch=512
    tfdist plan --model=llama2-70b --device=a100-80gb --devices=2048 --batch=1024
    tfdist plan --config=configs/llama3_8b.py --device=h100 --devices=64
    tfdist plan --validate

In Python:

    from tfdist import plan
    m = plan.MODELS["gpt3-175b"]
    best = plan.search(m, plan.Cluster(plan.DEVICES["a100-80gb"], 1024), batch=1536)[0]
    print(best.layout, best.tflops_per_device)
"""
import dataclasses
import os
import sys

from tfdist import cli
from tfdist.errors import UsageError
from tfdist.plan import comm
from tfdist.plan.benchmarks import measured
from tfdist.plan.machine import (
    cpu_device,
    fit_to_one_process,
    offload_rates,
    precision_efficiency,
    read_bench,
)
from tfdist.plan.model import (
    GB,
    Cluster,
    Model,
    Options,
    config_of,
    memory,
    model_from_config,
    planned,
    search,
)
from tfdist.plan.published import (
    CPU,
    DEVICES,
    MODELS,
    PUBLISHED,
    calibrated,
    validate,
    zero_figure1,
)
from tfdist.plan.report import load_config, report


def _define_flags():
    from absl import flags

    cli.define_config_flag("config", None,
                           "A tfdist config (configs/*.py): its model, batch and sequence.")
    f = flags
    f.DEFINE_string("model", None, f"A published model instead of --config: {', '.join(MODELS)}.")
    for name, text in (("n_layer", "layers"), ("n_embd", "width"), ("n_head", "attention heads"),
                       ("vocab_size", "vocabulary")):
        f.DEFINE_integer(name, None,
                         f"Model {text} (sizes given directly; overrides --config/--model).")
    f.DEFINE_integer("seq_len", None, "Sequence length (default: the config's block_size).")
    f.DEFINE_float("params", None, "Use this parameter count for the model states (e.g. 7.5e9).")
    f.DEFINE_integer("batch", None,
                     "Global batch in sequences per optimizer step (default: the config's).")
    f.DEFINE_string("device", "a100-80gb", f"Device type: {', '.join(DEVICES)} or {CPU} "
                    f"(this machine, from `make bench`).")
    f.DEFINE_integer("devices", 8, "Number of devices.")
    f.DEFINE_integer("per_node", None, "Devices per node (default: the device's usual node).")
    f.DEFINE_float("intra_node_gbps", None, "Per-device bandwidth inside a node, GB/s one way.")
    f.DEFINE_float("inter_node_gbps", None, "Per-device bandwidth between nodes, GB/s one way.")
    for name in ("dp", "tp", "pp", "microbatch", "zero"):
        f.DEFINE_integer(name, None, f"Fix the layout's {name} (default: search).")
    f.DEFINE_enum("recompute", "search", ["search", "on", "off"], "Activation recomputation.")
    f.DEFINE_enum("precision", None, ["mixed", "float32"], "Default: mixed; float32 on the CPU.")
    f.DEFINE_enum("schedule", "gpipe", ["gpipe", "1f1b"], "Pipeline schedule (tfdist's is gpipe).")
    f.DEFINE_float("efficiency", None, "Fraction of peak FLOP/s matmuls reach (default: calibrated "
                   "on Megatron-LM's 175B run; on the CPU, on the bench).")
    f.DEFINE_bool("overlap", True, "Model the data-parallel all-reduce in buckets of --bucket_mb "
                  "that start during the backward pass, as tfdist's multi_worker_mirrored and "
                  "horovod run it by default (not with ZeRO); --nooverlap: after the backward "
                  "pass.")
    f.DEFINE_float("bucket_mb", 25.0, "Gradient bucket size in MiB (tfdist's strategy.bucket_mb).")
    f.DEFINE_integer("top", 10, "Feasible layouts to list.")
    f.DEFINE_string("out", "runs/plan", "Directory for plan.png and plan.json.")
    f.DEFINE_string("bench_dir", "bench_results", "Where `make bench*` wrote its JSON.")
    f.DEFINE_bool("validate", False, "Print predictions against the published runs and exit.")
    f.DEFINE_bool("per_layer", False, "For tfdist's GPT on a mesh of --devices devices "
                  "(keras.distribution through tfdist.parallel.mesh): pick each layer's split "
                  "(vocabulary-parallel embedding, each block's attention and MLP) and which "
                  "blocks recompute, by a dynamic program within --memory_gb a device; writes "
                  "<out>/layout_map.json.")
    f.DEFINE_float("memory_gb", None, "--per_layer: GiB a device may hold (default: the "
                   "device's memory).")
    f.DEFINE_bool("measured", False,
                  "Print predictions against this machine's benchmarks and exit.")
    return flags.FLAGS


def _positive(name, value):
    if value is not None and value <= 0:
        raise UsageError(f"--{name}={value} must be > 0")


_SET_BY_PLAN = ("train.batch_size", "train.precision", "train.grad_accum_steps", "pipeline.stages",
                "pipeline.microbatches", "pipeline.recompute")


def _model_overrides(model, keys):
    return " ".join(f"--config.model.{'block_size' if k == 'seq_len' else k}={getattr(model, k)}"
                    for k in keys)


def _shape_overrides(model):
    """The config flags that make configs/gpt2.py tfdist's GPT of `model`'s shape
    (`config_of`): its sizes, and its architecture's keys where they are not the defaults."""
    from tfdist import config as config_lib
    shape, default = config_of(model), config_lib.default_config().model
    keys = ["n_layer", "n_embd", "n_head", "vocab_size", "block_size"] + [
        k for k in ("arch", "n_kv_head", "ffn_hidden", "bias", "tie_embeddings")
        if shape[k] != default[k]]
    return " ".join(f"--config.model.{k}={shape[k]}" for k in keys)


def _model_from_flags(F):
    from ml_collections import config_flags
    if F.model and F.config:
        raise UsageError("give --config or --model, not both")
    if F.model:
        if F.model not in MODELS:
            raise UsageError(f"unknown --model '{F.model}'; choose one of {', '.join(MODELS)} "
                             f"or --config=configs/<name>.py")
        model, config_arg, c = MODELS[F.model], None, None
        batch = next((r["batch"] for r in PUBLISHED.values() if r["model"] == F.model), None)
        if model.config:  # its tfdist config (configs/llama3_8b.py): its batch; the command runs it
            c = load_config(os.path.join(cli.REPO, model.config))
            batch, config_arg = batch or c.train.batch_size, f"--config={model.config}"
    elif F.config:
        c = F.config
        name = os.path.splitext(os.path.basename(config_flags.get_config_filename(F["config"])))[0]
        model, batch = model_from_config(c, name), c.train.batch_size
        config_arg = f"--config={config_flags.get_config_filename(F['config'])}"
    elif F.n_layer or F.params:
        model, batch, config_arg, c = None, None, None, None
    else:
        raise UsageError("say which model: --config=configs/<name>.py, --model=<name> "
                         f"({', '.join(MODELS)}), or its sizes "
                         "(--n_layer --n_embd --n_head --vocab_size)")
    sizes = {k: F[k].value for k in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len")
             if F[k].value is not None}
    for k, v in sizes.items():
        _positive(k, v)
    if model is None:
        missing = ([k for k in ("n_layer", "n_embd", "n_head") if k not in sizes]
                   if not F.params else [])
        if missing:
            raise UsageError(f"sizes given directly need --{' --'.join(missing)} too")
        model = Model(name="custom", n_layer=sizes.get("n_layer", 0), n_embd=sizes.get("n_embd", 0),
                      n_head=sizes.get("n_head", 1), vocab_size=sizes.get("vocab_size", 50257),
                      seq_len=sizes.get("seq_len", 2048))
    else:
        model = dataclasses.replace(model, **sizes)
    if config_arg is None:  # tfdist's GPT of the same shape (GPT-2's kind or Llama's)
        config_arg = "--config=configs/gpt2.py " + _shape_overrides(model)
    else:  # the config file, the user's own overrides, then the sizes given directly
        own = [a for a in sys.argv
               if a.startswith("--config.") and a.split("=")[0][9:] not in _SET_BY_PLAN]
        config_arg = " ".join([config_arg, *own, _model_overrides(model, sizes)]).strip()
    if F.params is not None:
        _positive("params", F.params)
        model = dataclasses.replace(model, params_override=F.params)
    if model.n_layer and model.n_embd % model.n_head:
        raise UsageError(f"n_embd ({model.n_embd}) must be a multiple of n_head ({model.n_head})")
    return model, batch, config_arg, c


def main(argv):
    del argv
    F = _FLAGS
    if F.validate:
        print(f"fraction of peak that matmuls reach, calibrated on Megatron-LM 175B: "
              f"{calibrated():.3f}")
        for r in validate():
            print(f"{r['role']:<11} {r['run']}\n"
                  f"            {r['metric']}: published {r['published']:,.1f}, "
                  f"predicted {r['predicted']:,.1f} ({r['error']:+.1%})\n"
                  f"            source: {r['source']}")
        z = zero_figure1()
        print("ZeRO Figure 1 (7.5B parameters, 64 devices), GB per device: " + ", ".join(
            f"{k} {z[i]:.2f}" for i, k in enumerate(("baseline", "ZeRO-1", "ZeRO-2", "ZeRO-3")))
            + " (paper: 120, 31.4, 16.6, 1.9)")
        return
    if F.device != CPU and F.device not in DEVICES:
        raise UsageError(f"unknown --device '{F.device}'; "
                         f"choose one of {', '.join(DEVICES)}, {CPU}")
    for name in ("devices", "per_node", "intra_node_gbps", "inter_node_gbps", "batch", "top",
                 "dp", "tp", "pp", "microbatch", "efficiency"):
        _positive(name, F[name].value)
    if F.zero is not None and F.zero not in (0, 1, 2, 3):
        raise UsageError(f"--zero={F.zero} must be 0, 1, 2 or 3")
    if F.efficiency is not None and F.efficiency > 1:
        raise UsageError(f"--efficiency={F.efficiency} is a fraction of peak: "
                         f"give a number in (0, 1]")
    model, config_batch, config_arg, config = _model_from_flags(F)
    if F.measured:
        if not model.n_layer:
            raise UsageError("--measured needs a model with sizes "
                             "(e.g. --config=configs/gpt_mini.py)")
        for r in measured(F.bench_dir, model):  # one line per benchmark row (and input)
            if "missing" in r:
                print(f"{r['figure']:<64} not measured here: run `{r['missing']}`")
            elif "input" in r:
                print(f"{r['figure']:<64} input: {r['input']}")
            else:
                verdict = "fitted" if r.get("fitted") else "within 10 %" if r["within"] else "OFF"
                print(f"{r['figure']:<64} measured {r['measured']:6.3f}  "
                      f"predicted {r['predicted']:6.3f}  "
                      f"{r['error']:+6.1%}  {verdict:<11}  {r.get('reason') or r['note']}")
        return
    device = cpu_device(F.bench_dir) if F.device == CPU else DEVICES[F.device]
    cluster = Cluster(device, F.devices, F.per_node or 0, (F.intra_node_gbps or 0) * GB,
                      (F.inter_node_gbps or 0) * GB)
    batch = F.batch or config_batch
    if not batch:
        raise UsageError("say the global batch: --batch=<sequences per optimizer step>")
    precision = F.precision or ("float32" if F.device == CPU else "mixed")
    eff = F.efficiency
    if F.device == CPU and not eff:
        s = read_bench(F.bench_dir, "scaling.json")
        if s and model.n_layer:
            mini = model_from_config(
                load_config(os.path.join(cli.REPO, "configs", "gpt_mini.py")), "gpt_mini")
            eff = precision_efficiency(F.bench_dir, "float32" if precision == "float32" else
                                       "bfloat16", fit_to_one_process(device, mini, s))
        else:
            eff = 0.5
    eff = eff or calibrated()
    if F.per_layer:
        return _per_layer(F, model, device, cluster, batch, eff, precision)
    if F.bucket_mb <= 0:
        raise UsageError(f"--bucket_mb={F.bucket_mb:g} must be a gradient bucket size in MiB > 0")
    # (a CPU here: ZeRO-Offload priced at the disk's and the CPU step's measured rates, when
    # `make bench-disk` has run; the planner then offers offload where nothing else fits)
    rates = offload_rates(F.bench_dir) if F.device == CPU else {}
    opts = Options(precision=precision, schedule=F.schedule, efficiency=eff, overlap=F.overlap,
                   bucket_bytes=F.bucket_mb * 2 ** 20, **rates)
    fixed = {k: F[k].value for k in ("dp", "tp", "pp", "microbatch", "zero")
             if F[k].value is not None}
    if F.recompute != "search":
        fixed["recompute"] = F.recompute == "on"
    _check_fixed(model, cluster, batch, fixed)
    plans = search(model, cluster, batch, fixed, opts) if model.n_layer else []
    if not model.n_layer:  # only a parameter count: model states per device, ZeRO stages
        for z in (0, 1, 2, 3):
            lay = planned(batch, fixed.get("dp", cluster.count), zero=z)
            print(f"ZeRO-{z}: {memory(model, lay, opts)['total'] / GB:.2f} GB "
                  f"of model states per device")
        return
    if not plans:
        raise UsageError(f"no layout of {cluster.count} devices splits a batch of {batch} and "
                         f"{model.n_layer} layers as asked; change --batch, --devices or the "
                         f"fixed dims")
    report(model, cluster, batch, plans, opts, config_arg, F.top, F.out, config)
    for line in comm.describe(model, cluster, plans[0]):
        print(line)


def _per_layer(F, model, device, cluster, batch, eff, precision):
    """`--per_layer`: each layer's split on a mesh of the devices (tfdist.plan.layers)."""
    from tfdist.plan import layers
    _positive("memory_gb", F.memory_gb)
    t = cluster.count
    budget = F.memory_gb * 2 ** 30 if F.memory_gb else device.memory
    rates = layers.Rates(device.peak(precision) * eff, cluster.bandwidth(t))
    p = layers.plan(model, t, batch * model.seq_len, budget, rates)
    print(f"per layer, {model.name} on {t} devices ({device.name}), {batch} x {model.seq_len} "
          f"tokens a step, {budget / 2 ** 30:.3g} GiB a device:")
    for name, split in p.split.items():
        whole, parted = p.options[name]
        o = parted if split else whole
        no, yes = ("keep", "redo") if name.startswith("remat.") else ("whole", "split")
        print(f"  {name:<10} {yes if split else no:<6} {o.bytes / 2 ** 30:8.3f} GiB "
              f"{o.seconds:9.4f} s   ({no} {whole.bytes / 2 ** 30:.3f} GiB {whole.seconds:.4f} s;"
              f" {yes} {parted.bytes / 2 ** 30:.3f} GiB {parted.seconds:.4f} s)")
    print(f"  activations and logits {p.fixed / 2 ** 30:.3f} GiB; in all {p.bytes / 2 ** 30:.3f} "
          f"GiB a device, {p.seconds:.3f} s a step")
    os.makedirs(F.out, exist_ok=True)
    path = os.path.join(F.out, "layout_map.json")
    layers.write(p, path)
    print(f"layout map: {path} (tfdist.plan.layers.to_layout_map({path!r}, mesh); the blocks "
          f"to recompute, GPT(recompute=...): {p.recomputed()})")


def _check_fixed(model, cluster, batch, fixed):
    g = cluster.count
    tp, pp = fixed.get("tp", 1), fixed.get("pp", 1)
    if model.n_layer and model.n_head % tp:
        raise UsageError(f"--tp={tp} must divide the {model.n_head} attention heads")
    if model.n_layer and model.n_kv_head and model.n_kv_head % tp:
        raise UsageError(f"--tp={tp} must divide the {model.n_kv_head} key/value heads")
    if model.n_layer and pp > model.n_layer:
        raise UsageError(f"--pp={pp} is more stages than the model's {model.n_layer} layers")
    if "dp" in fixed and ("tp" in fixed and "pp" in fixed) and fixed["dp"] * tp * pp != g:
        raise UsageError(f"dp x tp x pp = {fixed['dp'] * tp * pp} but --devices={g}; "
                         f"make them equal")
    if g % (tp * pp):
        raise UsageError(f"--devices={g} is not a multiple of tp x pp = {tp * pp}")
    if fixed.get("zero", 0) == 2 and pp > 1:
        raise UsageError(f"--zero=2 with --pp={pp}: ZeRO-2 shards the gradients that each pipeline "
                         f"stage accumulates over its microbatches; use --zero=1 or 3, or --pp=1")
    if fixed.get("zero", 0) and fixed.get("dp") == 1:
        raise UsageError("ZeRO shards over data-parallel replicas and --dp=1 has none; drop --zero")
    dp = fixed.get("dp", g // (tp * pp) if ("tp" in fixed or "pp" in fixed) else None)
    if dp:
        mb = fixed.get("microbatch", 1)
        if batch % (dp * mb):
            raise UsageError(f"--batch={batch} does not split into {dp} data-parallel replicas x "
                             f"microbatches of {mb}; give a batch that is a multiple of {dp * mb}")


_FLAGS = None


def run(argv=None):
    global _FLAGS
    _FLAGS = _define_flags()
    cli.run(main, argv or sys.argv, tensorflow=False)  # the planner is pure Python


if __name__ == "__main__":
    run()
