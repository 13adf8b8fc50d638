"""`tfdist train`: train a GPT on a corpus, resuming at the exact step after a crash.

    tfdist train --config=configs/gpt_nano.py --workdir=runs/nano
    tfdist train --config=configs/gpt_mini.py --strategy=mirrored --devices=2 \\
                 --config.train.steps=400 --config.model.dropout=0.1

A run writes into --workdir: `backup/` while it trains (removed at the end), `tensorboard/`,
`metrics.json` (per-step loss, lr, tokens/s; validation loss per epoch in nats/token and bits per
byte), `loss.png`, `tokenizer/` and `model.keras`. The data comes from a token store, prepared on
first use (`tfdist prepare` does it beforehand, in parallel). Run the same command again after a
crash and it resumes at the exact step. The run itself: `tfdist/train.py`.
"""
import os
import sys

from absl import flags
from ml_collections import config_flags

from tfdist import cli  # (and the package: its strategy registry's options join the schema)
from tfdist import config as config_lib
from tfdist.runtime import early
from tfdist.runtime.lock import finished

_CONFIG = cli.define_config_flag(
    "config", cli.DEFAULT_CONFIG,
    "Config file (configs/*.py); override any key with --config.<section>.<key>=value.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default runs/<config name>).")
_STRATEGY = flags.DEFINE_string("strategy", None, "Strategy name; overrides config.strategy.name.")
_DEVICES = flags.DEFINE_integer("devices", None, "Mirrored on CPU: logical CPU devices "
                                "(overrides config.strategy.devices).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a finished run in --workdir.")
_PROBE = flags.DEFINE_bool(
    "probe", False, "First time this model's step on this host in float32, with XLA and in "
    "bfloat16 (one process of its own, about 20 s, cached per CPU model and model shape in "
    "~/.cache/tfdist), so that the run says which runs fastest here; what the run computes is "
    "unchanged.")
_PREPARE_ONLY = flags.DEFINE_bool(
    "prepare_only", False, "Check the config, prepare the dataset and the workdir (applying "
    "--overwrite), then exit without training. `tfdist launch` runs this once before it starts "
    "the workers.")


def resolve_config():
    """The config from flags, with --strategy / --devices applied, validated."""
    c = _CONFIG.value
    with c.unlocked():
        if _STRATEGY.value is not None:
            c.strategy.name = _STRATEGY.value
        if _DEVICES.value is not None:
            c.strategy.devices = _DEVICES.value
    return config_lib.validate(c)  # (an init_from checkpoint's shape: tfdist.train applies it)


def workdir_of():
    """--workdir, or runs/<the config file's name>."""
    return _WORKDIR.value or cli.default_workdir(
        config_flags.get_config_filename(flags.FLAGS["config"]))


def main(argv):
    del argv
    c = resolve_config()
    workdir = workdir_of()
    # The run imports TensorFlow: here, not at the top, so that `--help` answers without it.
    from tfdist import train
    if _PREPARE_ONLY.value:
        # An elastic launch (tfdist/launch/elastic.py) names every size the job may run at.
        sizes = [int(n) for n in os.environ.get("TFDIST_ELASTIC_SIZES", "").split(",") if n]
        train.prepare(c, workdir, overwrite=_OVERWRITE.value, sizes=sizes)
        print(f"tfdist: prepared {workdir} (dataset ready, config checked)")
        return
    if os.environ.get("TFDIST_RESTART_COUNT", "0") != "0" and finished(
            workdir, train.backup_dir(c, workdir)):
        # A launcher's restart of a group that had finished (it was stopped on its way out,
        # e.g. to resize): nothing is left to run.
        print(f"tfdist: {workdir} holds the finished run (model.keras); nothing left to resume")
        return
    if _PROBE.value:
        from tfdist.plan import probe
        try:
            probe.measure_steps(c)
        except RuntimeError as e:  # (the run goes on: it says "not measured here")
            print(f"tfdist: the probe failed ({e}); training without it", flush=True)
    train.train(c, workdir, overwrite=_OVERWRITE.value)


def run(argv=None):
    early.hold(["USR1"])  # a stop asked for while TF starts: honoured at the first step
    cli.run(main, argv or sys.argv)


if __name__ == "__main__":
    run()
