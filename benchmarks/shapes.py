"""attnzero against torch's SDPA at the shapes people run on a CPU (float32, ``backend="auto"``).

Each case runs attnzero and torch interleaved (attnzero, torch, attnzero, …) in the same loop and
reports the medians and attnzero's throughput as a fraction of torch's (``× torch``; 1.0 = as fast).
With ``--busy`` a competing process keeps the machine's cores busy (a loop of 2-thread float32
matmuls) while both are timed, so the ratio says how attnzero degrades under load against torch
under the same load. Results: docs/benchmarks.md.

    .venv/bin/python benchmarks/shapes.py [--repeats 15] [--busy] [--cases nanogpt tiny]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from harness import busy_load, describe
from torch import Tensor

import attnzero as az
from attnzero.bench import time_interleaved


@dataclass(frozen=True)
class Shape:
    name: str
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    causal: bool = False
    train: bool = False
    dropout_p: float = 0.0


CASES = {
    "sentence": Shape("sentence-embedding inference", 32, 12, 12, 128, 128, 32),
    "bert": Shape("BERT-base inference", 8, 12, 12, 512, 512, 64),
    "gpt2": Shape("GPT-2 training", 4, 12, 12, 1024, 1024, 64, causal=True, train=True),
    "llama": Shape("Llama prefill", 1, 32, 8, 2048, 2048, 128, causal=True),
    "decode": Shape("decode", 1, 32, 8, 1, 4096, 128),
    "nanogpt": Shape("nanoGPT training", 12, 4, 4, 256, 256, 32, causal=True, train=True),
    "nanogpt-dropout": Shape("nanoGPT training, dropout 0.1", 12, 4, 4, 256, 256, 32, True, True, 0.1),
    "tiny": Shape("tiny call", 1, 1, 1, 16, 16, 64),
}


def runs(s: Shape) -> dict[str, Callable[[], None]]:
    """One call of attnzero and one of torch for shape ``s`` (forward, or forward + backward)."""
    q = torch.randn(s.B, s.Hq, s.Lq, s.D, requires_grad=s.train)
    k = torch.randn(s.B, s.Hkv, s.Lk, s.D, requires_grad=s.train)
    v = torch.randn(s.B, s.Hkv, s.Lk, s.D, requires_grad=s.train)
    dout = torch.randn(s.B, s.Hq, s.Lq, s.D)
    gqa = s.Hq != s.Hkv

    def ours() -> Tensor:
        out = az.attention(q, k, v, causal=s.causal, dropout_p=s.dropout_p)
        assert isinstance(out, Tensor)
        return out

    def theirs() -> Tensor:
        # decode: one query row against the cache; torch's is_causal would be top-left, so off.
        return F.scaled_dot_product_attention(q, k, v, is_causal=s.causal, dropout_p=s.dropout_p, enable_gqa=gqa)

    def step(fn: Callable[[], Tensor]) -> Callable[[], None]:
        def run() -> None:
            if s.train:
                fn().backward(dout)
                q.grad = k.grad = v.grad = None
            else:
                with torch.no_grad():
                    fn()

        return run

    return {"attnzero": step(ours), "torch": step(theirs)}


def measure(s: Shape, repeats: int) -> dict[str, float]:
    """Median seconds per call of each implementation, interleaved sample by sample (a sample: as
    many calls as take ~2 ms; the tiny call takes microseconds)."""
    return time_interleaved(runs(s), repeats, warmups=2, min_sample_s=0.002)


def _fmt(secs: float) -> str:
    return f"{secs * 1e6:.0f} µs" if secs < 1e-3 else f"{secs * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed samples per case (median)")
    parser.add_argument("--busy", action="store_true", help="time under a competing 2-thread matmul loop")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    torch.manual_seed(0)
    print(describe(args.busy))
    with busy_load(args.busy):
        print("| case | shape | pass | attnzero | torch | × torch |\n|---|---|---|---|---|---|")
        for key in args.cases:
            s = CASES[key]
            t = measure(s, args.repeats)
            heads = f"H={s.Hq}" if s.Hq == s.Hkv else f"Hq={s.Hq}, Hkv={s.Hkv}"
            length = f"L={s.Lq}" if s.Lq == s.Lk else f"Lq={s.Lq}, Lk={s.Lk}"
            extra = (", causal" if s.causal else "") + (f", dropout {s.dropout_p}" if s.dropout_p else "")
            shape = f"B={s.B}, {heads}, {length}, D={s.D}{extra}"
            kind = "fwd+bwd" if s.train else "fwd, no grad"
            ratio = t["torch"] / t["attnzero"]
            print(f"| {s.name} | {shape} | {kind} | {_fmt(t['attnzero'])} | {_fmt(t['torch'])} | {ratio:.2f}× |",
                  flush=True)


if __name__ == "__main__":
    main()
