"""`tfdist sample`: generate text from a model saved by `tfdist train`, or straight from a
Hugging Face checkpoint directory (GPT-2 or Llama), over a key/value cache.

    tfdist sample --model=runs/demo/model.keras --prompt='def ' --max_new_tokens=300
    tfdist sample --model=hf:/ckpt/gpt2 --prompt='Hello' --top_k=1     # greedy
    tfdist sample --model=hf:/ckpt/tiny --prompt_ids=5,17,42           # no tokenizer needed
"""
import os
import sys

from absl import flags

from tfdist import cli

_MODEL = flags.DEFINE_string("model", None, "A .keras file written by `tfdist train`, or "
                             "hf:<dir>, a Hugging Face checkpoint directory.")
_PROMPT = flags.DEFINE_string("prompt", "\n", "Text to continue.")
_PROMPT_IDS = flags.DEFINE_string("prompt_ids", None, "The prompt as comma-separated token ids "
                                  "(e.g. 5,17,42), for a checkpoint without a tokenizer; prints "
                                  "the ids generated.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature (> 0).",
                                  lower_bound=1e-6)
_TOP_K = flags.DEFINE_integer("top_k", 40, "Sample from the k most likely tokens (0: all).",
                              lower_bound=0)
_NUM = flags.DEFINE_integer("num_samples", 1, "How many samples.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def prompt_ids(text, vocab_size):
    """--prompt_ids as a list of ints; UsageError if malformed or outside the vocabulary."""
    from tfdist.errors import UsageError
    try:
        ids = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--prompt_ids={text!r}: give comma-separated token ids, e.g. "
                         f"5,17,42") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if not ids or bad:
        raise UsageError(f"--prompt_ids={text!r}: give at least one id, each in [0, "
                         f"{vocab_size}) (the model's vocabulary)")
    return ids


def main(argv):
    del argv
    from tfdist.models import huggingface, saved
    ids = _PROMPT_IDS.value is not None
    if huggingface.is_hf(_MODEL.value):
        model, tok = saved.load_checkpoint(_MODEL.value, need_tokenizer=not ids)
    else:
        model = saved.load_model(_MODEL.value)
        tok = None if ids else saved.load_tokenizer(_MODEL.value, model)
    prompt = prompt_ids(_PROMPT_IDS.value, model.vocab_size) if ids else tok.encode(_PROMPT.value)
    if len(prompt) == 0:
        from tfdist.errors import UsageError
        raise UsageError("--prompt is empty: give some text to continue (or --prompt_ids)")
    for i in range(_NUM.value):
        out = model.generate(prompt, _MAX_NEW.value, temperature=_TEMPERATURE.value,
                             top_k=_TOP_K.value or None, seed=_SEED.value + i,
                             vocab_size=tok.vocab_size if tok else None)
        print(f"--- sample {i + 1} ({os.path.basename(_MODEL.value.rstrip('/'))}) ---")
        if ids:
            print(",".join(str(int(t)) for t in out[0]))
        else:
            print(tok.decode(out[0]))


def run(argv=None):
    cli.run(main, argv or sys.argv)


if __name__ == "__main__":
    run()
