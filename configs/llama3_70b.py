"""llama3_70b: Llama 3 70B (80 layers, 64 query heads over 8 key/value heads, width 8192, SwiGLU
28672 wide, context 8192, vocab 128256, rotary base 500000, no biases, an untied head;
70,553,706,496 parameters), for planning (`tfdist plan --config=configs/llama3_70b.py`).

Source: Meta's Llama 3 model card and released config.json (meta-llama/Meta-Llama-3-70B), and
Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 3 (its shape, and the peak
learning rate 1.5e-4). The rest of the training is as configs/llama3_8b.py's (4M-token batches,
15T tokens, mixed bfloat16). The vocabulary is Llama 3's size: train it on Llama 3
tokens (`--config.data.tokenizer=<dir>/tokenizer.json`).
"""
from tfdist.config import default_config


def get_config():
    c = default_config()
    c.model.update(arch="llama", vocab_size=128256, block_size=8192, n_layer=80, n_head=64,
                   n_kv_head=8, n_embd=8192, ffn_hidden=28672, dropout=0.0, bias=False,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=500000.0)
    c.train.update(batch_size=512, steps=3_578_000, steps_per_epoch=2000, learning_rate=1.5e-4,
                   min_learning_rate=1.5e-5, warmup_steps=2000, eval_steps=200,
                   precision="mixed_bfloat16")  # 3,578,000 x 512 x 8192 tokens: 15.0T
    c.backup.every_steps = 1000
    return c
