"""Rung 9 of the ladder (ring attention on two processes) and the ring's instrumentation.

The rung runs once, small, with its rank function wrapped (``spy_rank``): each rank also logs every
call the ring makes to its attention backend. The tests then hold the "ring.step" record against
the ring's rules (each block once per pass, held at step s by rank (r + s) mod W), against
``geometry.classify`` and ``distributed._blocks``, and against the backend calls that really ran.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from attnzero import distributed, geometry, ladder, ops, trace
from attnzero.ladder import r9_ring as r9


def spy_rank(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """The rung's ``ring_rank``, with every backend forward / backward call logged: (pass, the query
    rows and keys it was given, causal, whether a recording was open)."""
    calls: list[dict[str, Any]] = []

    def spy(pass_: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            q, k = (args[0], args[1]) if pass_ == "forward" else (args[1], args[2])
            calls.append({"pass_": pass_, "q": q.detach().clone(), "k": k.detach().clone(),
                          "causal": kwargs["causal"], "recording": trace.active()})  # fmt: skip
            return fn(*args, **kwargs)

        return call

    for name, be in list(ops.BACKENDS.items()):
        ops.BACKENDS[name] = be._replace(forward=spy("forward", be.forward), backward=spy("backward", be.backward))
    result = r9.ring_rank(rank, world, job)
    result["calls"] = calls
    return result


@pytest.fixture(scope="module")
def rung(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rung 9, small, pictures into a temporary folder; also the job and what each rank returned."""
    seen: dict[str, Any] = {}
    real_launch = r9.launch

    def launch(fn: Any, job: dict[str, Any], world: int = r9.WORLD, timeout_s: float = 120.0) -> list[Any]:
        assert fn is r9.ring_rank
        seen["job"] = job
        seen["ranks"] = real_launch(spy_rank, job, world, timeout_s)
        return seen["ranks"]

    out = tmp_path_factory.mktemp("r9")
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(r9, "launch", launch)
        result = ladder.run(9, out, small=True, quiet=True)
    seen["seconds"] = time.monotonic() - start
    print(f"\nrung 9 (small) ran in {seen['seconds']:.1f} s")
    seen["result"] = result
    return seen


def _steps(rung: dict[str, Any], layout: str, pass_: str | None = None) -> list[dict[str, Any]]:
    return [ev for res in rung["ranks"] for ev in res[layout]["steps"] if pass_ in (None, ev["pass_"])]


def test_rung_9_runs_small_and_passes(rung: dict[str, Any]) -> None:
    result = rung["result"]
    assert result.ok, (result.error, result.lines)
    assert result.rung == 9 and result.error < 1e-12
    assert set(result.numbers["errors"]) == {f"{lay} {n}" for lay in r9.LAYOUTS for n in ("out", "dq", "dk", "dv")}
    assert [p.name for p in result.pictures] == ["r9-ring.png", "r9-balance.png"]
    for p in result.pictures:
        assert p.is_file() and p.stat().st_size > 5000, p
    said = "\n".join(result.lines)
    assert "ring, zigzag" in said and "one process, flash" in said


@pytest.mark.parametrize("layout", r9.LAYOUTS)
def test_each_rank_holds_every_block_once_per_pass(rung: dict[str, Any], layout: str) -> None:
    """Per pass, each rank notes W steps 0..W-1; at step s it holds the block of rank (r - s) mod W,
    so it sees every rank's block exactly once."""
    W = r9.WORLD
    for pass_ in ("forward", "backward"):
        for rank in range(W):
            mine = [ev for ev in _steps(rung, layout, pass_) if ev["rank"] == rank]
            assert [ev["step"] for ev in mine] == list(range(W)), (pass_, rank)
            assert [ev["src"] for ev in mine] == [(rank - s) % W for s in range(W)], (pass_, rank)
            assert sorted(ev["src"] for ev in mine) == list(range(W))
            assert all(ev["world"] == W and ev["layout"] == layout for ev in mine)


@pytest.mark.parametrize("layout", r9.LAYOUTS)
def test_the_record_covers_the_causal_triangle_exactly_once(rung: dict[str, Any], layout: str) -> None:
    """Put together, the recorded blocks of all ranks cover every pair key ≤ query once and no
    other pair, in each pass."""
    N = rung["job"]["q"].shape[2]
    lower = torch.ones(N, N, dtype=torch.bool).tril()
    for pass_ in ("forward", "backward"):
        who = r9.coverage(_steps(rung, layout, pass_), N)
        assert not (who == -2).any(), f"{pass_}: some pair computed twice"
        assert ((who >= 0) == lower).all(), f"{pass_}: the computed pairs are not the causal triangle"


def _expected_pairs(rank: int, L: int, layout: str) -> int:
    """(query, key) pairs of rank ``rank`` in one pass, from geometry.classify on every (query
    chunk, key chunk) pair of the whole sequence — independent of the record."""
    W, total = r9.WORLD, r9.WORLD * L
    n = 0
    for src in range(W):
        for rows, qa in distributed._chunks_of(rank, L, W, layout):
            for cols, kb in distributed._chunks_of(src, L, W, layout):
                r, c = rows.stop - rows.start, cols.stop - cols.start
                kind = geometry.classify((qa, qa + r), (kb, kb + c), total, total, True, None)
                if kind is geometry.FULL:
                    n += r * c
                elif kind is geometry.PARTIAL:  # count the kept pairs one by one
                    n += sum(1 for i in range(qa, qa + r) for j in range(kb, kb + c) if j <= i)
    return n


@pytest.mark.parametrize("layout", r9.LAYOUTS)
def test_work_per_rank_from_the_record(rung: dict[str, Any], layout: str) -> None:
    """The recorded blocks are the ones ``_blocks`` gives; each rank's recorded work equals what
    geometry.classify says of its chunk pairs; zigzag is balanced, contiguous is not; the rung's
    numbers are the record's."""
    W = r9.WORLD
    L = rung["job"]["q"].shape[2] // W
    totals = []
    for rank in range(W):
        for pass_ in ("forward", "backward"):
            mine = [ev for ev in _steps(rung, layout, pass_) if ev["rank"] == rank]
            for ev in mine:
                want = distributed._blocks(rank, ev["src"], L, True, layout, W)
                assert ev["blocks"] == [(r.start, r.stop, c.start, c.stop, "diagonal" if d else "full")
                                        for r, c, d in want], ev  # fmt: skip
            w = r9.work(mine)
            assert w["full"] + w["diagonal"] == _expected_pairs(rank, L, layout), (rank, pass_, w)
            if pass_ == "forward":
                assert rung["result"].numbers["work"][layout][rank] == w
                totals.append(w["full"] + w["diagonal"])
    if layout == "zigzag":
        assert len(set(totals)) == 1, totals
        assert all(w["skipped steps"] == 0 for w in rung["result"].numbers["work"][layout])
    else:
        assert totals == sorted(totals) and totals[-1] > 2 * totals[0], totals  # rank W-1 does the most
        assert rung["result"].numbers["work"][layout][0]["skipped steps"] == W - 1


def test_the_record_is_what_the_backend_computed(rung: dict[str, Any]) -> None:
    """Every recorded block is one backend call, in order, of the recorded kind, given exactly the
    queries and keys at the recorded global positions; no call goes unrecorded."""
    q_all, k_all = rung["job"]["q"], rung["job"]["k"]  # (B, H, N, D) float64
    for res in rung["ranks"]:
        calls = [c for c in res["calls"] if c["recording"]]
        expected = [(ev, blk) for lay in r9.LAYOUTS for ev in res[lay]["steps"] for blk in ev["blocks"]]
        assert len(calls) == len(expected), (res["rank"], len(calls), len(expected))
        for call, (ev, (r0, r1, c0, c1, kind)) in zip(calls, expected):
            assert call["pass_"] == ev["pass_"] and call["causal"] == (kind == "diagonal")
            rows = r9.positions(ev["q_at"], ev["chunk"], r0, r1)
            cols = r9.positions(ev["kv_at"], ev["chunk"], c0, c1)
            assert torch.equal(call["q"], q_all[:, :, rows]), (res["rank"], ev["step"], ev["pass_"])
            assert torch.equal(call["k"], k_all[:, :, cols]), (res["rank"], ev["step"], ev["pass_"])
        # the timed calls ran with nothing recording
        assert any(not c["recording"] for c in res["calls"])


def test_nothing_is_noted_when_not_recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In one process (a ring of one): a recording gets one step per pass; without one, the ring
    never calls trace.note."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        with trace.recording() as rec:
            distributed.ring_attention(q, k, v, causal=True, layout="zigzag").sum().backward()
        steps = rec.of("ring.step")
        assert [(ev["pass_"], ev["step"], ev["src"], ev["blocks"]) for ev in steps] == [
            ("forward", 0, 0, [(0, 6, 0, 6, "diagonal")]),
            ("backward", 0, 0, [(0, 6, 0, 6, "diagonal")]),
        ]
        assert steps[0]["q_at"] == [0, 3] and steps[0]["chunk"] == 3

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("trace.note called with nothing recording")

        monkeypatch.setattr(trace, "note", refuse)
        distributed.ring_attention(q, k, v, causal=True).sum().backward()
    finally:
        dist.destroy_process_group()
