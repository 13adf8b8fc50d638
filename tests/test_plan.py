"""`tfdist plan`: the memory and step-time model against the papers it follows and the published
runs it predicts, the search and its output, this machine's calibration, and bad input."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, first_fast, run
from tfdist import config as tfdist_config
from tfdist import plan

GB = 1e9


def tfdist_plan(*args, cwd=ROOT):
    """`tfdist plan ARGS`: as a process of the tests' warm agent from the repository root (as
    tests.helpers.run does), a new process elsewhere."""
    if cwd == ROOT:
        return run([sys.executable, "-m", "tfdist", "plan", *args], timeout=120, check=False)
    return subprocess.run([sys.executable, "-m", "tfdist", "plan", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


# --- the published figures (the acceptance list) -----------------------------------------

def apply_flags(c, cmd):
    """Config `c` with the `--config.<section>.<key>=value` flags of command `cmd` (a list)."""
    for arg in cmd:
        if arg.startswith("--config."):
            key, value = arg[len("--config."):].split("=")
            section, key = key.split(".")
            kind = type(c[section][key])
            c[section][key] = (value == "True") if kind is bool else kind(value)


def test_zero_paper_figure_1():
    """7.5B parameters, N_d = 64, mixed-precision Adam (K = 12): 120 / 31.4 / 16.6 / 1.9 GB."""
    got = plan.zero_figure1()
    exact = {0: 16 * 7.5, 1: 4 * 7.5 + 12 * 7.5 / 64, 2: 2 * 7.5 + 14 * 7.5 / 64, 3: 16 * 7.5 / 64}
    paper = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}  # as printed in the figure, one decimal
    for z in range(4):
        assert got[z] == pytest.approx(exact[z], rel=1e-9)  # the paper's formulas
        assert round(got[z], 1) == paper[z]  # ... and its printed figures
    for z in range(3):
        assert abs(got[z] / paper[z] - 1) <= 0.01
    # ZeRO-3 is 1.875 GB: 1.3 % under the printed 1.9, which is 1.875 rounded to one decimal


@pytest.mark.slow
def test_zero_figure_1_from_the_command_line():
    r = tfdist_plan("--params=7.5e9", "--devices=64", "--batch=64")
    assert r.returncode == 0, r.stderr
    assert [line.split(": ")[1].split(" GB")[0] for line in r.stdout.splitlines()] == \
        ["120.00", "31.41", "16.64", "1.88"]


def test_calibration_reproduces_megatron_175b():
    rows = plan.validate()
    assert rows[0]["role"] == "calibration" and abs(rows[0]["error"]) < 1e-3
    assert 0.3 < plan.calibrated() < 0.9  # a plausible fraction of the A100's peak


def test_predicts_megatron_1t_within_15_percent():
    row = plan.validate()[1]
    assert row["published"] == 163.0 and "megatron-1t" in row["run"]
    assert abs(row["error"]) <= 0.15, row


def test_predicts_llama2_70b_gpu_hours_within_15_percent():
    row = plan.validate()[2]
    assert row["published"] == 1_720_320 and row["metric"] == "GPU-hours"
    assert abs(row["error"]) <= 0.15, row


@pytest.mark.slow
def test_validate_prints_the_table():
    r = tfdist_plan("--validate")
    assert r.returncode == 0, r.stderr
    for row in plan.validate():
        assert (f"published {row['published']:,.1f}, predicted {row['predicted']:,.1f} "
                f"({row['error']:+.1%})") in r.stdout
    for text in ("published 138.0", "published 163.0", "published 1,720,320.0", "arXiv:2104.04473",
                 "arXiv:2307.09288", "ZeRO Figure 1"):
        assert text in r.stdout


# --- the parts of the model ----------------------------------------------------------------------

def test_parameter_counts_match_the_papers_and_tfdists_gpt():
    assert plan.MODELS["megatron-1t"].params / 1e9 == pytest.approx(1008.0, abs=0.05)  # Table 1
    assert plan.MODELS["gpt3-175b"].params / 1e9 == pytest.approx(174.6, abs=0.05)
    # released weights
    assert plan.MODELS["llama2-70b"].params / 1e9 == pytest.approx(68.98, abs=0.01)
    from tfdist import config as config_lib
    from tfdist.models.gpt import GPT
    for name in ("gpt_nano", "gpt_mini"):
        c = plan.load_config(os.path.join(ROOT, "configs", f"{name}.py"))
        c.model.vocab_size = config_lib.vocab_size(c)  # the byte tokenizer's 256
        gpt = GPT.from_model_config(c.model)
        gpt.build()
        assert plan.model_from_config(c, name).params == gpt.num_params()


LLAMA3 = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496}  # Meta's released weights


@pytest.mark.parametrize("name", LLAMA3)
def test_llama3_parameter_counts_are_the_published(name):
    """The named models, their configs (configs/llama3_*.py) and tfdist's GPT of each config
    count Meta's figures exactly: per layer q and out h x h, k and v h x kv (8 key/value heads),
    SwiGLU's three h x ffn, two RMSNorm scales; the token embedding and an untied head, V x h
    each; the final norm."""
    from tfdist.models.gpt import GPT
    published = LLAMA3[name]
    named = plan.MODELS[name.replace("_", "-")]
    c = plan.load_config(os.path.join(ROOT, "configs", f"{name}.py"))
    tfdist_config.validate(c)
    model = plan.model_from_config(c, name)
    L, h, heads, ffn = model.n_layer, model.n_embd, model.n_head, model.ffn
    kv = h // heads * 8
    assert L * (2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h) + 2 * 128256 * h + h == published
    assert named.params == model.params == published
    assert GPT.from_model_config(c.model).num_params() == published  # (not built: 8 to 70 B)
    # the same shape; the named one priced as Meta trained it (memory-efficient attention)
    assert dataclasses.replace(named, name=name, flash_attention=False, config="",
                               source="") == model
    assert named.config == f"configs/{name}.py" and "arXiv:2407.21783" in named.source
    # what wrong formulas count instead: keys and values as wide as the queries, a head tied
    # to the embedding, a two-matrix MLP
    for wrong in (dict(n_kv_head=0), dict(tied_embeddings=True), dict(gated_mlp=False)):
        assert dataclasses.replace(model, **wrong).params != published, wrong


def test_a_llama_config_is_priced_as_tfdists_gpt_builds_it():
    """A llama config with the default MLP width (model.ffn_hidden 0: 8/3 x n_embd, rounded up to
    a multiple of 64), grouped keys and an untied head: the planner's parameters are the built
    GPT's, and its default width is the GPT's (tfdist.models.gpt imports TensorFlow, the planner
    does not: one formula in each place)."""
    from tfdist.models import gpt as gpt_lib
    c = tfdist_config.default_config()
    c.model.update(arch="llama", vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=48,
                   bias=False, tie_embeddings=False)
    gpt = gpt_lib.GPT.from_model_config(c.model)
    gpt.build()
    model = plan.model_from_config(c, "llama")
    assert model.ffn == gpt.ffn_hidden == 128  # 8/3 x 48 = 128, and not GPT-2's 4 x 48 = 192
    assert model.params == gpt.count_params()
    assert (model.gated_mlp, model.rms_norm, model.learned_positions) == (True, True, False)
    # and back: the config a plan is judged with, and the command's, is this shape again
    assert {k: c.model[k] for k in plan.config_of(model)} == plan.config_of(model)


def test_planning_llama3_8b_gives_a_layout_tfdist_runs():
    """configs/llama3_8b.py (batch 512 x 8192 tokens) on 64 H100: the fastest layout that fits
    is one tfdist runs, judged with the llama config (8 key/value heads), and its command is
    that config file with valid keys, whose layout is the planned one."""
    from tfdist import strategies
    from tfdist.parallel.layout import Layout
    c = plan.load_config(os.path.join(ROOT, "configs", "llama3_8b.py"))
    model = plan.model_from_config(c, "llama3_8b")
    cluster = plan.Cluster(plan.DEVICES["h100"], 64)
    plans = plan.search(model, cluster, 512, opts=plan.calibrated_options())
    judged = plan.base_config(model, "mixed", c)
    assert (judged.model.arch, judged.model.n_kv_head, judged.model.ffn_hidden) == (
        "llama", 8, 14336)
    first = next(p for p in plans if p.fits)
    assert plan.runnable(first, cluster, judged), (first.layout,
                                                   plan.refusal(first, cluster, judged))
    assert first.layout.tp > 1 and first.memory["total"] <= 0.95 * cluster.device.memory
    # one 8,192-token sequence's activations alone need more than an H100 without tensor
    # parallelism: tfdist's attention keeps the scores, 2 a s / h = 128 of the 169 per s h
    assert not any(p.fits for p in plans if p.layout.tp == 1 and not p.layout.recompute)
    cmd = plan.tfdist_command(first, cluster, "--config=configs/llama3_8b.py", "mixed",
                              c=judged).split()
    assert "--config=configs/llama3_8b.py" in cmd
    apply_flags(c, cmd)
    c.strategy.name = "multi_worker_mirrored"  # (the launchers' default)
    tfdist_config.validate(c)
    got = Layout.from_config(c, strategies.get_class(c.strategy.name),
                             replicas=first.layout.dp, local_devices=cluster.node())
    assert (got.dp, got.tp, got.sp, got.accumulate, got.zero) == (
        first.layout.dp, first.layout.tp, first.layout.sp, first.layout.accumulate,
        first.layout.zero)
    # tensor parallelism only over divisors of the 8 key/value heads, even on 16-device nodes
    # (the companion: the same model with multi-head attention is split 16 ways there)
    wide = plan.Cluster(plan.DEVICES["h100"], 64, per_node=16)
    assert {lay.tp for lay in plan.layouts(model, wide, 512)} == {1, 2, 4, 8}
    mha = dataclasses.replace(model, n_kv_head=0)
    assert {lay.tp for lay in plan.layouts(mha, wide, 512)} == {1, 2, 4, 8, 16}


def test_a_model_priced_with_flash_attention_is_run_by_tfdist_with_its_scores():
    """The named llama3-70b is priced as Meta trained it (no attention scores stored); tfdist's
    GPT stores them, so a layout that fits only without them is not offered as a tfdist command
    ("scores stored: OOM"), and the layout tfdist is told to run fits as the config prices it."""
    named = plan.MODELS["llama3-70b"]
    c = plan.load_config(os.path.join(ROOT, "configs", "llama3_70b.py"))
    cluster, o = plan.Cluster(plan.DEVICES["h100"], 512), plan.calibrated_options()
    lay = plan.planned(512, 64, tp=8, microbatch=1, zero=2, sp=True)
    p = plan.evaluate(named, cluster, lay, o)
    as_tfdist = plan.evaluate(plan.model_from_config(c, "llama3_70b"), cluster, lay, o)
    assert p.fits and not as_tfdist.fits  # the scores: 2 a s / h = 128 values per s h
    assert plan.refusal(p, cluster, plan.base_config(named, "mixed", c)) == "scores stored: OOM"
    best = next(q for q in plan.search(named, cluster, 512, opts=o)
                if q.fits and plan.runnable(q, cluster, c))
    assert plan.evaluate(plan.model_from_config(c, "llama3_70b"), cluster, best.layout, o).fits


def test_activation_memory_is_korthikanti_equation():
    """s b h (34 + 5 a s / h) without tensor parallelism; s b h (10 + 24/t + 5 a s / (h t)) with
    t."""
    m = plan.MODELS["gpt3-175b"]
    s, h, a, b = m.seq_len, m.n_embd, m.n_head, 2
    for t in (1, 2, 8):
        got = plan.activation_bytes_per_layer(m, plan.planned(b, 1, tp=t), b * s, "mixed")
        assert got == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    flash = dataclasses.replace(m, flash_attention=True)
    assert (plan.activation_bytes_per_layer(flash, plan.planned(1, 1), s, "mixed")
            == pytest.approx(34 * s * h))


def test_recomputation_and_1f1b_shrink_activations():
    m, batch = plan.MODELS["gpt3-175b"], 64
    full = plan.memory(m, plan.planned(batch, 1, tp=8, pp=8), plan.Options(schedule="1f1b"))
    rc = plan.memory(m, plan.planned(batch, 1, tp=8, pp=8, recompute=True),
                     plan.Options(schedule="1f1b"))
    gpipe = plan.memory(m, plan.planned(batch, 1, tp=8, pp=8), plan.Options(schedule="gpipe"))
    assert rc["activations"] < full["activations"] / 5
    # GPipe keeps all 64 microbatches, 1F1B at most pp = 8 on the first stage
    assert gpipe["activations"] > 7 * full["activations"]
    assert full["weights"] == rc["weights"] == gpipe["weights"]


def test_ring_allreduce_and_the_pipeline_bubble():
    assert plan.allreduce_seconds(8e9, 4, 10e9) == pytest.approx(2 * 3 / 4 * 0.8)
    assert plan.allreduce_seconds(8e9, 1, 10e9) == 0
    # no communication and no element-wise term: the bubble is exactly (K-1)/(M+K-1)
    dev = plan.Device("ideal", 1e12, 1e12, None, math.inf, math.inf, 64, "test")
    m = dataclasses.replace(plan.MODELS["gpt3-175b"], n_layer=32, tied_embeddings=False)
    for k, mbs in ((4, 1), (4, 8), (8, 16)):
        lay = plan.planned(64, 1, pp=k, microbatch=64 // mbs)
        t = plan.step_time(m, plan.Cluster(dev, k), lay, plan.Options(efficiency=0.5))
        assert t["bubble"] / t["total"] == pytest.approx((k - 1) / (mbs + k - 1), rel=0.02)


def test_zero3_memory_is_a_share_of_the_weights_plus_two_gathered_layers():
    """ZeRO-3 (tfdist.parallel.zero.weights): 1/N of the weights, plus the layer that runs and the
    one prefetched, gathered whole."""
    m = plan.MODELS["gpt3-175b"]
    z2 = plan.memory(m, plan.planned(64, 8, tp=8, zero=2))
    z3 = plan.memory(m, plan.planned(64, 8, tp=8, zero=3))
    assert z3["weights"] == pytest.approx(z2["weights"] / 8, rel=1e-9)
    assert z3["gathered"] == pytest.approx(2 * m.layer_params() / 8 * 2, rel=1e-9)  # fp16 bytes
    assert "gathered" not in z2


def test_data_parallel_time_and_zero_traffic():
    m, c = plan.MODELS["gpt3-175b"], plan.Cluster(plan.DEVICES["a100-80gb"], 64)
    o = plan.calibrated_options()
    base = plan.step_time(m, c, plan.planned(64, 8, tp=8), o)
    z1 = plan.step_time(m, c, plan.planned(64, 8, tp=8, zero=1), o)
    z3 = plan.step_time(m, c, plan.planned(64, 8, tp=8, zero=3), o)
    grads = plan.stage_params(m, 1) / 8 * 2
    dp = plan.allreduce_seconds(grads, 8, 25e9)  # the 8 replicas span 8 nodes: InfiniBand
    tp = 96 * 4 * plan.allreduce_seconds(2048 * 12288 * 2, 8, 300e9)  # 4 per layer, within a node
    # 8 microbatches of 1, then the ring
    assert base["network"] == pytest.approx(8 * tp + dp, rel=1e-9)
    # ZeRO-3 (the ZeRO paper's 1.5x an all-reduce) gathers and reduce-scatters for each of the
    # 8 accumulated microbatches; with one microbatch of 8 sequences, once
    assert z3["network"] - z1["network"] == pytest.approx((1.5 * 8 - 1) * dp, rel=1e-6)
    one = [plan.step_time(m, c, plan.planned(64, 8, tp=8, microbatch=8, zero=z), o)
           for z in (1, 3)]
    assert one[1]["network"] - one[0]["network"] == pytest.approx(0.5 * dp, rel=1e-6)


def test_float32_runs_at_the_float32_rate():
    m, c = plan.MODELS["gpt3-175b"], plan.Cluster(plan.DEVICES["a100-80gb"], 8)
    lay = plan.planned(8, 1, tp=8)
    mixed = plan.step_time(m, c, lay, plan.Options(precision="mixed", efficiency=0.5))
    fp32 = plan.step_time(m, c, lay, plan.Options(precision="float32", efficiency=0.5))
    assert fp32["compute"] == pytest.approx(2 * mixed["compute"])  # TF32 156 vs bf16 312 TFLOP/s
    assert plan.memory(m, lay, plan.Options(precision="float32"))["weights"] == \
        2 * plan.memory(m, lay, plan.Options(precision="mixed"))["weights"]


# --- the search and its output -------------------------------------------------------------------

def test_search_ranks_feasible_layouts_and_explains_the_others():
    m = plan.MODELS["gpt3-175b"]
    plans = plan.search(m, plan.Cluster(plan.DEVICES["a100-80gb"], 64), 64,
                        opts=plan.calibrated_options())
    fits = [p for p in plans if p.fits]
    ranked = [float(f"{p.tokens_per_sec:.4g}") for p in fits]  # (ranked to 4 digits, then simpler)
    assert fits and ranked == sorted(ranked, reverse=True)
    assert all(p.memory["total"] <= 0.95 * plan.DEVICES["a100-80gb"].memory for p in fits)
    over = [p for p in plans if not p.fits]
    assert over and all(p.overflow.startswith("needs ") for p in over)
    # pure data parallelism cannot hold 175B parameters' states (16 bytes each) on one 80 GB GPU
    dp_only = next(p for p in over if p.layout == plan.planned(64, 64, microbatch=1))
    assert "optimizer" in dp_only.overflow


def test_the_recommended_command_is_valid_tfdist_flags():
    m = plan.load_config(os.path.join(ROOT, "configs", "gpt2_xl.py"))
    model = plan.model_from_config(m, "gpt2_xl")
    cluster = plan.Cluster(plan.DEVICES["a100-40gb"], 8)
    opts = plan.calibrated_options()
    for lay in (plan.planned(64, 2, pp=4, microbatch=4, recompute=True),
                plan.planned(64, 2, pp=4, microbatch=4, zero=1, recompute=True)):
        p = plan.evaluate(model, cluster, lay, opts)
        assert plan.runnable(p, cluster)
        cmd = plan.tfdist_command(p, cluster, "--config=configs/gpt2_xl.py", "mixed")
        c = plan.load_config(os.path.join(ROOT, "configs", "gpt2_xl.py"))
        for arg in cmd.split():
            if arg.startswith("--config."):
                key, value = arg[len("--config."):].split("=")
                section, name = key.split(".")
                c[section][name] = type(c[section][name])(
                    value == "True" if value in ("True", "False") else value)
        tfdist_config.validate(c)  # every key exists and every value is valid
        assert "--config.pipeline.stages=4" in cmd and "--config.pipeline.microbatches=8" in cmd
        assert cmd.startswith("tfdist launch --workers 2 ")
        assert ("--config.zero.stage=1" in cmd) == (lay.zero == 1)
    # microbatches without a pipeline are gradient accumulation: runnable under
    # multi_worker_mirrored, ZeRO-3 included (keras-team/keras#20582 once refused them)
    for lay in (plan.planned(64, 8, microbatch=2), plan.planned(64, 8, microbatch=2, zero=1),
                plan.planned(64, 8, zero=3)):
        p = plan.evaluate(model, cluster, lay, opts)
        assert p.fits and p.tfdist_fits and plan.runnable(p, cluster), lay
        cmd = plan.tfdist_command(p, cluster, "--config=configs/gpt2_xl.py", "mixed")
        assert f"--config.train.grad_accum_steps={lay.accumulate}" in cmd, cmd
    # a layout tfdist refuses says why in its row, in the first words of the refusal
    recompute = plan.evaluate(model, cluster, plan.planned(64, 8, microbatch=2, recompute=True),
                              opts)
    assert plan.refusal(recompute, cluster) == "pipeline.recompute=True needs a split model"
    assert "pipeline.recompute=True needs a split model" in plan.format_table([recompute],
                                                                              cluster)


PAIRS = [("gpt2_xl", "a100-40gb", 16, 256), ("gpt2", "h100", 8, 64),
         ("gpt_mini", "a100-80gb", 4, 32)]  # the model/cluster pairs the planner is checked on


def test_a_command_rounds_the_configs_epoch_and_backup_to_whole_updates():
    """An update of k batches never straddles an epoch's end or a backup: the command of a layout
    with accumulation sets the config's epoch, steps and backup interval to whole updates where
    they are not (the default config's 100 steps per epoch, backup every 50: k = 8)."""
    lay = plan.planned(512, 8, microbatch=8)
    assert lay.accumulate == 8
    overrides = lay.config_overrides(tfdist_config.default_config())
    assert (overrides["train.steps_per_epoch"], overrides["train.steps"],
            overrides["backup.every_steps"]) == (104, 208, 56)
    c = tfdist_config.default_config()
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    tfdist_config.validate(c)  # whole updates: accepted
    assert plan.planned(512, 8, microbatch=8).config_overrides() == {
        "train.batch_size": 64, "train.grad_accum_steps": 8}  # (no config: the layout's keys)


def scaled_to_gpt_nano(cmd, data_dir, workdir):
    """The planner's command for a GPT on many accelerators, scaled to gpt_nano on 2 worker
    processes here: its strategy, accumulation and ZeRO stage kept, each replica's batch kept,
    float32 (bfloat16 on this CPU is the `bf16` tests'), 2 updates."""
    args = cmd.split()
    dp = (int(args[args.index("--workers") + 1]) if "--workers" in args else
          math.prod(int(a.split("=")[1]) for a in args
                    if a.startswith(("--nodes=", "--ntasks-per-node="))))
    keys = dict(a[len("--config."):].split("=") for a in args if a.startswith("--config."))
    k = int(keys.get("train.grad_accum_steps", 1))
    flags = [f"--config.{key}={value}" for key, value in keys.items()
             if key in ("train.grad_accum_steps", "zero.stage", "pipeline.stages",
                        "pipeline.microbatches", "tensor.parallel")]
    strategy = [a for a in args if a.startswith("--strategy=")]
    return ["launch", *strategy, "--workers=2", "--max_restarts=0", "--",
            "--config=configs/gpt_nano.py", f"--workdir={workdir}",
            f"--config.data.data_dir={data_dir}", *flags,
            f"--config.train.batch_size={2 * int(keys['train.batch_size']) // dp}",
            f"--config.train.steps={2 * k}", f"--config.train.steps_per_epoch={2 * k}",
            f"--config.train.warmup_steps={k}", f"--config.backup.every_steps={k}",
            "--config.train.eval_steps=1"], k


@pytest.mark.slow
def test_the_first_ranked_layout_runs_and_its_command_scaled_to_gpt_nano_trains(tmp_path,
                                                                                 data_dir):
    """For each model/cluster pair: the fastest layout that fits is one tfdist runs (data
    parallelism with accumulation and ZeRO-2, which keras-team/keras#20582 once kept from
    multi_worker_mirrored), and its command, scaled to gpt_nano, trains its 2 updates."""
    from tests.helpers import tfdist
    scaled = {}
    for name, device, devices, batch in PAIRS:
        c = plan.load_config(os.path.join(ROOT, "configs", f"{name}.py"))
        model = plan.model_from_config(c, name)
        cluster = plan.Cluster(plan.DEVICES[device], devices)
        first = next(p for p in plan.search(model, cluster, batch, opts=plan.calibrated_options())
                     if p.fits)
        judged = plan.base_config(model, "mixed", c)  # the config file's, as `tfdist plan` does
        assert plan.runnable(first, cluster, judged), (name, first.layout,
                                                       plan.refusal(first, cluster, judged))
        cmd = plan.tfdist_command(first, cluster, f"--config=configs/{name}.py", "mixed",
                                  c=judged)
        flags, k = scaled_to_gpt_nano(cmd, data_dir, tmp_path / name)
        scaled.setdefault(tuple(flags[5:]), (name, flags, k))  # (the same run once)
    assert any(k > 1 for _, _, k in scaled.values())  # (one pair's first layout accumulates)
    for _, flags, k in scaled.values():
        p = tfdist(*flags, timeout=300, check=False)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        done = (f"{2 * k} steps run (step {2 * k} of {2 * k}; optimizer update 2, of {k} batches "
                f"each)" if k > 1 else f"{2 * k} steps run (step {2 * k} of {2 * k})")
        assert done in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]


def test_command_line_writes_table_chart_and_json(tmp_path):
    r = tfdist_plan("--config=configs/gpt2_xl.py", "--device=a100-40gb", "--devices=16",
                    "--batch=256", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "bottleneck" in r.stdout and "best:" in r.stdout
    assert "tfdist launch --workers" in r.stdout or "sbatch --nodes" in r.stdout
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    out = json.loads((tmp_path / "plan.json").read_text())
    assert out["batch"] == 256 and any(p["fits"] for p in out["plans"])
    assert "do not fit" in r.stdout  # gpt2_xl's pipeline layouts with all 256 sequences in flight


def test_plan_prices_the_llama3_configs_from_the_command_line(tmp_path):
    r = tfdist_plan("--config=configs/llama3_8b.py", "--device=h100", "--devices=64",
                    f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("llama3_8b: 8.03 B parameters, 8192 tokens per sequence; batch 512")
    cmd = next(line for line in r.stdout.splitlines() if "--config=configs/llama3_8b.py" in line)
    assert "--config.tensor.parallel=" in cmd
    out = json.loads((tmp_path / "plan.json").read_text())
    assert (out["model"]["n_kv_head"], out["model"]["ffn"], out["model"]["gated_mlp"]) == (
        8, 14336, True)


@pytest.mark.slow
def test_a_named_llama3_model_recommends_its_config(tmp_path):
    r = tfdist_plan("--model=llama3-70b", "--device=h100", "--devices=512", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("llama3-70b: 70.55 B parameters, 8192 tokens per sequence; "
                               "batch 512")  # (the config's batch: 4M tokens)
    assert "scores stored: OOM" in r.stdout
    assert "--config=configs/llama3_70b.py --config.train.batch_size=" in r.stdout
    # a named model without a config: configs/gpt2.py made its shape, Llama's keys included
    r = tfdist_plan("--model=llama2-70b", "--device=a100-80gb", "--devices=256", "--batch=1024",
                    "--top=1", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert ("--config=configs/gpt2.py --config.model.n_layer=80 --config.model.n_embd=8192 "
            "--config.model.n_head=64 --config.model.vocab_size=32000 "
            "--config.model.block_size=4096 --config.model.arch=llama --config.model.n_kv_head=8 "
            "--config.model.ffn_hidden=28672 --config.model.bias=False "
            "--config.model.tie_embeddings=False") in r.stdout


# --- this machine ------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_command_keeps_the_users_model_changes_and_pinned_dims(tmp_path):
    r = tfdist_plan("--config=configs/gpt_mini.py", "--config.model.n_layer=4", "--n_embd=192",
                    "--devices=2", "--batch=32", "--device=a100-40gb", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr
    cmd = next(line for line in r.stdout.splitlines()
               if "tfdist launch" in line or "tfdist train" in line)
    assert "--config=configs/gpt_mini.py --config.model.n_layer=4 --config.model.n_embd=192" in cmd
    # a pinned tensor-parallel degree larger than a node is evaluated, over the network
    r = tfdist_plan("--model=gpt3-175b", "--devices=64", "--tp=16", "--batch=64",
                    f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "tp=16" in r.stdout and "bound by network" in r.stdout


def _fake_bench(d, with_pipeline=True):
    d.mkdir(exist_ok=True)
    (d / "bench.json").write_text(json.dumps({"matmul_peak_flops": 300e9, "cores": 2}))
    (d / "scaling.json").write_text(json.dumps({"batch_per_worker": 16, "tokens_per_sec_1": 1400.0,
                                                "scaling_efficiency": 0.9}))
    (d / "allreduce.json").write_text(json.dumps({"rows": [{"size_mb": 64.0, "tf ring (MWMS)": {
        "busbw_GBps": 0.3}, "horovod/gloo": {"busbw_GBps": 0.8}}]}))
    if with_pipeline:
        (d / "pipeline.json").write_text(json.dumps({"stages": 2, "batch": 16, "rows": [
            {"variant": "unsplit-1", "microbatches": None, "step_time_s": 2.8},
            {"variant": "K=2, M=8", "microbatches": 8, "step_time_s": 1.333, "speedup": 1.5,
             "speedup_vs_1_inter_op_thread": 2.1}]}))


@pytest.mark.slow
def test_measured_predicts_the_benches_from_their_inputs(tmp_path):
    _fake_bench(tmp_path)
    mini = plan.model_from_config(plan.load_config(os.path.join(ROOT, "configs", "gpt_mini.py")),
                                  "gpt_mini")
    rows = {r["figure"]: r for r in plan.measured(str(tmp_path), mini)}
    eff = rows["scaling.json: MWMS, 2 processes vs 1"]
    t1 = 16 * 256 / 1400.0
    grads = mini.params * 4  # float32 gradients, 2 workers: the ring sends the buffer once
    # no tensor.json, so no contention; the reference itself is unloaded: the step is the
    # one-process step plus the all-reduce at the measured 0.3 GB/s, on the cores (not hidden)
    assert eff["predicted"] == pytest.approx(t1 / (t1 + grads / 0.3e9), rel=1e-3)
    assert (eff["measured"] == 0.9 and eff["within"]
            and eff["error"] == pytest.approx(eff["predicted"] / 0.9 - 1))
    assert rows["scaling-horovod.json"]["missing"] == "make bench-scaling-horovod"
    assert rows["tensor.json"]["missing"] == "make bench-model-parallel"
    pipe = rows["pipeline.json: K=2, M=8 speedup vs one core"]
    # just under the ideal KM/(M+K-1)
    assert 1.6 < pipe["predicted"] < 16 / 9 and pipe["measured"] == 2.1
    assert not pipe["within"] and "faster than 2 cores' worth" in pipe["reason"]  # 2.1 > K: named
    r = tfdist_plan("--measured", "--config=configs/gpt_mini.py", f"--bench_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert ("predicted" in r.stdout
            and "not measured here: run `make bench-scaling-horovod`" in r.stdout)
    assert "within 10 %" in r.stdout and "OFF" in r.stdout


def test_every_committed_benchmark_row_is_predicted_within_10_percent_or_named():
    """The committed bench_results/: every figure of every benchmark the planner models is printed
    beside its prediction, and each is within ±10 % or says why not; the ones the issue names
    (loopback, links, Horovod, the parameter server, pipeline, ZeRO) are predictions within ±10 %
    where docs/benchmarks.md does not call the run unusable."""
    bench_dir = os.path.join(ROOT, "bench_results")
    mini = plan.model_from_config(plan.load_config(os.path.join(ROOT, "configs", "gpt_mini.py")),
                                  "gpt_mini")
    rows = plan.measured(bench_dir, mini)
    assert not [r for r in rows if "missing" in r]
    judged = [r for r in rows if "measured" in r]
    for r in judged:
        assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1)
        assert r["within"] == (abs(r["error"]) <= 0.10), r
        assert r["within"] or r["reason"], r  # off, and says why
    fitted = [r["figure"] for r in judged if r.get("fitted")]
    assert fitted[0] == "tensor.json: t=2 speedup vs one core"
    # (the framework's own time is fitted on the small models' rows of auto.json: those rows)
    assert all(f.startswith(("auto.json: gpt_nano ", "auto.json: gpt_mini ")) for f in fitted[1:])
    by_file = {}
    for r in judged:
        by_file.setdefault(r["figure"].split(":")[0], []).append(r)

    def load(name):
        with open(os.path.join(bench_dir, name)) as f:
            return json.load(f)
    # one row per committed row
    for name in os.listdir(bench_dir):
        if name.startswith("scaling"):
            assert len(by_file[name]) == 1, name
    # less the reference
    assert len(by_file["overlap.json"]) == len(load("overlap.json")["rows"]) - 1
    assert len(by_file["pipeline.json"]) == sum(1 for r in load("pipeline.json")["rows"]
                                                if r["microbatches"])
    for name in ("zero.json", "zero-mwms.json", "overlap-1gbit.json"):
        assert len(by_file[name]) == len(load(name)["rows"]) - 1  # (less the reference)
    assert len(by_file["schedules.json"]) == len(load("schedules.json")["rows"])
    assert {r["figure"].split(":")[0] for r in rows if "input" in r} >= {
        "bench.json", "allreduce.json", "allreduce-1gbit.json", "allreduce-10gbit.json",
        "allreduce-100mbit.json"}
    # the issues' rows: predictions within ±10 % (issue 60: MWMS and Horovod at 10 Gbit/s,
    # 1 Gbit/s and 100 Mbit/s)
    links = [f"scaling{s}-{link}.json" for s in ("", "-horovod", "-horovod-fp16")
             for link in ("10gbit", "1gbit", "100mbit")]
    for name in ("scaling.json", "scaling-horovod.json", "scaling-horovod-fp16.json", *links,
                 "scaling-1gbit-straggler100mbit.json", "scaling-ps.json", "scaling-ps-1gbit.json",
                 "scaling-ps-10gbit.json", "zero.json", "zero-mwms.json",
                 "overlap-1gbit.json"):
        assert all(r["within"] for r in by_file[name]), by_file[name]
    assert sum(r["within"] for r in by_file["pipeline.json"]) >= 4
    assert all(r["within"] for r in by_file["offload.json"])
    # GPT-2 XL's offloaded step: off, with the framework's time priced and left (docs/planner.md)
    assert "framework's time" in by_file["offload-xl.json"][0]["reason"]
    # auto's pick: the best measured layout's tokens/s within 10 % wherever it is another run
    picks = [r for r in by_file["auto.json"] if "auto's tokens/s" in r["figure"]]
    assert len(picks) == 7 and all(r["within"] or "best layout itself" in r["reason"]
                                   for r in picks)
    # the rows the model leaves out are named as such
    for name in ("scaling-ps-100mbit.json", "scaling-ps-1gbit-straggler100mbit.json"):
        assert not by_file[name][0]["within"] and "ps task's own link" in by_file[name][0]["reason"]


@pytest.mark.slow
def test_cpu_device_without_a_bench_is_one_clear_line(tmp_path):
    r = tfdist_plan("--device=cpu", "--devices=2", "--config=configs/gpt_mini.py",
                    f"--bench_dir={tmp_path}")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"tfdist: error: this CPU has not been measured: no {tmp_path}/bench.json; "
        f"run `make bench` first (or pick another --device)"]
    _fake_bench(tmp_path, with_pipeline=False)
    r = tfdist_plan("--device=cpu", "--devices=2", f"--config={ROOT}/configs/gpt_mini.py",
                    f"--bench_dir={tmp_path}", f"--out={tmp_path / 'out'}",
                    cwd=tmp_path)  # outside the repo
    assert r.returncode == 0, r.stderr
    assert "x cpu" in r.stdout
    assert "tfdist train --config=" in r.stdout or "tfdist launch --workers 2" in r.stdout


@pytest.mark.parametrize("args, message", first_fast([
    (["--model=gpt3-175b", "--device=b200"], "unknown --device 'b200'; choose one of a100-40gb"),
    (["--model=gpt3-175b", "--devices=-8"], "--devices=-8 must be > 0"),
    (["--model=gpt3-175b", "--devices=64", "--batch=100", "--dp=8"],
     "--batch=100 does not split into 8 data-parallel replicas"),
    (["--model=gpt3-175b", "--devices=64", "--batch=97", "--tp=8", "--pp=4"],
     "--batch=97 does not split into 2 data-parallel replicas x microbatches of 1"),
    (["--model=gpt4"], "unknown --model 'gpt4'"),
    (["--model=gpt3-175b", "--tp=5"], "--tp=5 must divide the 96 attention heads"),
    (["--model=llama3-8b", "--devices=64", "--tp=16"],
     "--tp=16 must divide the 8 key/value heads"),
    (["--model=gpt3-175b", "--devices=12", "--pp=8"],
     "--devices=12 is not a multiple of tp x pp = 8"),
    (["--devices=8"], "say which model"),
    (["--config=configs/nope.py"], "config file 'configs/nope.py' not found"),
    (["--model=gpt3-175b", "--efficiency=1.5"], "--efficiency=1.5 is a fraction of peak"),
    (["--model=gpt3-175b", "--devices=64", "--pp=2", "--zero=2"],
     "--zero=2 with --pp=2: ZeRO-2 shards"),
]))
def test_bad_input_is_one_line_and_exit_2(args, message):
    r = tfdist_plan(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert (len(lines) == 1 and lines[0].startswith("tfdist: error: ")
            and message in lines[0]), r.stderr


@pytest.mark.parametrize("name,device,devices,batch", PAIRS)
def test_every_layout_the_planner_calls_runnable_is_what_its_command_runs(name, device, devices,
                                                                           batch):
    """Over every layout the planner enumerates: the command it prints for a runnable one is a
    config that `tfdist train` accepts (its config rules, then `tfdist.parallel.layout.Layout`, the
    one judge) and whose layout is the planned one; the others it calls modelled."""
    from tfdist import strategies
    from tfdist.parallel.layout import Layout
    c0 = plan.load_config(os.path.join(ROOT, "configs", f"{name}.py"))
    model, cluster = plan.model_from_config(c0, name), plan.Cluster(plan.DEVICES[device], devices)
    plans = plan.search(model, cluster, batch, opts=plan.calibrated_options())
    judged = plan.base_config(model, "mixed", c0)  # the config file's, as `tfdist plan` judges
    ran = 0
    for p in plans:
        if not plan.runnable(p, cluster, judged):
            continue
        ran += 1
        cmd = plan.tfdist_command(p, cluster, f"--config=configs/{name}.py", "mixed",
                                  c=judged).split()
        c = plan.load_config(os.path.join(ROOT, "configs", f"{name}.py"))
        apply_flags(c, cmd)
        processes = (int(cmd[cmd.index("--workers") + 1]) if "--workers" in cmd else
                     math.prod(int(a.split("=")[1]) for a in cmd
                               if a.startswith(("--nodes=", "--ntasks-per-node="))) or 1)
        given = [a.split("=", 1)[1] for a in cmd if a.startswith("--strategy=")]
        if given or cmd[0] in ("sbatch",) or cmd[:2] == ["tfdist", "launch"]:
            c.strategy.name = (given or ["multi_worker_mirrored"])[0]  # (the launchers' default)
        tfdist_config.validate(c)
        plugin = strategies.get_class(c.strategy.name)
        got = Layout.from_config(c, plugin, replicas=processes, local_devices=cluster.node())
        assert (got.dp, got.tp, got.pp, got.microbatches, got.accumulate, got.zero, got.recompute,
                got.batch) == (p.layout.dp, p.layout.tp, p.layout.pp, p.layout.microbatches,
                               p.layout.accumulate, p.layout.zero, p.layout.recompute,
                               p.layout.batch), (cmd, p.layout)
    assert 0 < ran < len(plans), (ran, len(plans))


# -- the gradients' routes across hosts (tfdist/plan/comm.py) -------------------------------------
#: Rows the planner's bytes miss, and why: Horovod's controller talks with rank 0 every cycle
#: (HOROVOD_CYCLE_TIME, 5 ms here) about every tensor ready, about 0.5 MB a 4-s step of
#: gpt_mini, which only shows beside PowerSGD's 1.1 MB. At 100 Mbit/s MWMS's PowerSGD sent
#: 1.27 MB a step against 1.11 at 1 Gbit/s: likely TCP's resends of what the tbf queue (50 ms of
#: the rate, 625 KB) dropped when both workers of a host send at once (the flat ring's 1.044x
#: against 1.016x at 1 Gbit/s says the same, smaller); not checked.
LINK_MISSES = {("horovod", "powersgd", "1gbit"): "Horovod's controller messages",
               ("multi_worker_mirrored", "powersgd", "100mbit"): "resends at 100 Mbit/s"}


@pytest.mark.parametrize("name", ["links-1gbit.json", "links-horovod-1gbit.json",
                                  "links-100mbit.json"])
def test_the_planner_prices_the_bytes_the_links_carried(name):
    """Every committed row of tools/bench/links.py (bytes counted at the links) within 10 % of
    tfdist.plan.comm's bytes out of the busiest host, but the misses named above."""
    from tfdist.plan import comm
    with open(os.path.join(ROOT, "bench_results", name)) as f:
        bench = json.load(f)
    model = plan.model_from_config(
        plan.load_config(os.path.join(ROOT, "configs", bench["config"])), "bench")
    for row in bench["rows"]:
        order = "interleaved" if row["placement"] == "abab" and row["run"] != "hierarchy" \
            else "hosts"
        route = row["run"].split("_")[0]
        predicted = comm.routes(model, bench["hosts"], bench["workers_per_host"], rank=4,
                                order=order)[route]
        ratio = max(row["tx_bytes_per_step"]) / predicted
        if (bench["strategy"], route, bench["link"]) in LINK_MISSES:
            assert ratio > 1.1, "a named miss that no longer misses: drop it"
            continue
        assert 0.9 <= ratio <= 1.1, (row["run"], ratio)


def test_a_slow_link_recommends_islands_and_a_fast_one_the_ring():
    from tfdist.plan import comm
    m = plan.model_from_config(plan.load_config(os.path.join(ROOT, "configs", "gpt_mini.py")),
                               "gpt_mini")
    assert comm.recommend(m, 2, 2, 10e9 / 8, compute_seconds=4.0)[0] == "flat"
    assert comm.recommend(m, 2, 2, 1e9 / 8, compute_seconds=0.3)[0] == "powersgd"
    route, why = comm.recommend(m, 2, 2, 1e6 / 8, compute_seconds=0.3)
    assert route == "islands" and "0.001 Gbit/s" in why
