"""Issue 22's numbers for the compiled CPU kernel (``backend="auto"`` on CPU float32 runs
``csrc/attention.cpp`` through ``attnzero.cpu_kernel``), every table in the same run, the
implementations interleaved call by call and the medians reported, printed as markdown tables for
docs/benchmarks.md:

* ``sdpa``: against torch's SDPA and against flash.py (the kernel turned off) at the shapes below,
  forward and forward + backward (nanoGPT with dropout 0.1: training only). Ratios are torch's time
  ÷ attnzero's ("× torch": above 1.0 is faster). flash.py is timed in a group of its own with torch
  (so that its slower calls do not change the kernel group's conditions).
* ``flex``: against ``torch.compile(flex_attention)``, forward (``flex_table.py``): attnzero's time
  ÷ Flex's (below 1.0 is faster).
* ``peak``: this machine's float32 GEMM throughput and the causal L=2048 forward's share of it
  (``cpu_peak.py``).
* ``memory``: the extra peak memory of a forward at L=16384 against torch SDPA's (``cpu_memory.py``).
* ``models``: whole models, nanoGPT's training step and ViT-Tiny's, with attnzero's drop-in in
  place of torch's SDPA (``cpu_models.py``): attnzero's time ÷ torch's, each row in fresh
  processes (3, or ``--processes``), the median of the rounds' paired ratios.

``--busy`` runs all of it under a competing process (2-thread float32 matmuls); ``--quick`` is a
smoke run at small sizes (its numbers mean nothing).

    .venv/bin/python benchmarks/cpu_kernel.py [--only sdpa flex peak memory models] [--busy]
        [--repeats 7] [--cases nanogpt tiny] [--models vit vit-train] [--processes N] [--heap fixed]
        [--quick]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import cpu_memory
import cpu_models
import cpu_peak
import flex_table
import torch
import torch.nn.functional as F
from harness import busy_load, describe, ms, table
from torch import Tensor

import attnzero as az
from attnzero import cpu_kernel, functional
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
    backward: bool = True  # also timed forward + backward
    dropout_p: float = 0.0  # > 0: a training case, timed forward + backward only

    @property
    def passes(self) -> tuple[bool, ...]:
        """backward False / True: which of forward and forward + backward are timed."""
        return (True,) if self.dropout_p else (False, True) if self.backward else (False,)


CASES = {
    "sentence": Shape("sentence embeddings", 32, 12, 12, 128, 128, 32),
    "nanogpt": Shape("nanoGPT training", 12, 4, 4, 256, 256, 32, causal=True),
    "nanogpt-dropout": Shape("nanoGPT training, dropout 0.1", 12, 4, 4, 256, 256, 32, causal=True, dropout_p=0.1),
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
    functional._takes_kernel = lambda q: False  # type: ignore[assignment]
    try:
        yield
    finally:
        functional._takes_kernel = real


def _inputs(s: Shape, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(s.B, s.Hq, s.Lq, s.D, requires_grad=grad)
    k = torch.randn(s.B, s.Hkv, s.Lk, s.D, requires_grad=grad)
    v = torch.randn(s.B, s.Hkv, s.Lk, s.D, requires_grad=grad)
    return q, k, v


def calls(s: Shape, backward: bool) -> dict[str, Callable[[], None]]:
    """One call of the kernel, of flash.py and of torch's SDPA (and its backward, with ``backward``)."""
    q, k, v = _inputs(s, backward)
    dout = torch.randn(s.B, s.Hq, s.Lq, s.D)

    def step(out: Tensor) -> None:
        if backward:
            out.backward(dout)
            q.grad = k.grad = v.grad = None

    def ours() -> Tensor:
        out = az.attention(q, k, v, causal=s.causal, dropout_p=s.dropout_p)
        assert isinstance(out, Tensor)
        return out

    def kernel() -> None:
        step(ours())

    def flash() -> None:
        with flash_py():
            step(ours())

    # torch's is_causal is top-left: the same as bottom-right when Lq == Lk (every causal case here)
    def sdpa() -> None:
        gqa = s.Hq != s.Hkv
        step(F.scaled_dot_product_attention(q, k, v, is_causal=s.causal, dropout_p=s.dropout_p, enable_gqa=gqa))

    return {"kernel": kernel, "flash.py": flash, "torch": sdpa}


def timed(s: Shape, backward: bool, repeats: int) -> dict[str, float]:
    """Kernel and torch interleaved; then flash.py and torch interleaved (torch2: torch's median of
    the second group). A sample is at least ~2 ms of calls (the tiny call takes microseconds)."""
    fns = calls(s, backward)
    with torch.enable_grad() if backward else torch.no_grad():
        m = time_interleaved({"kernel": fns["kernel"], "torch": fns["torch"]}, repeats, min_sample_s=0.002)
        m2 = time_interleaved({"flash.py": fns["flash.py"], "torch": fns["torch"]}, repeats, min_sample_s=0.002)
    return {"kernel": m["kernel"], "torch": m["torch"], "flash.py": m2["flash.py"], "torch2": m2["torch"]}


def sdpa_section(cases: list[str], repeats: int) -> Iterator[str]:
    """The table against torch's SDPA (and flash.py), line by line."""
    yield "vs torch's scaled_dot_product_attention, float32 (× torch = torch's time ÷ attnzero's; above 1: faster)"
    yield ""

    def cells() -> Iterator[list[str]]:
        for key in cases:
            s = CASES[key]
            for backward in s.passes:
                m = timed(s, backward, repeats)
                k, f, t, t2 = m["kernel"], m["flash.py"], m["torch"], m["torch2"]
                pass_ = "fwd+bwd" if backward else "fwd"
                yield [s.name, pass_, ms(k), ms(f), ms(t), f"{t / k:.2f}", f"{t2 / f:.2f}"]

    header = ["case", "pass", "kernel ms", "flash.py ms", "torch ms", "kernel × torch", "flash.py × torch"]
    yield from table(header, cells())


TABLES = ("sdpa", "flex", "peak", "memory", "models")
QUICK_CASES = ["tiny", "decode", "nanogpt-dropout"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Issue 22's tables for the compiled CPU kernel, in one run.")
    parser.add_argument("--only", nargs="+", choices=TABLES, default=list(TABLES), help="the tables to run")
    parser.add_argument("--busy", action="store_true", help="measure under a competing 2-thread matmul loop")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="timed samples per row (default 7; --quick 1)")
    parser.add_argument("--processes", type=int, default=cpu_models.PROCESSES,
                        help="fresh processes per row of the models table (more: a steadier median under --busy)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=None, help="the sdpa table's shapes")
    parser.add_argument("--models", nargs="+", choices=list(cpu_models.ROWS), default=None,
                        help="the models table's rows (default: all)")
    parser.add_argument("--heap", choices=["default", "fixed"], default="default",
                        help="the models table's processes: glibc's heap as it comes, or fixed (cpu_models.FIXED_HEAP)")
    args = parser.parse_args(argv)
    assert cpu_kernel.available(), cpu_kernel.why()
    repeats = args.repeats or (1 if args.quick else 7)
    cases = args.cases or (QUICK_CASES if args.quick else list(CASES))
    torch.manual_seed(0)
    print(describe(args.busy))
    print(f"{torch.get_num_threads()} torch threads, float32, medians of {repeats} interleaved samples"
          + (" (--quick: small sizes, not the issue's numbers)" if args.quick else ""))
    sections: dict[str, Callable[[], Iterator[str]]] = {
        "sdpa": lambda: sdpa_section(cases, repeats),
        "flex": lambda: flex_table.section(args.quick, repeats),
        "peak": lambda: cpu_peak.section(args.quick, repeats),
        "memory": lambda: cpu_memory.section(args.quick),
        "models": lambda: cpu_models.section(args.quick, repeats, args.processes, args.models, args.heap),
    }
    with busy_load(args.busy):
        for name in TABLES:
            if name in args.only:
                print()
                for line in sections[name]():
                    print(line, flush=True)


if __name__ == "__main__":
    main()
