"""Rungs 7 and 8 of the ladder (the Triton kernel, decoding) and the instrumentation they draw from:
the forward kernel's record of the key blocks each program visits, and the split-KV launcher's
"decode.split" events with the partial results the kernel wrote.

Without a GPU the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1 before
anything imports them), at the rungs' small sizes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import absent

import attnzero as az
from attnzero import flash, geometry, ladder, trace
from attnzero.ladder.common import pictures_available

if os.environ.get("CI") == "true":
    import triton  # CI installs triton: its absence must fail, not skip
else:
    triton = pytest.importorskip("triton", reason="the Triton rungs need `pip install triton`")

from attnzero.kernels import triton_backend as tb
from attnzero.ladder import r8_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _pictures(tmp_path: Path) -> Path | None:
    if not pictures_available():
        absent("the ladder's pictures need matplotlib")
        return None
    return tmp_path


@pytest.mark.parametrize("n,picture", [(7, "r7-programs.png"), (8, "r8-splits.png")])
def test_rung_runs_small_and_its_check_passes(tmp_path: Path, n: int, picture: str) -> None:
    result = ladder.run(n, _pictures(tmp_path), small=True, quiet=True)
    assert result.ok, "\n".join(result.lines)
    assert math.isfinite(result.error) and result.error <= result.tol
    assert result.pictures == [tmp_path / picture] and (tmp_path / picture).stat().st_size > 0
    assert result.lines[-1].startswith("check: ") and result.lines[-1].endswith("OK")


def test_rung7_counts_agree_with_flash() -> None:
    result = ladder.run(7, None, small=True, quiet=True)
    nums = result.numbers
    assert nums["causal_tiles"] == nums["causal_flash_tiles"]  # the same tiles computed, causal
    assert nums["causal_tiles"] < (48 // 16) ** 2  # some were skipped
    assert result.pictures == []  # no folder, no picture


def _inputs(B: int, Hq: int, Hkv: int, Lq: int, Lk: int, D: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(B, h, n, D, device=DEVICE) for h, n in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))


@pytest.mark.parametrize(
    "Lq,Lk,kw",
    [(50, 50, {"causal": True}), (40, 90, {"causal": True}), (45, 45, {"causal": True, "window": (17, 0)})],
    ids=["causal", "causal-rect", "window"],
)
def test_trace_records_the_tiles_causal_and_window_keep(Lq: int, Lk: int, kw: dict[str, Any]) -> None:
    """The kernel's own record: each program visits exactly the key blocks geometry does not skip
    for its rows, the number of tiles equals the flash backend's block counter at the same tile
    sizes, every program is recorded once and the masked (edge) tiles include every partial one."""
    B, Hq, Hkv = 2, 2, 1
    q, k, v = _inputs(B, Hq, Hkv, Lq, Lk, 16)
    with trace.recording() as rec:
        az.attention(q, k, v, backend="triton", **kw)
    events = rec.of("triton.program")
    bm, bn = events[0]["block_m"], events[0]["block_n"]
    n_m = -(-Lq // bm)
    assert sorted(e["pid"] for e in events) == list(range(n_m * B * Hq))
    assert {(e["batch"], e["head"], e["q_block"]) for e in events} == {
        (b, h, i) for b in range(B) for h in range(Hq) for i in range(n_m)
    }
    causal, window = kw.get("causal", False), kw.get("window")
    for e in events:
        r0, r1 = e["rows"]
        assert (r0, r1) == (e["q_block"] * bm, min(Lq, (e["q_block"] + 1) * bm))
        kinds = {nb: geometry.classify((r0, r1), (nb * bn, min(Lk, (nb + 1) * bn)), Lq, Lk, causal, window)
                 for nb in range(-(-Lk // bn))}
        assert e["key_blocks"] == [nb for nb, kd in kinds.items() if kd is not geometry.SKIP]
        for nb, masked in zip(e["key_blocks"], e["masked"]):
            assert masked or kinds[nb] is geometry.FULL  # a block without range checks keeps every pair
    per_head = sum(len(e["key_blocks"]) for e in events if e["batch"] == 0 and e["head"] == 0)
    # B = 1: one flash chunk of G heads (Lq >= 2 · 16 here: flash keeps the forced 16 rows under causal)
    q1, k1, v1 = (t[:1, :, :].double().cpu() for t in (q, k, v))
    with flash.block_sizes(rows=bm, cols=bn):
        before = flash.COUNTS["forward"]
        az.attention(q1, k1, v1, backend="flash", **kw)
        flash_tiles = flash.COUNTS["forward"] - before
    if window is None:  # causal: both visit the blocks up to the diagonal
        assert per_head == flash_tiles
    else:  # a window's first block starts at the band's edge in flash, at a block boundary here
        assert abs(per_head - flash_tiles) <= n_m


class _Refused:
    """Stands in for ``trace.note`` or the trace buffer (which a launch with TRACE=True writes
    into) where nothing records: any use fails."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the trace was used with nothing recording")


def test_no_recording_no_trace_and_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a recording the kernels run with TRACE off (nothing noted, no trace buffer for a
    traced launch); inside, with it on, with bit-identical outputs — forward and split-KV decode."""
    q, k, v = _inputs(1, 4, 2, 33, 40, 16)
    q1, k1, v1 = _inputs(1, 4, 2, 2, 90, 16)
    kw: dict[str, Any] = {"mask": None, "bias": None, "causal": True, "window": None, "scale": 0.25,
                          "dropout_p": 0.0, "dropout_seed": 0}
    with monkeypatch.context() as m:  # nothing recording: the instrumentation must stay out of the way
        for owner, name in ((trace, "note"), (tb, "_trace_buffer")):
            m.setattr(owner, name, _Refused())
        plain = az.attention(q, k, v, backend="triton", causal=True, window=(9, 3))
        with tb.decode_splits(3):
            out0, lse0 = tb.decode(q1, k1, v1, **kw)
    with trace.recording() as rec:
        traced = az.attention(q, k, v, backend="triton", causal=True, window=(9, 3))
    assert rec.of("triton.program") and torch.equal(plain, traced)
    with tb.decode_splits(3):
        with trace.recording() as rec:
            out1, lse1 = tb.decode(q1, k1, v1, **kw)
    events = rec.of("decode.split")  # 3 splits asked, at most one per key block (the GPU's blocks are larger)
    assert events[0]["splits"] == tb.dec_k.split_keys(90, events[0]["block_n"], 3)[0]
    assert len(events) == events[0]["splits"] * 2
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)


@pytest.mark.parametrize("splits,Lk", [(1, 40), (3, 100), (5, 77), (8, 33)])
def test_decode_split_partials_merge_to_the_kernels_output(splits: int, Lk: int) -> None:
    """The recorded partials (O_s, lse_s) merged in PyTorch give the merge kernel's output; the
    splits cover the keys once, in whole blocks, each program visiting exactly its own blocks."""
    B, Hq, Hkv, Lq = 2, 4, 2, 3
    q, k, v = _inputs(B, Hq, Hkv, Lq, Lk, 16)
    kw: dict[str, Any] = {"mask": None, "bias": None, "causal": True, "window": None, "scale": 0.25,
                          "dropout_p": 0.0, "dropout_seed": 0}
    with tb.decode_splits(splits), trace.recording() as rec:
        out, lse = tb.decode(q, k, v, **kw)
    events = rec.of("decode.split")
    S = events[0]["splits"]
    bn = events[0]["block_n"]
    assert S == tb.dec_k.split_keys(Lk, bn, splits)[0] <= min(splits, -(-Lk // bn))  # never more than asked / blocks
    assert len(events) == S * B * Hkv
    for b in range(B):
        for hk in range(Hkv):
            r = r8_decode.recorded_partials(events, b, hk)
            keys = r["keys"]
            assert keys[0][0] == 0 and keys[-1][1] == Lk
            assert all(keys[s][1] == keys[s + 1][0] for s in range(S - 1))
            for (lo, hi), blocks in zip(keys, r["key_blocks"]):
                assert blocks == list(range(lo // bn, -(-hi // bn)))  # causal, Lq <= Lk: every key kept
            o, l, w = r8_decode.merge_splits(r["out_s"], r["lse_s"])
            torch.testing.assert_close(o, out[b, r["heads"]].float().cpu(), rtol=0, atol=1e-5)  # (recorded: CPU)
            torch.testing.assert_close(l, lse[b, r["heads"]].cpu(), rtol=0, atol=1e-5)
            torch.testing.assert_close(w.sum(0), torch.ones_like(l))
    ref = az.attention(q.double(), k.double(), v.double(), causal=True, scale=0.25, backend="reference")
    assert (out.double() - ref).abs().max() < 1e-5


def test_decode_loop_equals_causal_attention() -> None:
    q, k, v = (torch.randn(1, h, 30, 8, dtype=torch.float64) for h in (4, 2, 2))
    full = az.attention(q, k, v, causal=True, backend="flash")
    torch.testing.assert_close(r8_decode.decode_loop(q, k, v, prompt=20), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(r8_decode.decode_loop(q, k, v, prompt=1), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(r8_decode.decode_loop(q, k, v, prompt=0), full, rtol=0, atol=1e-12)


def test_merge_splits_of_a_row_no_split_saw_is_zero() -> None:
    """Every split's lse -inf (no key anywhere): O = 0, lse = -inf, weights 0 — not NaN."""
    out_s = torch.randn(3, 2, 4, dtype=torch.float64)  # (S, rows, Dv)
    lse_s = torch.tensor([[0.5, float("-inf")]] * 3, dtype=torch.float64)  # (S, rows): row 1 saw nothing
    o, lse, w = r8_decode.merge_splits(out_s, lse_s)
    assert torch.equal(o[1], torch.zeros(4, dtype=torch.float64)) and lse[1] == float("-inf") and (w[:, 1] == 0).all()
    torch.testing.assert_close(o[0], out_s[:, 0].mean(0))


def test_decode_splits_rejects_bad_values_and_restores() -> None:
    before = tb.DECODE_SPLITS
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="decode_splits"), tb.decode_splits(bad):  # type: ignore[arg-type]
            pass
    with tb.decode_splits(3):
        assert tb.DECODE_SPLITS == 3
    assert tb.DECODE_SPLITS == before
