"""The built-ins written as FlexAttention functions give the built-ins' results (the README's table):
softcap and ALiBi as score_mods; causal (both alignments), window and documents as mask_mods
(``az.masks.from_mod``, on every backend that exists) and as score_mods returning −inf."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import qkv

import attnzero as az
from attnzero import flash
from attnzero import masks as M

Tensor = torch.Tensor
B, H, Lq, Lk = 2, 4, 13, 21
OFF = Lk - Lq  # bottom-right: query i sits at key position i + OFF
IDS = torch.tensor([0] * 5 + [1] * 9 + [2] * 7)  # (21,) documents, for Lq = Lk = 21


def _as_score(mask_mod: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def score_mod(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return torch.where(mask_mod(b, h, q, kv), s, float("-inf"))

    return score_mod


MASK_CASES: dict[str, tuple[Callable[..., Tensor], dict[str, Any], tuple[int, int]]] = {
    "causal_bottom_right": (lambda b, h, q, kv: kv <= q + OFF, {"causal": True}, (Lq, Lk)),
    "causal_top_left": (lambda b, h, q, kv: kv <= q, {"mask": M.causal(Lq, Lk, align="top_left")}, (Lq, Lk)),
    "window": (lambda b, h, q, kv: (kv >= q + OFF - 3) & (kv <= q + OFF + 2), {"window": (3, 2)}, (Lq, Lk)),
    "documents": (lambda b, h, q, kv: IDS[q] == IDS[kv], {"mask": M.document(IDS)}, (Lk, Lk)),
}


@pytest.mark.parametrize("name", list(MASK_CASES))
@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_mask_mods_give_the_built_ins_results(name: str, backend: str) -> None:
    mod, builtin, (lq, lk) = MASK_CASES[name]
    q, k, v = qkv(B, H, 2, lq, lk, 8)
    want, wlse = az.attention(q, k, v, return_lse=True, **builtin)  # type: ignore[misc]
    mask = M.from_mod(mod, 1, 1, lq, lk, block_size=4)
    with flash.block_sizes(rows=8, cols=8):
        got, lse = az.attention(q, k, v, mask=mask, backend=backend, return_lse=True)  # type: ignore[misc]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, wlse)
    if backend == "reference":  # the same as a score_mod of −inf
        out = az.attention(q, k, v, score_mod=_as_score(mod), backend="reference")
        torch.testing.assert_close(out, want)


def test_softcap_as_a_score_mod() -> None:
    q, k, v = qkv(B, H, 2, Lq, Lk, 8)
    q = q * 4  # large scores, so the cap matters
    cap = 2.0
    got = az.attention(q, k, v, score_mod=lambda s, b, h, i, j: cap * torch.tanh(s / cap), causal=True)
    torch.testing.assert_close(got, az.attention(q, k, v, softcap=cap, causal=True))


def test_alibi_as_a_score_mod() -> None:
    slopes = M.alibi_slopes(H).double()
    q, k, v = qkv(B, H, 2, Lq, Lk, 8)

    def alibi(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s - slopes[h] * (i + OFF - j).abs()

    got = az.attention(q, k, v, score_mod=alibi)
    torch.testing.assert_close(got, az.attention(q, k, v, bias=M.alibi(H, Lq, Lk)))
