"""The compiled CPU kernel (``attnzero.cpu_kernel``) against torch's SDPA and against flash.py, at
the shapes of issue 22, forward and forward + backward; and against ``torch.compile(flex_attention)``
forward (full and causal, B1 H8 L2048 D64). CPU float32, same run, the implementations interleaved
(kernel, torch, kernel, …) and the medians reported. Ratios are torch's time ÷ attnzero's (× torch's
throughput: above 1.0 is faster). flash.py is timed in a group of its own with torch (flash.py
pauses torch's OpenMP threads after its calls, which the next op would pay for). Against Flex,
attnzero's time ÷ Flex's (below 1.0 is faster).

    .venv/bin/python benchmarks/cpu_kernel.py [--repeats 7] [--cases nanogpt tiny] [--no-flex]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import attnzero as az
from attnzero import cpu_kernel, functional
from attnzero.bench import machine


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
    backward: bool = True  # also timed forward + backward


CASES = {
    "sentence": Shape("sentence embeddings", 32, 12, 12, 128, 128, 32),
    "nanogpt": Shape("nanoGPT training", 12, 4, 4, 256, 256, 32, causal=True),
    "bert": Shape("BERT", 8, 12, 12, 512, 512, 64),
    "gpt2": Shape("GPT-2 training", 4, 12, 12, 1024, 1024, 64, causal=True),
    "llama": Shape("Llama prefill GQA 32/8", 1, 32, 8, 2048, 2048, 128, causal=True, backward=False),
    "decode": Shape("decode 1×4096 GQA", 1, 32, 8, 1, 4096, 128, backward=False),
    "tiny": Shape("tiny", 1, 1, 1, 16, 16, 64),
}


@contextmanager
def flash_py() -> Any:
    """backend="flash" on flash.py itself (the kernel turned off in ``functional.choose``)."""
    real = functional._takes_kernel
    functional._takes_kernel = lambda q, bias: False  # type: ignore[assignment]
    try:
        yield
    finally:
        functional._takes_kernel = real


def _inputs(s: Shape, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(s.B, s.Hq, s.Lq, s.D, requires_grad=grad)
    k = torch.randn(s.B, s.Hkv, s.Lk, s.D, requires_grad=grad)
    v = torch.randn(s.B, s.Hkv, s.Lk, s.D, requires_grad=grad)
    return q, k, v


def _calls(s: Shape, backward: bool) -> dict[str, Callable[[], Any]]:
    q, k, v = _inputs(s, backward)

    def step(out: Tensor) -> None:
        if backward:
            out.sum().backward()

    def kernel() -> None:
        step(az.attention(q, k, v, causal=s.causal))

    def flash() -> None:
        with flash_py():
            step(az.attention(q, k, v, causal=s.causal))

    # torch's is_causal is top-left: the same as bottom-right when Lq == Lk (every causal case here)
    def sdpa() -> None:
        step(F.scaled_dot_product_attention(q, k, v, is_causal=s.causal, enable_gqa=s.Hq != s.Hkv))

    return {"kernel": kernel, "flash.py": flash, "torch": sdpa}


def _timed(s: Shape, backward: bool, repeats: int) -> dict[str, float]:
    """Kernel and torch interleaved; then flash.py and torch interleaved (torch's median of the first)."""
    calls = _calls(s, backward)
    with torch.enable_grad() if backward else torch.no_grad():
        m = _medians({"kernel": calls["kernel"], "torch": calls["torch"]}, repeats)
        m2 = _medians({"flash.py": calls["flash.py"], "torch": calls["torch"]}, repeats)
    return {"kernel": m["kernel"], "torch": m["torch"], "flash.py": m2["flash.py"], "torch2": m2["torch"]}


def _medians(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _flex_rows(repeats: int) -> list[str]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    B, H, L, D = 1, 8, 2048, 64
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    rows = []
    for causal in (False, True):
        block = None
        if causal:
            block = create_block_mask(lambda b, h, i, j: j <= i, B, None, L, L, device="cpu")
        calls: dict[str, Callable[[], Any]] = {
            "kernel": lambda c=causal: az.attention(q, k, v, causal=c),
            "flex": lambda b=block: flex(q, k, v, block_mask=b),
        }
        with torch.no_grad():
            m = _medians(calls, repeats)
        name = "causal" if causal else "full"
        rows.append(f"| {name} | {m['kernel'] * 1e3:.1f} | {m['flex'] * 1e3:.1f} | {m['kernel'] / m['flex']:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--no-flex", action="store_true")
    args = parser.parse_args()
    assert cpu_kernel.available(), cpu_kernel.why()
    print(machine())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, medians of {args.repeats}")
    print()
    print("| case | pass | kernel ms | flash.py ms | torch ms | kernel × torch | flash.py × torch |")
    print("|---|---|---|---|---|---|---|")
    for key in args.cases:
        s = CASES[key]
        for backward in (False, True) if s.backward else (False,):
            m = _timed(s, backward, args.repeats)
            k, f, t, t2 = m["kernel"], m["flash.py"], m["torch"], m["torch2"]
            pass_ = "fwd+bwd" if backward else "fwd"
            ms = f"{k * 1e3:.2f} | {f * 1e3:.2f} | {t * 1e3:.2f}"
            print(f"| {s.name} | {pass_} | {ms} | {t / k:.2f} | {t2 / f:.2f} |", flush=True)
    if not args.no_flex:
        print()
        print("vs torch.compile(flex_attention), forward, B1 H8 L2048 D64 (attnzero's time ÷ Flex's)")
        print()
        print("| case | kernel ms | flex ms | kernel ÷ flex |")
        print("|---|---|---|---|")
        for row in _flex_rows(args.repeats):
            print(row, flush=True)


if __name__ == "__main__":
    main()
