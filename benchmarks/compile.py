"""A nanoGPT training step, compiled with ``torch.compile`` against eager, per attention function.

    .venv/bin/python benchmarks/compile.py                      # B=12, H=4, L=256, D=32, 2 layers
    .venv/bin/python benchmarks/compile.py --repeats 20 --attention flash dropin --dropout 0.1/0.1

The model is nanoGPT's (token + position embeddings, pre-LayerNorm blocks of causal self-attention
and a 4× GELU MLP, tied nothing, dropout on the attention probabilities, after the attention
projection and after the MLP), with its attention call made by:

* ``torch``: ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``, the baseline;
* ``reference`` / ``flash`` / ``auto``: ``az.attention(..., causal=True, backend=...)``;
* ``dropin``: ``az.scaled_dot_product_attention(..., is_causal=True)``.

Dropout is given as ``attention/other``: the attention probabilities' rate (the attention call's
``dropout_p``) and that of nanoGPT's ``nn.Dropout`` layers (embeddings, attention projection, MLP),
which are torch's own code: compiled on CPU, those cost more than eagerly whatever the attention.

A step is ``zero_grad``, forward, backward and ``AdamW.step`` (the optimizer stays eager, as in
nanoGPT where only the model is compiled). Eager and compiled steps alternate, one of each per
repeat, after warm-up steps (the first compiled one compiles), and the table gives the median wall
time of each with its compile time and the number of graph breaks ``torch._dynamo.explain`` finds
(0: the whole forward is one graph). FLOPs of attention per step: forward 4·B·H·L²·D·½ (causal),
backward ≈ 2.5× that.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import attnzero as az
from attnzero.bench import machine

ATTENTION = ("torch", "reference", "flash", "auto", "dropin")


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: tuple[float, float], attention: str) -> None:
        super().__init__()
        self.n_head, self.dropout, self.attention = n_head, dropout[0], attention
        self.c_attn = nn.Linear(d_model, 3 * d_model)  # q, k, v of all heads in one matmul
        self.c_proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # (B, T, C) each
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        if self.attention == "torch":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        elif self.attention == "dropin":
            y = az.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        elif self.attention == "none":  # no attention (cpu_models.py: the cost of the ops around it)
            y = v
        else:
            out = az.attention(q, k, v, causal=True, dropout_p=p, backend=self.attention)  # type: ignore[arg-type]
            assert isinstance(out, torch.Tensor)
            y = out
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: tuple[float, float], attention: str) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, attention)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout[1])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, block: int, d_model: int, n_head: int, n_layer: int, dropout: tuple[float, float],
        attention: str,
    ):  # fmt: skip
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(block, d_model)
        self.drop = nn.Dropout(dropout[1])
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, attention) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def measure(args: argparse.Namespace, attention: str, dropout: tuple[float, float]) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(args.vocab, args.length, args.heads * args.head_dim, args.heads, args.layers, dropout, attention)
    model.train()
    idx = torch.randint(0, args.vocab, (args.batch, args.length))
    targets = torch.randint(0, args.vocab, (args.batch, args.length))
    breaks = torch._dynamo.explain(model)(idx, targets).graph_break_count
    torch._dynamo.reset()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        fn(idx, targets).backward()
        opt.step()
        return time.perf_counter() - t0

    compile_s = step(compiled)  # the first compiled step compiles the forward and the backward
    for _ in range(args.warmup):
        step(model)
        step(compiled)
    eager, comp = [], []
    for _ in range(args.repeats):  # interleaved: a slow phase of a shared machine hits both
        eager.append(step(model))
        comp.append(step(compiled))
    torch._dynamo.reset()
    return {
        "breaks": breaks,
        "compile_s": compile_s,
        "eager": statistics.median(eager),
        "compiled": statistics.median(comp),
        "ratio": statistics.median(c / e for c, e in zip(comp, eager)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attention", nargs="+", default=list(ATTENTION), choices=ATTENTION)
    p.add_argument(
        "--dropout", nargs="+", default=["0/0", "0.1/0", "0.1/0.1"], help="attention/other dropout rates"
    )
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steady numbers on a shared machine)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"# compile.py — {machine()['cpu']}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
          f"{datetime.date.today().isoformat()}")
    print(f"# nanoGPT step (forward, backward, AdamW): B={args.batch}, H={args.heads}, L={args.length}, "
          f"D={args.head_dim}, {args.layers} layers, float32; median of {args.repeats} interleaved steps")
    print()
    print("| attention | dropout attention/other | graph breaks | compile (s) | eager step (ms) "
          "| compiled step (ms) | compiled / eager |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for rates in args.dropout:
        attention_p, other_p = (float(x) for x in rates.split("/"))
        for attention in args.attention:
            r = measure(args, attention, (attention_p, other_p))
            print(f"| {attention} | {attention_p:g} / {other_p:g} | {r['breaks']:.0f} | {r['compile_s']:.0f} "
                  f"| {r['eager'] * 1e3:.1f} | {r['compiled'] * 1e3:.1f} | {r['ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
