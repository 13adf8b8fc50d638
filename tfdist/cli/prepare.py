"""`tfdist prepare`: turn a corpus into a token store, in parallel, before training.

    tfdist prepare                                            # the stdlib, byte tokenizer
    tfdist prepare --config.data.tokenizer=bpe --config.data.vocab_size=8192
    tfdist prepare --config.data.source=/data/books,/data/web.txt --out=/data/store --workers=16
    tfdist train --config=configs/gpt_mini.py --config.data.source=store:/data/store

It reads the same `--config` (and `--config.data.*` overrides) as `tfdist train`, so without
`--out` it prepares exactly the store that `tfdist train` would use, where `train` will find it
(under `data.data_dir`). Memory stays bounded whatever the corpus size; a progress bar shows MB/s
and tokens/s; an interrupted prepare is finished by running it again, and gives the same store
(same fingerprint). See `tfdist/data/store.py` for the format, `tfdist/data/build.py` for the
build.
"""
import sys

from absl import flags

from tfdist import cli
from tfdist import config as config_lib

_CONFIG = cli.define_config_flag(
    "config", cli.DEFAULT_CONFIG,
    "Config file (configs/*.py); its data section says what to prepare "
    "(--config.data.source, --config.data.tokenizer, --config.data.vocab_size ...).")
_OUT = flags.DEFINE_string("out", None, "Store directory (default: under data.data_dir, named by "
                           "the corpus; where `tfdist train` looks for it).")
_WORKERS = flags.DEFINE_integer("workers", 0, "Tokenizer processes (0: one per CPU core).",
                                lower_bound=0)


def main(argv):
    del argv
    from tfdist.data import build  # (TensorFlow: not before `main`, so `--help` is quick)
    from tfdist.models import huggingface
    c = config_lib.validate(huggingface.apply_init_from(config_lib.validate(_CONFIG.value)))
    s = build.build_store(c.data, out=_OUT.value, workers=_WORKERS.value)
    print(f"tfdist prepare: {s.describe()}; fingerprint {s.fingerprint}")
    if not _OUT.value:
        print(f"tfdist prepare: `tfdist train` with the same data config uses it; elsewhere: "
              f"--config.data.source=store:{s.dir}")


def run(argv=None):
    cli.run(main, argv or sys.argv)


if __name__ == "__main__":
    run()
