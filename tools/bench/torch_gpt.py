"""The PyTorch peer of `make bench-peer`: a plain eager GPT of tfdist's shape, trained as a
PyTorch user would train it on a CPU (nanoGPT's way: `F.scaled_dot_product_attention`, AdamW with
decay on the matrices only, clipping by the global norm, `torch.autocast` for bf16).

It runs in its own environment (`.venv-peer`, made by `make bench-peer`; torch is not a
dependency of tfdist) and is driven by `tools/bench/peer.py` over its standard input and output,
one JSON object a line, so that the driver can interleave it with tfdist:

    {"shape": {...}, "precision": "bfloat16", "data": "/tmp/x/train.bin", "warmup": 3}
    -> {"ready": true, "params": 10818816, "torch": "2.13.0", "threads": 2}
    {"steps": 6}  -> {"times": [0.61, ...], "loss": 4.12}
    {"peak": "bfloat16"} -> {"flops": 1.4e12}
    {"products": [[m, k, n, ta, tb], ...], "dtype": "bfloat16"} -> {"seconds": 0.21}
    (end of input: exit)

The GPT matches tfdist.models.gpt.GPT: learned positions, pre-LayerNorm blocks, GELU (tanh), the
head tied to the token embedding, GPT-2's initialisation. Batches are random windows of a uint16
token file read with `np.memmap`, nanoGPT's `get_batch`.

    .venv-peer/bin/python tools/bench/torch_gpt.py --check   # a few steps of a tiny GPT; loss falls
"""
import json
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, n_embd, n_head, n_layer):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        nn.init.normal_(self.proj.weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, n_layer):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, n_layer)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        nn.init.normal_(self.proj.weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, n_layer) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        for name, p in self.named_parameters():  # GPT-2: N(0, 0.02), zero biases
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2 and not name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # the tied head
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class Trainer:
    """One training step as nanoGPT's train.py takes it on a CPU."""

    def __init__(self, shape, precision, data, seed=0):
        torch.manual_seed(seed)
        self.shape, self.precision = shape, precision
        self.model = GPT(shape["vocab_size"], shape["block_size"], shape["n_layer"],
                         shape["n_head"], shape["n_embd"])
        params = list(self.model.parameters())
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": shape["weight_decay"]},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=shape["learning_rate"], betas=(shape["beta1"], shape["beta2"]))
        self.data = np.memmap(data, dtype=np.uint16, mode="r") if data else None
        self.rng = np.random.default_rng(seed)

    def batch(self):
        B, T = self.shape["batch_size"], self.shape["block_size"]
        if self.data is None:
            x = torch.randint(0, self.shape["vocab_size"], (B, T + 1))
            return x[:, :-1], x[:, 1:]
        starts = self.rng.integers(0, len(self.data) - T - 1, B)
        x = torch.from_numpy(np.stack([self.data[i:i + T].astype(np.int64) for i in starts]))
        y = torch.from_numpy(np.stack([self.data[i + 1:i + 1 + T].astype(np.int64)
                                       for i in starts]))
        return x, y

    def step(self):
        x, y = self.batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bfloat16"):
            loss = self.model(x, y)
        loss.backward()
        if self.shape["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.shape["grad_clip"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def params(self):
        return sum(p.numel() for p in self.model.parameters())


def matmul_peak(dtype, n=2048, repeats=10):
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def products(shapes, dtype, repeats=5):
    """Seconds of the best of `repeats` runs of the products `shapes` ([m, k, n, transpose_a,
    transpose_b] each), one after another: tools/bench/matmul_peak.py's `measure_products` in
    torch."""
    operands = []
    for m, k, n, ta, tb in shapes:
        a = torch.randn((k, m) if ta else (m, k), dtype=dtype)
        b = torch.randn((n, k) if tb else (k, n), dtype=dtype)
        operands.append((a.t() if ta else a, b.t() if tb else b))

    def run():
        with torch.no_grad():
            for a, b in operands:
                a @ b
    run()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def serve(stdin=sys.stdin, stdout=sys.stdout):
    def say(obj):
        stdout.write(json.dumps(obj) + "\n")
        stdout.flush()
    first = json.loads(stdin.readline())
    trainer = Trainer(first["shape"], first["precision"], first.get("data"))
    for _ in range(first.get("warmup", 0)):
        trainer.step()
    say({"ready": True, "params": trainer.params(), "torch": torch.__version__,
         "threads": torch.get_num_threads()})
    for line in stdin:
        msg = json.loads(line)
        if "peak" in msg:
            say({"flops": matmul_peak(getattr(torch, msg["peak"]))})
            continue
        if "products" in msg:
            say({"seconds": products(msg["products"], getattr(torch, msg["dtype"]))})
            continue
        times = []
        loss = None
        for _ in range(msg["steps"]):
            t = time.perf_counter()
            loss = trainer.step()
            times.append(time.perf_counter() - t)
        say({"times": times, "loss": loss})


def check():
    shape = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, batch_size=8,
                 learning_rate=3e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0)
    for precision in ("float32", "bfloat16"):
        trainer = Trainer(shape, precision, None)
        data = trainer.batch()
        trainer.batch = lambda data=data: data  # one batch over and over: the loss must fall
        losses = [trainer.step() for _ in range(30)]
        assert losses[-1] < 0.7 * losses[0], (precision, losses)
        print(f"{precision}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    check() if "--check" in sys.argv else serve()
