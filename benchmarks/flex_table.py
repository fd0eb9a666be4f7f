"""attnzero's compiled CPU kernel against ``torch.compile(flex_attention)``: forward, inference,
float32, attnzero's time ÷ Flex's (below 1.0: attnzero is faster), interleaved medians.

Rows (B1 H8 D64 at each length, and nanoGPT's B12 H4 L256 D32 once), each written the way a user of
either library would write it:

* full; causal (Flex: a causal block mask);
* softcap 30, causal (attnzero ``softcap=30``; Flex a ``30·tanh(s/30)`` score_mod);
* ALiBi, causal (attnzero ``bias=az.masks.alibi(H, L)``, a dense (1, H, L, L) float32 tensor —
  2 GiB at L = 8192 — that the kernel reads; Flex computes ``slope_h · (j − i)`` in a score_mod);
* 8 equal documents, causal (attnzero ``mask=az.masks.document(ids) & az.masks.causal(L)``; Flex a
  document + causal block mask);
* sliding window 256 (attnzero ``window=256``, i.e. keys ``i − 256 … i``; Flex the same as a block
  mask).

Masks, biases and block masks are built once, outside the timing; each pair's outputs are compared
once before timing (a row whose two sides disagree is an error, not a number).

    .venv/bin/python benchmarks/cpu_kernel.py --only flex [--busy] [--quick]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from harness import ms, table
from torch import Tensor

import attnzero as az
from attnzero.bench import time_interleaved

LENGTHS = (2048, 8192)
QUICK_LENGTHS = (256,)
WINDOW = 256
DOCS = 8
CAP = 30.0


@dataclass
class Row:
    name: str
    attnzero: Callable[[], Tensor]
    flex: Callable[[], Tensor]


def rows(B: int, H: int, L: int, D: int, compiled: Any, nanogpt: bool = False) -> list[Row]:
    """The table's rows at one shape (only the causal one for ``nanogpt``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))

    def block(mask_mod: Any) -> Any:
        return create_block_mask(mask_mod, None, None, L, L, device="cpu")

    def causal_mod(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return j <= i

    causal_block = block(causal_mod)

    def az_call(**kw: Any) -> Callable[[], Tensor]:
        def run() -> Tensor:
            out = az.attention(q, k, v, **kw)
            assert isinstance(out, Tensor)
            return out

        return run

    def flex_call(**kw: Any) -> Callable[[], Tensor]:
        return lambda: compiled(q, k, v, **kw)

    if nanogpt:
        name = "causal (nanoGPT's shape)"
        return [Row(name, az_call(causal=True), flex_call(block_mask=causal_block))]

    def softcap_mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return CAP * torch.tanh(s / CAP)

    slopes = az.masks.alibi_slopes(H)

    def alibi_mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + slopes[h] * (j - i)

    ids = torch.arange(L) // (L // DOCS)  # 8 documents of L/8 tokens, back to back

    def document_mod(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return (ids[i] == ids[j]) & (j <= i)

    def window_mod(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return (j <= i) & (i - j <= WINDOW)

    documents = az.masks.document(ids) & az.masks.causal(L)
    return [
        Row("full", az_call(), flex_call()),
        Row("causal", az_call(causal=True), flex_call(block_mask=causal_block)),
        Row(f"softcap {CAP:g}, causal", az_call(causal=True, softcap=CAP),
            flex_call(score_mod=softcap_mod, block_mask=causal_block)),
        Row("ALiBi, causal", az_call(causal=True, bias=az.masks.alibi(H, L)),
            flex_call(score_mod=alibi_mod, block_mask=causal_block)),
        Row(f"{DOCS} equal documents, causal", az_call(mask=documents), flex_call(block_mask=block(document_mod))),
        Row(f"sliding window {WINDOW}", az_call(window=WINDOW), flex_call(block_mask=block(window_mod))),
    ]  # fmt: skip


def _checked(row: Row) -> None:
    """The two sides compute the same attention (else the ratio compares different things)."""
    a, f = row.attnzero(), row.flex()
    err = float((a - f).abs().max())
    if not err < 1e-3:
        raise AssertionError(f"flex table, {row.name}: attnzero and Flex differ by {err:.3g}")


def section(quick: bool, repeats: int, lengths: tuple[int, ...] | None = None) -> Iterator[str]:
    """The table, line by line."""
    from torch.nn.attention.flex_attention import flex_attention

    # Every row is a new score_mod / block mask, so a recompile of flex_attention: past dynamo's
    # cache limit (8) torch would silently run the unfused eager Flex, which is not the anchor.
    torch._dynamo.config.cache_size_limit = 1024
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    # dynamic=False: one static compile per shape. With torch's default, the second shape of a row
    # recompiles with dynamic sizes (automatic dynamic), and at L = 8192 the document row's dynamic
    # kernel failed to build (InductorError: the static one builds).
    compiled = torch.compile(flex_attention, dynamic=False)
    lengths = lengths or (QUICK_LENGTHS if quick else LENGTHS)
    yield "vs torch.compile(flex_attention): forward, inference, float32, attnzero's time ÷ Flex's (below 1: faster)"
    yield ""

    def cells() -> Iterator[list[str]]:
        shapes = [(1, 8, L, 64, False) for L in lengths] + [(12, 4, 256, 32, True)]
        for B, H, L, D, nanogpt in shapes:
            for row in rows(B, H, L, D, compiled, nanogpt):
                shape = f"B{B} H{H} L{L} D{D}"
                with torch.no_grad():
                    try:
                        row.flex()
                    except Exception as e:  # torch's compiled Flex fails on some of them on CPU: say so, go on
                        alone = time_interleaved({"attnzero": row.attnzero}, repeats)["attnzero"]
                        yield [row.name, shape, ms(alone), f"fails: {type(e).__name__}", ""]
                        continue
                    _checked(row)
                    t = time_interleaved({"attnzero": row.attnzero, "flex": row.flex}, repeats)
                yield [row.name, shape, ms(t["attnzero"]), ms(t["flex"]), f"{t['attnzero'] / t['flex']:.2f}"]

    yield from table(["case", "shape", "attnzero ms", "Flex ms", "attnzero ÷ Flex"], cells())
