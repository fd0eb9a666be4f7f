"""What issue 13's features cost on the flash backend (CPU, float32), each as a ratio against the
plain call in the same run (interleaved, medians):

* softcap and sinks: forward + backward at L = 2048 (B = 1, H = 8, D = 64), causal and not —
  ``× plain`` is the time with the feature over the time without (1.00 = free);
* masks that skip: the forward at L = 4096 (B = 1, H = 8, D = 64) with a document mask of 8 equal
  documents, a causal ``Mask`` and the drop-in's ``is_causal``, against full attention and
  ``causal=True`` — with the blocks each visited (``flash.COUNTS``);
* packed sequences: ``attention_varlen`` over 8 sequences against the same tokens as one sequence.

    .venv/bin/python benchmarks/features.py [--repeats 7] [--length 2048] [--mask-length 4096]
        [--parts softcap-sinks skipping varlen]

Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import attnzero as az
from attnzero import flash
from attnzero.bench import machine, time_interleaved

Run = Callable[[], None]


def _discard(_: object) -> None:
    """A call's result, dropped (the tables time calls, not their results)."""


def _blocks(fn: Run) -> int:
    flash.COUNTS["forward"] = 0
    fn()
    return flash.COUNTS["forward"]


def softcap_sinks(L: int, repeats: int) -> list[tuple[str, float, float]]:
    """(case, seconds of the plain call, time with the feature / plain) for fwd+bwd; softcap also on
    q × 8 and q × 32 (scores near and past the cap), against the plain call on the ordinary q."""
    B, H, D = 1, 8, 64
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    q8, q32 = ((q.detach() * f).requires_grad_() for f in (8, 32))
    sinks = torch.randn(H, requires_grad=True)
    dout = torch.randn(B, H, L, D)
    rows = []
    for causal in (False, True):

        def step(causal: bool = causal, q: torch.Tensor = q, **kw: object) -> Run:
            def run() -> None:
                out = az.attention(q, k, v, causal=causal, backend="flash", **kw)  # type: ignore[arg-type]
                out.backward(dout)  # type: ignore[union-attr]

            return run

        t = time_interleaved({"plain": step(), "softcap": step(softcap=30.0), "sinks": step(sinks=sinks),
                              "both": step(softcap=30.0, sinks=sinks), "softcap, q × 8": step(q=q8, softcap=30.0),
                              "softcap, q × 32": step(q=q32, softcap=30.0)}, repeats)  # fmt: skip
        for name in ("softcap", "sinks", "both", "softcap, q × 8", "softcap, q × 32"):
            rows.append((f"{name}, {'causal' if causal else 'full'}", t["plain"], t[name] / t["plain"]))
    return rows


def skipping(L: int, repeats: int) -> list[tuple[str, float, float, int]]:
    """(case, seconds, time / full attention's, blocks visited) for the forward."""
    B, H, D = 1, 8, 64
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    docs = az.masks.document(torch.arange(8).repeat_interleave(L // 8))
    causal_mask = az.masks.causal(L)
    cases: dict[str, Run] = {
        "full attention": lambda: _discard(az.attention(q, k, v, backend="flash")),
        "document mask, 8 equal documents": lambda: _discard(az.attention(q, k, v, mask=docs, backend="flash")),
        "causal=True": lambda: _discard(az.attention(q, k, v, causal=True, backend="flash")),
        "causal Mask": lambda: _discard(az.attention(q, k, v, mask=causal_mask, backend="flash")),
        "drop-in is_causal=True": lambda: _discard(az.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "dense causal tensor": lambda: _discard(az.attention(q, k, v, mask=causal_mask.to_tensor(), backend="flash")),
    }
    blocks = {name: _blocks(fn) for name, fn in cases.items()}
    t = time_interleaved(cases, repeats)
    return [(name, t[name], t[name] / t["full attention"], blocks[name]) for name in cases]


def varlen(L: int, repeats: int) -> list[tuple[str, float, float]]:
    """Packed: 8 sequences of L / 8 tokens through attention_varlen, against the same 8 sequences as
    a batch (what per-sequence attention costs) and against one sequence of L."""
    H, D, n = 8, 64, 8
    q, k, v = (torch.randn(L, H, D) for _ in range(3))
    cu = torch.arange(0, L + 1, L // n, dtype=torch.int32)
    one = torch.tensor([0, L], dtype=torch.int32)
    batch = [x.view(n, L // n, H, D).transpose(1, 2).contiguous() for x in (q, k, v)]  # (n, H, L / n, D)
    def packed(cu_q: torch.Tensor) -> Run:
        return lambda: _discard(az.attention_varlen(q, k, v, cu_q, cu_q, causal=True, backend="flash"))

    cases: dict[str, Run] = {
        "the 8 sequences as a batch (B=8)": lambda: _discard(az.attention(*batch, causal=True, backend="flash")),
        "8 packed sequences (varlen)": packed(cu),
        "one sequence of L (varlen)": packed(one),
    }
    t = time_interleaved(cases, repeats)
    base = t["the 8 sequences as a batch (B=8)"]
    return [(name, t[name], t[name] / base) for name in cases]


def _ms(secs: float) -> str:
    return f"{secs * 1e3:.0f} ms"


def _table(heading: str, columns: list[str], rows: list[list[str]]) -> None:
    """One markdown table under its heading (docs/benchmarks.md takes them as they are)."""
    print(f"\n## {heading}\n")
    for cells in (columns, ["---"] * len(columns), *rows):
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--length", type=int, default=2048, help="L of the softcap / sinks cases")
    parser.add_argument("--mask-length", type=int, default=4096, help="L of the mask and varlen cases")
    parts = ("softcap-sinks", "skipping", "varlen")
    parser.add_argument("--parts", nargs="+", choices=parts, default=list(parts), help="which tables")
    args = parser.parse_args()
    torch.manual_seed(0)
    info = machine()
    print(f"{info['date']} · {info['cpu']} · {info['cores']} · torch {info['torch']}")
    L, M = args.length, args.mask_length
    if "softcap-sinks" in args.parts:
        _table(f"softcap and sinks: flash forward + backward, B=1, H=8, L={L}, D=64", ["case", "plain call", "× plain"],
               [[name, _ms(secs), f"{ratio:.2f}"] for name, secs, ratio in softcap_sinks(L, args.repeats)])  # fmt: skip
    if "skipping" in args.parts:
        cases = skipping(M, args.repeats)
        _table(f"masks that skip: flash forward, B=1, H=8, L={M}, D=64",
               ["case", "time", "× full attention", "blocks visited"],
               [[name, _ms(secs), f"{ratio:.3f}", str(blocks)] for name, secs, ratio, blocks in cases])  # fmt: skip
    if "varlen" in args.parts:
        _table(f"packed sequences: attention_varlen, causal, H=8, D=64, {M} tokens",
               ["case", "time", "× the batch"],
               [[name, _ms(secs), f"{ratio:.3f}"] for name, secs, ratio in varlen(M, args.repeats)])  # fmt: skip

if __name__ == "__main__":
    main()
