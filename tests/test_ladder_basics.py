"""Rungs 0–4 of the ladder: each runs at small sizes and its check passes, its pictures are written,
and what each rung claims to show is really there (the NaN row, the 16-bit overflow, the online
softmax's record)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from conftest import absent

from attnzero import attention, ladder, masks
from attnzero.ladder import common
from attnzero.ladder.r0_seeds import left_padded_causal, seeds_attention, softmax_of_blocked_row
from attnzero.ladder.r2_heads import grouped_attention, kv_head_read, per_head_loop, repeated_attention
from attnzero.ladder.r3_safe_softmax import naive_softmax, running_sum, safe_attention, safe_softmax
from attnzero.ladder.r4_online import online_softmax_row

PICTURES = {0: "r0-nan-row.png", 1: "r1-masks.png", 2: "r2-heads.png", 3: "r3-overflow.png", 4: "r4-online.png"}


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_rung_runs_small_and_its_check_passes(n: int, tmp_path: Path) -> None:
    if not common.pictures_available():
        absent("matplotlib is not installed (pip install matplotlib)")
    result = ladder.run(n, tmp_path, small=True, quiet=True)
    assert result.rung == n and result.title == ladder.module(n).TITLE
    assert result.ok and result.error <= 1e-12, result.lines
    assert result.lines[-1].startswith("check: ") and result.lines[-1].endswith("OK")
    assert [p.name for p in result.pictures] == [PICTURES[n]]
    for p in result.pictures:
        assert p.parent == tmp_path and p.is_file() and p.stat().st_size > 1000


def test_rung_without_a_folder_draws_nothing() -> None:
    result = ladder.run(4, None, small=True, quiet=True)
    assert result.ok and result.pictures == []


# -- rung 0: the seeds' code gives NaN on a row with no key, attnzero 0


def test_r0_blocked_row_is_nan_for_the_seeds_and_zero_for_attnzero() -> None:
    steps = softmax_of_blocked_row()
    assert torch.isnan(steps["torch.softmax"]).all() and torch.isnan(steps["row - max"]).all()
    q, k, v = (torch.randn(2, 1, 5, 4, dtype=torch.float64) for _ in range(3))
    keep = left_padded_causal([5, 3], 5)  # sequence 1: rows 0 and 1 see only padding
    out_seeds, w_seeds = seeds_attention(q, k, v, keep)
    out_ref = attention(q, k, v, mask=keep != 0, backend="reference")
    assert torch.isnan(out_seeds[1, 0, :2]).all() and torch.isnan(w_seeds[1, 0, :2]).all()
    assert not torch.isnan(out_seeds[1, 0, 2:]).any() and not torch.isnan(out_seeds[0]).any()
    assert torch.equal(out_ref[1, 0, :2], torch.zeros(2, 4, dtype=torch.float64))
    torch.testing.assert_close(out_ref[1, 0, 2:], out_seeds[1, 0, 2:], rtol=1e-12, atol=1e-12)
    result = ladder.run(0, None, small=True, quiet=True)
    assert result.numbers["nan_rows_seeds"] == 2


# -- rung 1: masks in one convention


def test_r1_the_seeds_tril_is_attnzeros_causal_mask() -> None:
    L = 7
    assert torch.equal(torch.tril(torch.ones(L, L)).bool(), masks.causal(L).to_tensor()[0, 0])
    assert torch.equal(masks.causal(3, 5, align="top_left").to_tensor()[0, 0], torch.ones(3, 5).tril().bool())
    assert torch.equal(masks.causal(3, 5).to_tensor()[0, 0], torch.ones(3, 5).tril(diagonal=2).bool())


# -- rung 2: GQA as a reshape


@pytest.mark.parametrize("Hq,Hkv", [(6, 6), (6, 3), (6, 1)])
def test_r2_grouped_equals_loop_repeat_and_attnzero(Hq: int, Hkv: int) -> None:
    q = torch.randn(2, Hq, 5, 8, dtype=torch.float64)
    k, v = (torch.randn(2, Hkv, 7, 8, dtype=torch.float64) for _ in range(2))
    keep = masks.causal(5, 7).to_tensor()  # (1, 1, 5, 7)
    per_head_keep = torch.rand(2, Hq, 5, 7) < 0.8
    per_head_keep[..., -1] = True  # every row keeps a key
    for mask in (keep, per_head_keep, None):
        out = grouped_attention(q, k, v, mask)
        for other in (per_head_loop(q, k, v, mask), repeated_attention(q, k, v, mask)):
            torch.testing.assert_close(out, other, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out, attention(q, k, v, mask=mask, backend="reference"), rtol=1e-12, atol=1e-12)
    assert kv_head_read(Hq, Hkv) == [h // (Hq // Hkv) for h in range(Hq)]


# -- rung 3: 16-bit overflow of the naive exp, and the safe softmax


@pytest.mark.parametrize("dtype,big", [(torch.float16, 12.0), (torch.bfloat16, 100.0)])
def test_r3_naive_exp_overflows_in_16_bit_and_the_safe_softmax_does_not(dtype: torch.dtype, big: float) -> None:
    s = torch.tensor([[big, 1.0, -2.0, 0.5]], dtype=dtype)
    assert torch.isinf(torch.exp(s)).any()
    assert torch.isnan(naive_softmax(s)).any()
    p = safe_softmax(s)
    assert p.dtype == torch.float32 and torch.isfinite(p).all()
    torch.testing.assert_close(p.double(), torch.softmax(s.double(), dim=-1), rtol=1e-6, atol=1e-7)


def test_r3_blocked_row_gives_zero_and_16_bit_sums_stall() -> None:
    s = torch.tensor([[float("-inf")] * 3, [0.0, float("-inf"), 1.0]], dtype=torch.float64)
    p = safe_softmax(s)
    assert torch.equal(p[0], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(p[1], torch.softmax(s[1], dim=-1))
    terms = torch.full((2048,), 0.5, dtype=torch.float64)
    assert running_sum(terms, torch.bfloat16) < 0.5 * float(terms.sum())
    assert running_sum(terms, torch.float32) == float(terms.sum())


def test_r3_safe_attention_in_bfloat16_is_close_to_float64() -> None:
    q = torch.randn(1, 4, 9, 16, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 9, 16, dtype=torch.float64) for _ in range(2))
    keep = masks.causal(9).to_tensor()
    gold = safe_attention(q, k, v, keep)
    low = safe_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), keep)
    assert low.dtype == torch.bfloat16
    assert common.max_error(low, gold) < 0.05


# -- rung 4: online softmax, one row


def test_r4_record_has_one_entry_per_block_and_alpha_at_most_1() -> None:
    Lk, block = 100, 16  # 7 blocks, the last one short
    s = 3.0 * torch.randn(Lk, dtype=torch.float64)
    v = torch.randn(Lk, 5, dtype=torch.float64)
    out, lse, record = online_softmax_row(s, v, block)
    assert len(record) == math.ceil(Lk / block)
    assert [(r.start, r.stop) for r in record] == [(i, min(i + block, Lk)) for i in range(0, Lk, block)]
    assert all(0.0 <= r.alpha <= 1.0 for r in record)
    ms = [r.m for r in record]
    assert ms == sorted(ms) and ms[-1] == float(s.max())  # the running max only grows, to the row's max
    assert all(r.alpha == 1.0 for a, r in itertools.pairwise(record) if r.m == a.m)
    torch.testing.assert_close(out, safe_softmax(s) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=0), rtol=1e-12, atol=1e-12)
    assert math.isclose(record[-1].l, float(torch.exp(s - s.max()).sum()), rel_tol=1e-12)


def test_r4_fully_blocked_row_gives_zero_and_m_stays_minus_inf() -> None:
    s = torch.full((40,), float("-inf"), dtype=torch.float64)
    v = torch.randn(40, 3, dtype=torch.float64)
    out, lse, record = online_softmax_row(s, v, 8)
    assert torch.equal(out, torch.zeros(3, dtype=torch.float64))
    assert float(lse) == -math.inf
    assert len(record) == 5 and all(r.m == -math.inf and r.l == 0.0 for r in record)


def test_r4_blocked_first_blocks_then_very_negative_scores() -> None:
    # m stays -inf through the blocked blocks; a later block of very negative scores must still
    # count (the state keeps -inf, not the substitute 0, which would underflow these to l = 0)
    s = torch.full((24,), float("-inf"), dtype=torch.float64)
    s[16:] = -1000.0 + torch.arange(8, dtype=torch.float64)
    v = torch.randn(24, 2, dtype=torch.float64)
    out, lse, record = online_softmax_row(s, v, 8)
    assert [r.m for r in record[:2]] == [-math.inf, -math.inf] and record[2].m == -993.0
    torch.testing.assert_close(out, torch.softmax(s, dim=0) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=0), rtol=1e-12, atol=1e-12)
