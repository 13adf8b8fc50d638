"""Benchmark: sampling tokens/s of tfdist (`GPT.generate`, what `tfdist sample` runs) against
transformers' `generate`, on the same model, on this CPU (`make bench-sample`).

    python tools/bench/sample.py                      # GPT-2 124M's shape and a small Llama
    python tools/bench/sample.py --rounds=5 --new_tokens=256

Each model is made by transformers with random weights, saved as a Hugging Face checkpoint and
loaded by tfdist from it (`tfdist.models.huggingface`), so both run the same weights; their greedy
tokens are compared. Per round, in one process and in turn (the order rotated each round, so
the noisy machine's drift falls on each alike), each variant decodes `--new_tokens` tokens after
a `--prompt`-token prompt, batch 1, greedy:

* `tfdist`: `GPT.generate(top_k=1)` over its key/value cache (its compiled functions warmed up
  before the rounds, as a second `tfdist sample` of the same shape would find them);
* `tfdist, no cache`: what `GPT.generate` did before the cache: the whole context run again
  for every new token (`full_forward`, kept here only to measure it);
* `transformers`: `model.generate(do_sample=False)` with its cache, torch on the same 2 cores.

The figure is the median over rounds of tokens/s, and tfdist's ratio to transformers' within
each round. It prints a table and writes bench_results/sample.json.
"""
import json
import os
import statistics
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import ROUNDS, write_json  # noqa: E402

_NEW = flags.DEFINE_integer("new_tokens", 128, "Tokens generated per round and variant.")
_PROMPT = flags.DEFINE_integer("prompt", 32, "Prompt length (random token ids).")


def models():
    """(name, transformers config) of the models measured."""
    import transformers
    gpt2 = transformers.GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    llama = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                     num_hidden_layers=8, num_attention_heads=8,
                                     num_key_value_heads=2, max_position_embeddings=1024,
                                     tie_word_embeddings=False)
    return [("gpt2-124M", gpt2), ("llama-8x512-gqa", llama)]


def full_forward(gpt, prompt, new_tokens):
    """The cache-less greedy decoding `GPT.generate` did before: the whole context each token."""
    import numpy as np
    import tensorflow as tf

    @tf.function(reduce_retracing=True)
    def last_logits(ctx):
        return gpt(ctx, training=False)[:, -1, :]

    idx = prompt
    for _ in range(new_tokens):
        nxt = tf.argmax(last_logits(tf.constant(idx[:, -gpt.block_size:])), -1, tf.int32)
        idx = np.concatenate([idx, nxt.numpy()[:, None]], axis=1)
    return idx


def measure(name, config, rounds, new_tokens, prompt_len):
    import numpy as np
    import torch
    import transformers

    from tfdist.models import huggingface

    torch.manual_seed(0)
    cls = (transformers.GPT2LMHeadModel if isinstance(config, transformers.GPT2Config)
           else transformers.LlamaForCausalLM)
    theirs = cls(config).eval()
    directory = tempfile.mkdtemp(prefix="bench-sample-")
    theirs.save_pretrained(directory)
    ours, _ = huggingface.load_gpt(directory)
    prompt = np.random.RandomState(0).randint(0, config.vocab_size, (1, prompt_len))

    def run_tfdist():
        return ours.generate(prompt, new_tokens, top_k=1)

    def run_full():
        return full_forward(ours, prompt.astype("int32"), new_tokens)

    def run_transformers():
        with torch.no_grad():
            return theirs.generate(torch.tensor(prompt), max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=0).numpy()

    variants = {"tfdist": run_tfdist, "tfdist, no cache": run_full,
                "transformers": run_transformers}
    outputs = {k: f() for k, f in variants.items()}  # warm-up (compiles), and the tokens
    agree = {k: int((outputs[k][0, prompt_len:] == outputs["transformers"][0, prompt_len:])
                    .sum()) for k in ("tfdist", "tfdist, no cache")}
    times = {k: [] for k in variants}
    order = list(variants)
    for r in range(rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            start = time.perf_counter()
            variants[k]()
            times[k].append(time.perf_counter() - start)
    rate = {k: [new_tokens / t for t in v] for k, v in times.items()}
    ratios = [a / b for a, b in zip(rate["tfdist"], rate["transformers"])]
    before = [a / b for a, b in zip(rate["tfdist, no cache"], rate["transformers"])]
    return {"model": name, "params": ours.num_params(), "prompt": prompt_len,
            "new_tokens": new_tokens,
            "tokens_per_sec": {k: statistics.median(v) for k, v in rate.items()},
            "rounds": rate, "ratio_to_transformers": statistics.median(ratios),
            "ratio_to_transformers_without_cache": statistics.median(before),
            "greedy_tokens_equal_to_transformers": agree}


def main(argv):
    del argv
    import torch
    torch.set_num_threads(os.cpu_count())
    results = [measure(name, config, ROUNDS.value, _NEW.value, _PROMPT.value)
               for name, config in models()]
    print(f"\n{'model':<18} {'params':>12} {'tfdist':>9} {'no cache':>9} {'transformers':>13} "
          f"{'ratio':>6} {'before':>7}   (tokens/s, batch 1, greedy)")
    for r in results:
        t, before = r["tokens_per_sec"], r["ratio_to_transformers_without_cache"]
        print(f"{r['model']:<18} {r['params']:>12,} {t['tfdist']:>9.1f} "
              f"{t['tfdist, no cache']:>9.1f} {t['transformers']:>13.1f} "
              f"{r['ratio_to_transformers']:>5.2f}x {before:>6.2f}x")
    print(json.dumps({r["model"]: r["greedy_tokens_equal_to_transformers"] for r in results}))
    write_json({"command": "python tools/bench/sample.py", "results": results},
               "bench_results/sample.json")


if __name__ == "__main__":
    app.run(main)
