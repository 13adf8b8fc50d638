"""What `tfdist plan` shows of its plans: the table, the chart, plan.json, and for the best layout
tfdist runs, the command that runs it (`strategy_command`, from the strategy plugins).

A layout is runnable when a strategy plugin takes it and `tfdist.parallel.layout.Layout.accepts`
it: the very checks of `tfdist train`, with a process's devices on one node, and with the
embedding and head kept whole as tfdist keeps them (`runnable`).

Example (GPT-2 XL's shape on 8 A100s: the fastest layout tfdist runs, and its command):

    >>> from tfdist import plan
    >>> m = plan.Model(name="gpt2-xl", n_layer=48, n_embd=1600, n_head=25, vocab_size=50257,
    ...                seq_len=1024)
    >>> cluster = plan.Cluster(plan.DEVICES["a100-80gb"], 8)
    >>> plans = plan.search(m, cluster, 512, opts=plan.Options(efficiency=plan.calibrated()))
    >>> best = next(p for p in plans if p.fits and plan.runnable(p, cluster))
    >>> best is next(p for p in plans if p.fits)  # the fastest that fits
    True
    >>> cmd = plan.tfdist_command(best, cluster, "--config=configs/gpt2_xl.py", "mixed").split()
    >>> cmd[:4]
    ['tfdist', 'launch', '--workers', '8']
    >>> [a for a in cmd if "batch_size" in a or "accum" in a]  # 8 replicas x 8, 8 per update
    ['--config.train.batch_size=64', '--config.train.grad_accum_steps=8']
"""
import dataclasses
import json
import os

from tfdist.plan.model import GB, Options, config_of


def strategy_command(layout, cluster, flags=()):
    """(plugin class, command) that runs `layout` with `flags` on the cluster's devices, from the
    strategy plugins (`Strategy.plan_command`): a process's pipeline stages and tensor-parallel
    devices are on its own node. (None, "") when no plugin takes it."""
    from tfdist import strategies
    per_node = max(cluster.node() // (layout.pp * layout.tp), 1)  # processes per node
    plugin, command = strategies.for_plan(cluster.device.name, layout.dp, per_node, list(flags))
    return plugin, command or ""


def base_config(model, precision="mixed", config=None):
    """A tfdist config of `model`'s shape (tfdist's GPT, `config_of`: GPT-2's kind or Llama's):
    what a planned layout is judged with, from the user's `config` (its epoch, backup interval,
    ...) or the defaults."""
    from tfdist import config as config_lib
    c = (config or config_lib.default_config()).copy_and_resolve_references()
    c.model.update(config_of(model))
    c.train.precision = "mixed_bfloat16" if precision == "mixed" else "float32"
    return c


def runnable(plan_, cluster, c=None):
    """Whether tfdist runs the plan's layout (`refusal` is None)."""
    return refusal(plan_, cluster, c) is None


def refusal(plan_, cluster, c=None):
    """Why tfdist does not run the plan's layout, in a few words, or None where it does: a
    strategy plugin takes it, the layout object accepts it (`tfdist.parallel.layout.Layout.accepts`:
    the very checks of `tfdist train`, with a process's devices on one node) with config `c`
    (default: `base_config` of the plan's model), and it fits with the embedding and head whole,
    as tfdist keeps them, and with the attention scores stored, as tfdist's attention stores them
    (for a published model priced with FlashAttention)."""
    plugin, _ = strategy_command(plan_.layout, cluster)
    if plugin is None:
        return "no strategy for these devices"
    if not plan_.tfdist_fits:  # "head kept whole: OOM", "scores stored: OOM"
        return f"{plan_.tfdist_overflow or 'head kept whole'}: OOM"
    c = c if c is not None else base_config(plan_.model)
    why = plan_.layout.refusal(c, plugin, local_devices=cluster.node())
    return None if why is None else _few_words(why)


def _few_words(error):
    """A layout check's one-line error, short for a table's cell: its first clause (the checks
    name what they refuse first: "pipeline.recompute=True needs a split model: ...")."""
    return error.split(":")[0].split(";")[0].strip()


def tfdist_command(plan_, cluster, config_arg, precision, opts=None, c=None):
    """The `tfdist train` command for a layout tfdist runs: its config keys
    (`Layout.config_overrides`, with config `c`'s epoch and backup interval made whole updates;
    default: `base_config`), with `opts`' overlap and bucket size where they differ from the
    strategies' defaults."""
    lay = plan_.layout
    c = c if c is not None else base_config(plan_.model)
    flags = [config_arg] + [f"--config.{k}={v}" for k, v in lay.config_overrides(c).items()]
    if opts is not None and lay.dp > 1 and not lay.zero:
        if not opts.overlap:
            flags.append("--config.strategy.overlap=off")
        elif opts.bucket_bytes != Options.bucket_bytes:
            flags.append(f"--config.strategy.bucket_mb={opts.bucket_bytes / 2 ** 20:g}")
    if precision == "mixed":
        flags.append("--config.train.precision=mixed_bfloat16")
    return strategy_command(lay, cluster, flags)[1]


def format_table(plans, cluster, c=None):
    head = (f"{'#':>3}  {'layout':<40} {'GB/dev':>7} {'s/step':>8} {'tok/s':>11} {'MFU':>6}  "
            f"{'bottleneck':<10} tfdist")
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans, 1):
        lines.append(f"{i:>3}  {str(p.layout):<40} {p.memory['total'] / GB:>7.1f} "
                     f"{p.time['total']:>8.3f} {p.tokens_per_sec:>11,.0f} {p.mfu:>6.1%}  "
                     f"{p.time['bottleneck']:<10} {refusal(p, cluster, c) or 'yes'}")
    return "\n".join(lines)


def chart(plans, cluster, c, path, title):
    """Two panels: step time by part, and memory per device by part, for the listed layouts."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{p.layout}{' *' if runnable(p, cluster, c) else ''}" for p in plans][::-1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 0.45 * len(plans) + 3), sharey=True)
    left = [0.0] * len(plans)
    for part, color in (("compute", "tab:blue"), ("memory", "tab:orange"), ("network", "tab:green"),
                        ("bubble", "tab:gray")):
        v = [p.time[part] for p in plans][::-1]
        a.barh(names, v, left=left, color=color, label=part)
        left = [x + y for x, y in zip(left, v)]
    a.set_title("seconds per step, by part")
    a.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=2, frameon=False)
    left = [0.0] * len(plans)
    for part, color in (("weights", "tab:purple"), ("gradients", "tab:red"),
                        ("optimizer", "tab:olive"), ("activations", "tab:cyan")):
        v = [p.memory[part] / GB for p in plans][::-1]
        b.barh(names, v, left=left, color=color, label=part)
        left = [x + y for x, y in zip(left, v)]
    b.axvline(cluster.device.memory / GB, color="k", linestyle="--", label="device memory")
    b.set_title("GB per device, by part")
    b.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=3, frameon=False)
    fig.suptitle(f"{title}   (* runs in tfdist today)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_config(path):
    """The config of a config file (configs/*.py), read without absl's flags."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def report(model, cluster, batch, plans, opts, config_arg, top, out, config=None):
    """Prints the plans that fit (the `top` fastest, each runnable or why not), those that do not,
    the best and the best that tfdist runs with its command; writes `out`/plan.png and plan.json.
    `config`: the user's (`config_arg`'s), which the layouts are judged with."""
    c = base_config(model, opts.precision, config)
    feasible = [p for p in plans if p.fits]
    print(f"{model.name}: {model.params / 1e9:.2f} B parameters, {model.seq_len} tokens per "
          f"sequence; batch {batch} sequences; {cluster.count} x {cluster.device.name} "
          f"({cluster.device.memory / GB:.1f} GB, "
          f"{cluster.device.peak(opts.precision) / 1e12:,.1f} TFLOP/s peak ({opts.precision}), "
          f"{cluster.node()} per node); matmuls at {opts.efficiency:.1%} of peak; "
          f"{len(plans)} layouts, {len(feasible)} fit")
    if feasible:
        print(format_table(feasible[:top], cluster, c))
    over = [p for p in plans if not p.fits]
    if over:  # those that would be fastest if they fitted, with what overflows
        over.sort(key=lambda p: -p.tokens_per_sec)
        print(f"\ndo not fit ({len(over)}), fastest first:")
        for p in over[:min(top, 5)]:
            print(f"  {str(p.layout):<40} {p.overflow}")
    best = next((p for p in feasible if runnable(p, cluster, c)), None)
    print()
    if feasible:
        b = feasible[0]
        print(f"best: {b.layout}: {b.tokens_per_sec:,.0f} tokens/s, MFU {b.mfu:.1%}, "
              f"{b.memory['total'] / GB:.1f} GB per device, bound by {b.time['bottleneck']}")
    if best is None:
        print("no layout tfdist runs today fits: each that fits is one tfdist's layout checks "
              "refuse (`tfdist train` says why), or needs more memory with the embedding and head "
              "kept whole on one device of each tensor-parallel group, as tfdist keeps them")
    else:
        if best is not feasible[0]:
            print(f"best that tfdist runs today: {best.layout}, "
                  f"{best.tokens_per_sec / feasible[0].tokens_per_sec:.0%} of the best's speed")
        print("  " + tfdist_command(best, cluster, config_arg or "--config=<your config>",
                                     opts.precision, opts, c))
    os.makedirs(out, exist_ok=True)
    shown = feasible[:top] or over[:top]
    chart(shown, cluster, c, os.path.join(out, "plan.png"),
          f"{model.name} on {cluster.count} x {cluster.device.name}, batch {batch}")
    with open(os.path.join(out, "plan.json"), "w") as f:
        json.dump({"model": dataclasses.asdict(model), "devices": cluster.count,
                   "device": dataclasses.asdict(cluster.device), "batch": batch,
                   "efficiency": opts.efficiency,
                   "plans": [{"layout": dataclasses.asdict(p.layout), "fits": p.fits,
                              "memory": p.memory, "time": p.time,
                              "tokens_per_sec": p.tokens_per_sec, "mfu": p.mfu,
                              "overflow": p.overflow} for p in plans]}, f, indent=1)
    print(f"wrote {os.path.join(out, 'plan.png')} and plan.json")
