"""How close the kernel's causal forward comes to this machine's float32 GEMM throughput: torch.mm
of square matrices at a few sizes (the best median is "the GEMM peak") and attnzero's causal
forward at B1 H8 L2048 D64, all interleaved in one loop. The attention's FLOPs count only the kept
half of the two products, Q Kᵀ and P V: 4·B·H·D·L²/2 (softmax's exp and the rescaling are not
counted, so the fraction is a lower bound on how busy the multiply units are). Each sample runs
calls for at least 0.3 s, so that both sides are steady-state throughput: with 0.05 s the causal
forward's sample was two calls, the first of them reading q, k, v back from memory after mm 4096
had swept ~200 MB through the caches (2–3 % slower than the steady rate).

    .venv/bin/python benchmarks/cpu_kernel.py --only peak [--busy] [--quick]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from harness import ms, table

import attnzero as az
from attnzero.bench import time_interleaved

SIZES = (1024, 2048, 4096)
QUICK_SIZES = (256, 512)
B, H, D = 1, 8, 64


def _mm(n: int) -> Callable[[], None]:
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)

    def run() -> None:
        torch.mm(a, b, out=c)

    return run


def section(quick: bool, repeats: int) -> Iterator[str]:
    """The GEMM table, then the line "causal L=… forward: X GFLOP/s = Y % of the GEMM peak Z GFLOP/s"."""
    L = 512 if quick else 2048
    runs = {f"mm {n}": _mm(n) for n in (QUICK_SIZES if quick else SIZES)}
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))

    def causal() -> None:
        az.attention(q, k, v, causal=True)

    runs["causal"] = causal
    with torch.no_grad():
        t = time_interleaved(runs, repeats, min_sample_s=0.3)
    gemm = {int(name.split()[1]): 2.0 * int(name.split()[1]) ** 3 / t[name] / 1e9 for name in runs if name != "causal"}
    best = max(gemm, key=lambda n: gemm[n])
    attn = 4.0 * B * H * D * L * L / 2 / t["causal"] / 1e9
    yield "float32 GEMM throughput (torch.mm, n×n by n×n; 2n³ FLOPs) and the causal forward's share of the best"
    yield ""
    yield from table(["n", "ms", "GFLOP/s"], ([str(n), ms(t[f"mm {n}"]), f"{g:.1f}"] for n, g in gemm.items()))
    yield ""
    yield (f"causal L={L} forward (B{B} H{H} D{D}, {ms(t['causal'])} ms): {attn:.1f} GFLOP/s = "
           f"{100 * attn / gemm[best]:.0f} % of the GEMM peak {gemm[best]:.1f} GFLOP/s (mm {best})")
