"""llama3_8b: Llama 3 8B (32 layers, 32 query heads over 8 key/value heads, width 4096, SwiGLU
14336 wide, context 8192, vocab 128256, rotary base 500000, no biases, an untied head; 8,030,261,248
parameters), for planning (`tfdist plan --config=configs/llama3_8b.py`) and real hardware.

Source: Meta's Llama 3 model card and released config.json (meta-llama/Meta-Llama-3-8B), and
Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 3 (its shape, and the peak
learning rate 3e-4). The rest of the training is as Llama 2's (arXiv:2307.09288) where the paper
gives none for 8B: batches of 512 x 8192 tokens (4M), 15T tokens (the model card's), 2,000 warmup
steps, a cosine to a tenth of the peak, AdamW (0.9, 0.95), weight decay 0.1, clipping at 1.0;
mixed bfloat16. The vocabulary is Llama 3's size: train it on Llama 3 tokens
(`--config.data.tokenizer=<dir>/tokenizer.json`); with a smaller tokenizer the extra rows go
unused.
"""
from tfdist.config import default_config


def get_config():
    c = default_config()
    c.model.update(arch="llama", vocab_size=128256, block_size=8192, n_layer=32, n_head=32,
                   n_kv_head=8, n_embd=4096, ffn_hidden=14336, dropout=0.0, bias=False,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=500000.0)
    c.train.update(batch_size=512, steps=3_578_000, steps_per_epoch=2000, learning_rate=3e-4,
                   min_learning_rate=3e-5, warmup_steps=2000, eval_steps=200,
                   precision="mixed_bfloat16")  # 3,578,000 x 512 x 8192 tokens: 15.0T
    c.backup.every_steps = 1000
    return c
