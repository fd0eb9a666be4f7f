"""Rung 10 of the ladder (your own attention: a score_mod and a mask_mod through flash's tiles): it
runs and its check passes, its picture is written, the tiles it records are the ones the kept pairs
call for — and the check fails when the tiles forget the score_mod, when the block table calls a
partial block full, or when the slopes' gradient is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import absent

import attnzero as az
from attnzero import blocks, geometry, ladder, mods
from attnzero.ladder import docs
from attnzero.ladder.common import max_error, pictures_available
from attnzero.ladder.r10_mods import alibi, by_the_formula, exact_tiles, indices, prefix_lm


def test_rung_runs_small_its_check_passes_and_it_draws_its_picture(tmp_path: Path) -> None:
    if not pictures_available():
        absent("matplotlib is not installed (pip install matplotlib)")
    result = ladder.run(10, tmp_path, small=True, quiet=True)
    assert result.ok and result.error <= 1e-12, result.lines
    assert result.rung == 10 and result.title == ladder.module(10).TITLE
    assert result.lines[-1].startswith("check: ") and result.lines[-1].endswith("OK")
    assert [p.name for p in result.pictures] == ["r10-mods.png"]
    assert all(p.is_file() and p.stat().st_size > 1000 for p in result.pictures)
    nums = result.numbers
    skip, partial, full = nums["table"]
    assert skip > 0 and partial > 0 and full > 0 and skip + partial + full == 16  # a 4 × 4 grid of tiles
    assert nums["visited_forward"] == nums["visited_backward"] == nums["must"] == (partial + full, partial)
    assert set(nums["errors"]) == {"out", "dq", "dk", "dv", "dslopes"}


def _run_small() -> Any:
    return ladder.run(10, None, small=True, quiet=True)


def test_check_fails_when_the_tiles_forget_the_score_mod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mods, "score_block", lambda score_mod, s, **kw: s)  # flash's tiles: the scores unmodified
    result = _run_small()
    assert not result.ok and result.numbers["errors"]["out"] > 1e-6


def test_check_fails_when_the_table_calls_a_partial_block_full(monkeypatch: pytest.MonkeyPatch) -> None:
    classify = blocks.BlockTable.classify

    def wrong(self: blocks.BlockTable, *args: Any, **kw: Any) -> geometry.Kind:
        got = classify(self, *args, **kw)
        return geometry.FULL if got is geometry.PARTIAL else got  # the mask is never evaluated

    monkeypatch.setattr(blocks.BlockTable, "classify", wrong)
    result = _run_small()
    assert not result.ok
    assert result.numbers["errors"]["out"] > 1e-6 and result.numbers["errors"]["tiles forward"] == float("inf")


def test_check_fails_when_the_slopes_gradient_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    backward = mods.score_block_backward

    def doubled(*args: Any, **kw: Any) -> Any:
        ds, grads = backward(*args, **kw)
        return ds, [None if g is None else 2 * g for g in grads]  # the captured tensors' share, twice

    monkeypatch.setattr(mods, "score_block_backward", doubled)
    result = _run_small()
    errors = result.numbers["errors"]
    assert not result.ok and errors["dslopes"] > 1e-6 and errors["out"] <= 1e-12 and errors["dq"] <= 1e-12


def test_the_formula_is_attention_with_the_alibi_bias_and_the_dense_mask() -> None:
    """The rung's formula against the reference backend given the same thing built by hand: the
    bias −slope_h·|i − j| and the kept pairs as a dense mask (rows with no key: 0 in both)."""
    B, H, L, D = 2, 3, 24, 8
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    i, j = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    keep = (i < 20) & (j < 20) & ((j < 7) | (j <= i))  # (L, L): prefix 7, padding from 20
    bias = -slopes.view(H, 1, 1) * (i - j).abs()  # (H, L, L)
    want = az.attention(q, k, v, bias=bias, mask=keep, backend="reference")
    got = by_the_formula(q, k, v, alibi(slopes), prefix_lm(7, 20))
    assert max_error(got, want) <= 1e-12
    assert torch.equal(got[:, :, 20:], torch.zeros(B, H, L - 20, D, dtype=torch.float64))
    keep_rung = prefix_lm(7, 20)(*indices(1, 1, L, L))[0, 0]
    assert torch.equal(keep_rung, keep)


def test_exact_tiles_from_the_kept_pairs() -> None:
    keep = torch.ones(8, 8, dtype=torch.bool).tril()  # causal, tiles of 4: 3 tiles, the 2 diagonal ones cut
    assert exact_tiles(keep, 4) == {((0, 4), (0, 4)): True, ((4, 8), (0, 4)): False, ((4, 8), (4, 8)): True}
    assert exact_tiles(torch.zeros(8, 8, dtype=torch.bool), 4) == {}


def test_docs_include_the_rungs_functions() -> None:
    for ref in ("alibi", "prefix_lm", "tiled", "by_the_formula", "exact_tiles"):
        assert docs.source_of(f"attnzero/ladder/r10_mods.py::{ref}").strip()
    for page in ("ladder.md", "ladder.zh-CN.md"):
        text = (Path(__file__).resolve().parents[1] / "docs" / page).read_text(encoding="utf-8")
        targets = [(b.kind, b.target) for b in docs.blocks(text)]
        assert ("output", "10") in targets and ("include", "attnzero/ladder/r10_mods.py::alibi") in targets
        assert "(ladder/r10-mods.png)" in text
