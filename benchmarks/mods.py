"""What programmable attention costs (issue 23's numbers), CPU float32, B = 1, H = 8, L = 2048, D = 64,
each a ratio of medians in one interleaved run:

* a cheap score_mod (ALiBi from slopes, a relative-bias table lookup, tanh softcap written as a mod)
  against the same call without it (``auto``: the compiled kernel where built), forward and
  forward + backward — and against the built-in that computes the same (``bias=alibi``,
  ``softcap=``);
* masks from a mask_mod (``az.masks.from_mod``): prefix-LM against the causal call plus its prefix
  blocks (measured: causal with the prefix written as a bias-free dense mask), documents from a mod
  against ``az.masks.document``;
* what a user would pick instead: torch's SDPA with the equivalent dense bias / mask (training),
  and compiled FlexAttention (inference, ``--flex``; it compiles for a minute).

    .venv/bin/python benchmarks/mods.py [--repeats 5] [--length 2048] [--flex]

Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnzero as az
from attnzero.bench import machine, time_interleaved

Run = Callable[[], None]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--flex", action="store_true", help="also compiled FlexAttention (inference)")
    args = ap.parse_args()
    B, H, L, D = 1, 8, args.length, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    slopes = az.masks.alibi_slopes(H)
    rel = torch.randn(H, 2 * L - 1) * 0.1

    def alibi(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s - slopes[h] * (i - j).abs()

    def relative(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + rel[h, i - j + L - 1]

    def capped(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return 30.0 * torch.tanh(s / 30.0)

    alibi_bias = az.masks.alibi(H, L)  # (1, H, L, L): what the built-in needs materialised

    def fwd(**kw: object) -> Run:
        return lambda: az.attention(q, k, v, causal=True, **kw)  # type: ignore[arg-type]

    def fwd_bwd(**kw: object) -> Run:
        xs = [t.clone().requires_grad_() for t in (q, k, v)]

        def run() -> None:
            az.attention(*xs, causal=True, **kw).sum().backward()  # type: ignore[arg-type, union-attr]

        return run

    print(f"# programmable attention, CPU float32, B={B} H={H} L={L} D={D}, causal; {machine()}")
    for label, make in (("forward", fwd), ("forward + backward", fwd_bwd)):
        t = time_interleaved(
            {
                "plain": make(),
                "alibi mod": make(score_mod=alibi),
                "alibi bias": make(bias=alibi_bias),
                "relative mod": make(score_mod=relative),
                "softcap mod": make(score_mod=capped),
                "softcap built-in": make(softcap=30.0),
            },
            args.repeats,
        )
        base = t["plain"]
        print(f"\n{label}: plain {base * 1e3:.1f} ms")
        for name, sec in t.items():
            print(f"  {name:18s} {sec * 1e3:8.1f} ms  × plain {sec / base:5.2f}")

    # masks from mods
    prefix = L // 4

    def prefix_lm(b, h, i, j):  # type: ignore[no-untyped-def]
        return (j < prefix) | (j <= i)

    docs_ids = torch.arange(L) // (L // 8)

    def documents(b, h, i, j):  # type: ignore[no-untyped-def]
        return docs_ids[i] == docs_ids[j]

    from_prefix = az.masks.from_mod(prefix_lm, 1, 1, L, L)
    from_docs = az.masks.from_mod(documents, 1, 1, L, L)
    docs = az.masks.document(docs_ids[None])
    dense_prefix = az.masks.from_mod(prefix_lm, 1, 1, L, L).to_tensor()
    t = time_interleaved(
        {
            "causal": lambda: az.attention(q, k, v, causal=True),
            "prefix-LM from_mod": lambda: az.attention(q, k, v, mask=from_prefix),
            "prefix-LM dense": lambda: az.attention(q, k, v, mask=dense_prefix),
            "documents built-in": lambda: az.attention(q, k, v, mask=docs),
            "documents from_mod": lambda: az.attention(q, k, v, mask=from_docs),
            "torch SDPA prefix dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_prefix),
            "torch SDPA alibi bias": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias),
        },
        args.repeats,
    )
    print("\nmasks from mods, forward:")
    for name, sec in t.items():
        print(f"  {name:24s} {sec * 1e3:8.1f} ms  × causal {sec / t['causal']:5.2f}")
    print(f"  prefix-LM from_mod × causal: {t['prefix-LM from_mod'] / t['causal']:.2f} "
          f"(the prefix adds {prefix * (L - prefix) / 2 / (L * L / 2):.0%} of causal's pairs)")  # fmt: skip
    print(f"  documents from_mod × built-in: {t['documents from_mod'] / t['documents built-in']:.2f}")

    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        bm = create_block_mask(lambda b, h, i, j: i >= j, 1, 1, L, L, device="cpu")
        with torch.no_grad():
            t = time_interleaved(
                {
                    "attnzero alibi mod": lambda: az.attention(q, k, v, causal=True, score_mod=alibi),
                    "flex alibi": lambda: compiled(q, k, v, score_mod=alibi, block_mask=bm),
                },
                args.repeats,
            )
        print(f"\nvs compiled Flex (inference): attnzero ÷ flex = {t['attnzero alibi mod'] / t['flex alibi']:.2f}")


if __name__ == "__main__":
    main()
