"""Ring attention with ``softcap=`` and ``sinks=``: 2 gloo processes on 127.0.0.1, forward and
gradients (q, k, v and the sinks) equal to single-device ``az.attention(backend="reference")`` in
float64 on the whole sequence, both layouts, causal and not.

The sink is added once, after the merge of the steps; each rank's dsinks is its own rows' share (for
per-head sinks (Hq,): the sum over its rows), and the ring does not reduce it — the sum over the
ranks is the whole sequence's gradient, as for every replicated parameter under DDP.

Like tests/test_distributed.py, ONE group of processes runs every case and saves its results, and the
tests read them. This file is also the worker script: ``python tests/test_ring_features.py <job dir> <rank>``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import kernel_built
from test_distributed import GROUP_TIMEOUT_S, TRITON_OK, Traffic, _free_port, run_ranks

WORLD = 2
CASE_TIMEOUT_S = 60  # the group of one run: a rank whose peer failed out of step gives up after this

# (dtype, layout, causal, B, Hq, Hkv, L per rank, D, Dv, softcap, sinks: "none" | "head" | "query")
Case = tuple[str, str, bool, int, int, int, int, int, int, float | None, str]
CASES: list[Case] = [
    ("float64", "contiguous", False, 2, 4, 2, 5, 8, 8, 1.5, "head"),  # GQA
    ("float64", "contiguous", False, 1, 2, 2, 3, 8, 8, 0.7, "none"),
    ("float64", "contiguous", True, 1, 3, 1, 7, 16, 12, None, "query"),  # MQA, Dv != D
    ("float64", "contiguous", True, 1, 2, 2, 1, 8, 8, 2.0, "head"),  # one position per rank
    ("float64", "contiguous", True, 2, 2, 1, 4, 8, 8, 1.0, "query"),
    ("float64", "zigzag", False, 1, 2, 2, 6, 8, 8, None, "head"),
    ("float64", "zigzag", False, 2, 2, 2, 4, 8, 8, 3.0, "query"),
    ("float64", "zigzag", True, 2, 4, 2, 10, 8, 16, 1.0, "query"),  # GQA
    ("float64", "zigzag", True, 1, 1, 1, 2, 4, 4, None, "head"),  # chunks of one position
    ("float64", "zigzag", True, 1, 2, 1, 4, 8, 8, 3.0, "none"),
    ("float32", "contiguous", True, 1, 4, 1, 9, 16, 16, 5.0, "head"),
    ("float32", "zigzag", True, 1, 4, 2, 8, 40, 40, 2.0, "query"),
    ("bfloat16", "zigzag", True, 1, 4, 2, 6, 16, 16, 2.0, "head"),  # 16-bit: float32 merges and sums
    # 16-bit, small: each piece's result was rounded before the merge (up to 5.6x the reference's error)
    ("bfloat16", "zigzag", True, 1, 2, 1, 4, 8, 8, None, "none"),
    ("bfloat16", "contiguous", True, 2, 2, 1, 4, 8, 8, None, "none"),
    ("bfloat16", "contiguous", False, 2, 4, 2, 4, 8, 8, None, "head"),
    ("float16", "zigzag", True, 2, 2, 1, 4, 8, 8, None, "query"),
]

# "auto" (flash on the CPU), the reference backend and the triton backend (interpreter; float64
# runs flash there) as the ring's one choice (functional._auto patched in the worker).
CHOICES = ["auto", "reference", "triton"]


def case_id(c: Case) -> str:
    dtype, layout, causal, B, Hq, Hkv, L, D, Dv, cap, sinks = c
    return f"{dtype}-{layout}-{'causal' if causal else 'full'}-B{B}H{Hq}:{Hkv}L{L}D{D}:{Dv}-cap{cap}-sinks_{sinks}"


def rows_of(rank: int, n: int, layout: str, world: int = WORLD) -> torch.Tensor:
    """The global positions of rank ``rank``'s rows, in its local order (what ``shard`` cuts)."""
    if layout == "contiguous":
        c = n // world
        return torch.arange(rank * c, (rank + 1) * c)
    c = n // (2 * world)
    late = 2 * world - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


# ---------------------------------------------------------------------------------------------
# The parent side


def launch(tmp: Path) -> dict[int, dict[str, Any]]:
    torch.manual_seed(2024 ^ int(os.environ.get("ATTNZERO_TEST_SEED", "0")))
    inputs = []
    for c in CASES:
        dtype, _, _, B, Hq, Hkv, L, D, Dv, _, sinks = c
        n = L * WORLD
        x = getattr(torch, dtype)
        # Scores of a few units, so that a softcap of 1-5 bends them; rounded to dtype once, so
        # the golden sees exactly what the ranks see.
        q, k, v = (torch.randn(B, H, n, d).mul(s).to(x).double() for H, d, s in ((Hq, D, 2), (Hkv, D, 2), (Hkv, Dv, 1)))
        dout = torch.randn(B, Hq, n, Dv).to(x).double()
        s = None
        if sinks == "head":
            s = torch.randn(Hq).mul(2).to(x).double()
        elif sinks == "query":
            s = torch.randn(B, Hq, n).mul(2).to(x).double()
        inputs.append({"id": case_id(c), "case": list(c), "q": q, "k": k, "v": v, "dout": dout, "sinks": s})
    choices = [c for c in CHOICES if c != "triton" or TRITON_OK]
    torch.save({"port": _free_port(), "cases": inputs, "choices": choices}, tmp / "job.pt")
    results = {}
    for r, (code, log) in enumerate(run_ranks(__file__, tmp, WORLD)):
        path = tmp / f"rank{r}.pt"
        assert path.exists() and code == 0, f"rank {r} saved no results (exit {code}):\n{log[-4000:]}"
        results[r] = torch.load(path, weights_only=False)
    results[-1] = torch.load(tmp / "job.pt", weights_only=False)
    return results


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return launch(tmp_path_factory.mktemp("ring_features"))


def golden(
    dtype: torch.dtype, inp: dict[str, Any], causal: bool, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(out, lse, grads of q, k, v, sinks) of az.attention(backend="reference") on the whole
    sequence, in ``dtype`` (the inputs are already rounded to it)."""
    import attnzero as az

    leaves = {n: inp[n].to(dtype).requires_grad_(True) for n in ("q", "k", "v", "sinks") if inp[n] is not None}
    out, lse = az.attention(
        leaves["q"], leaves["k"], leaves["v"], causal=causal, softcap=softcap, sinks=leaves.get("sinks"),
        backend="reference", return_lse=True,
    )  # fmt: skip
    gs = torch.autograd.grad(out, list(leaves.values()), inp["dout"].to(dtype))
    return out.detach(), lse.detach(), dict(zip(leaves, gs))


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_single_device(group: dict[int, dict[str, Any]], case: Case, choice: str) -> None:
    from conftest import absent

    from attnzero.testing import assert_close_to_golden

    if choice == "triton" and not TRITON_OK:
        absent("backend='triton' needs `pip install triton` and CUDA or TRITON_INTERPRET=1")
    key = f"{case_id(case)}@{choice}"
    results = [group[r]["cases"][key] for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "error" not in res, (r, res.get("error"))
    inp = next(c for c in group[-1]["cases"] if c["id"] == case_id(case))
    dtype_name, layout, causal, *_, softcap, sinks = case
    dtype = getattr(torch, dtype_name)
    gold_out, gold_lse, gold = golden(torch.float64, inp, causal, softcap)
    ref_out, _, ref = (gold_out, gold_lse, gold) if dtype == torch.float64 else golden(dtype, inp, causal, softcap)
    res = results[0]
    assert res["out"].dtype == dtype and res["out"].shape == gold_out.shape
    assert_close_to_golden(res["out"], ref_out, gold_out, name="out")
    for n in ("q", "k", "v"):
        assert res[f"d{n}"].dtype == dtype
        assert_close_to_golden(res[f"d{n}"], ref[n], gold[n], kind="grad", name=f"d{n}")
    for r in range(1, WORLD):
        assert torch.equal(results[r]["out"], res["out"])  # every rank gathered the same
    if sinks == "none":
        assert all(r["dsinks"] is None for r in results)
        return
    if sinks == "query":  # (B, Hq, L): each rank its own rows; gathered = the whole sequence's
        assert res["dsinks"].dtype == dtype and res["dsinks"].shape == gold["sinks"].shape
        assert_close_to_golden(res["dsinks"], ref["sinks"], gold["sinks"], kind="grad", name="dsinks")
        return
    # (Hq,): each rank holds its rows' share, not reduced by the ring; the sum is the whole gradient.
    shares = [r["dsinks"] for r in results]
    assert all(s.dtype == dtype and s.shape == gold["sinks"].shape for s in shares)
    total = sum(s.double() for s in shares)
    assert isinstance(total, torch.Tensor)
    ref_total = ref["sinks"].double()
    assert_close_to_golden(total, ref_total, gold["sinks"], kind="grad", name="sum of the ranks' dsinks")
    if dtype == torch.float64:
        # Each rank's share: −Σ over its rows of exp(sink − lse)·rowsum(dO ∘ O), from the golden.
        n = gold_out.shape[2]
        weight = torch.exp(inp["sinks"].view(1, -1, 1) - gold_lse)  # (B, Hq, n)
        terms = -(weight * (inp["dout"] * gold_out).sum(-1))  # (B, Hq, n)
        for r in range(WORLD):
            want = terms[:, :, rows_of(r, n, layout)].sum(dim=(0, 2))  # (Hq,)
            torch.testing.assert_close(shares[r], want, rtol=1e-10, atol=1e-10)
        assert not torch.allclose(shares[0], total), "the shares should differ from the total (not all-reduced)"


def completed(group: dict[int, dict[str, Any]], rank: int) -> list[tuple[str, dict[str, Any]]]:
    """Rank ``rank``'s runs that finished (test_matches_single_device reports the others); at least
    every case's run on the reference backend."""
    done = [(key, res) for key, res in group[rank]["cases"].items() if "error" not in res]
    assert len(done) >= len(CASES), [key for key, res in group[rank]["cases"].items() if "error" in res]
    return done


def test_the_ring_moves_no_more_than_without_features(group: dict[int, dict[str, Any]]) -> None:
    """Softcap and sinks add no communication: the only collective is the agreement's all_gather
    (no all_reduce of dsinks), and the point-to-point ops are those of a plain ring: forward W-1
    exchanges of (k, v); backward W-1 of (k, v) and W of (dk, dv)."""
    for r in range(WORLD):
        for key, res in completed(group, r):
            log = res["traffic"]
            assert [name for name, _ in log["collective"]] == ["all_gather"], (key, log["collective"])
            sends = [n for op, n in log["p2p"] if op == "isend"]
            assert len(sends) == 2 * (WORLD - 1) + 2 * (WORLD - 1) + 2 * WORLD, (key, log["p2p"])


def test_the_ring_runs_the_backend_of_the_one_choice(group: dict[int, dict[str, Any]]) -> None:
    for r in range(WORLD):
        for key, res in completed(group, r):
            choice = key.rsplit("@", 1)[1]
            want = "flash" if choice == "auto" or (choice == "triton" and key.startswith("float64")) else choice
            if want == "flash" and not key.startswith("float64") and kernel_built():
                want = "cpu_kernel"  # flash on CPU is the compiled kernel where it is built (the ranks' env is ours)
            assert res["traffic"]["backends"] == [want], (key, res["traffic"]["backends"])


def test_sinks_alone_need_no_ring_backward(group: dict[int, dict[str, Any]]) -> None:
    """Only the sinks require grad: the backward is local (no exchange, no backend backward), and
    its dsinks equal those of the run where q, k, v require grad too."""
    for r in range(WORLD):
        res = group[r]["sinks_only"]
        assert "error" not in res, res
        log = res["traffic"]
        assert log["order"].count("backward") == 0, log["order"]
        assert len(log["p2p"]) == 2 * 2 * (WORLD - 1), log["p2p"]  # the forward's exchanges only
        torch.testing.assert_close(res["dsinks"], res["dsinks_with_qkv"], rtol=0, atol=0)


def test_features_that_differ_raise_on_every_rank(group: dict[int, dict[str, Any]]) -> None:
    for r in range(WORLD):
        err = group[r]["mismatch_softcap"]
        assert err["type"] == "ValueError", err
        assert "expected the same softcap on every rank" in err["message"], err
        assert "rank 0: None" in err["message"] and "rank 1: 2.5" in err["message"], err
        err = group[r]["mismatch_sinks"]
        assert err["type"] == "ValueError", err
        assert "expected the same sinks on every rank" in err["message"], err
        assert "rank 0: per head (Hq,)" in err["message"] and "rank 1: None" in err["message"], err
        assert group[r]["after_mismatch"] == {"finite": True}, group[r]["after_mismatch"]


# ---------------------------------------------------------------------------------------------
# One process: validation (no process group needed) and a ring of one


def test_validation_messages() -> None:
    import attnzero as az

    ring = az.distributed.ring_attention
    q = torch.randn(2, 3, 4, 8)
    for bad, exc, msg in [
        (0.0, ValueError, r"softcap: expected a finite float > 0 \(or None\), got 0\.0"),
        (-2, ValueError, r"softcap: expected a finite float > 0 \(or None\), got -2"),
        (float("inf"), ValueError, r"softcap: .*got inf"),
        (float("nan"), ValueError, r"softcap: .*got nan"),
        (True, TypeError, r"softcap: expected None or a float > 0, got True"),
        ("1", TypeError, r"softcap: expected None or a float > 0, got '1'"),
    ]:
        with pytest.raises(exc, match=msg):
            ring(q, q, q, softcap=bad)
    for sinks, exc, msg in [
        ([0.0, 0.0, 0.0], TypeError, r"sinks: expected a torch.Tensor, got list"),
        (torch.zeros(3, dtype=torch.int64), TypeError, r"sinks: expected a floating dtype, got torch.int64"),
        (
            torch.zeros(4),
            ValueError,
            r"sinks: expected shape \(Hq,\) = \(3,\) or \(B, Hq, Lq\) = \(2, 3, 4\), got \(4,",
        ),
        (torch.zeros(2, 3, 8), ValueError, r"sinks: expected shape .*got \(2, 3, 8\)"),  # the whole sequence's
        (torch.zeros(1, 3, 4), ValueError, r"sinks: expected shape .*got \(1, 3, 4\)"),
        (torch.zeros(3, device="meta"), ValueError, r"sinks: device meta does not match q's cpu"),
    ]:
        with pytest.raises(exc, match=msg):
            ring(q, q, q, sinks=sinks)  # type: ignore[arg-type]
    # Argument errors come before any process group is needed.
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring(q, q, q, softcap=2.0, sinks=torch.zeros(3))


@pytest.mark.parametrize("choice", ["auto", "reference"])
@pytest.mark.parametrize("sinks", ["head", "query"])
def test_ring_of_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sinks: str, choice: str) -> None:
    """W = 1: the ring with softcap and sinks is az.attention, forward and gradients (dsinks too)."""
    import torch.distributed as dist

    import attnzero as az
    from attnzero import functional

    if choice != "auto":
        monkeypatch.setattr(functional, "_auto", lambda q, k: choice)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        q = torch.randn(2, 4, 9, 8, dtype=torch.float64).mul(2).requires_grad_(True)
        k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64).mul(2).requires_grad_(True) for _ in range(2))
        s = torch.randn(4 if sinks == "head" else (2, 4, 9), dtype=torch.float64).requires_grad_(True)
        out = az.distributed.ring_attention(q, k, v, causal=True, softcap=1.5, sinks=s)
        want = az.attention(q, k, v, causal=True, softcap=1.5, sinks=s, backend="reference")
        torch.testing.assert_close(out, want)
        g = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v, s), g), torch.autograd.grad(want, (q, k, v, s), g)):
            torch.testing.assert_close(a, b)
        # softcap changes the result (it is not ignored), and so do the sinks.
        assert not torch.allclose(out, az.distributed.ring_attention(q, k, v, causal=True, sinks=s))
        assert not torch.allclose(out, az.distributed.ring_attention(q, k, v, causal=True, softcap=1.5))
    finally:
        dist.destroy_process_group()


def test_a_rank_outside_the_group_is_told_so(tmp_path: Path) -> None:
    """torch's new_group gives a rank outside it a placeholder (GroupMember.NON_GROUP_MEMBER, an int):
    passed on as ``group=``, it was refused as a wrong type instead of as a group without this rank."""
    import torch.distributed as dist

    import attnzero as az

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        q = torch.randn(1, 2, 4, 8)
        with pytest.raises(ValueError, match="group: expected a process group that this rank belongs to"):
            az.distributed.ring_attention(q, q, q, group=dist.GroupMember.NON_GROUP_MEMBER)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The worker side


def _error(e: BaseException) -> dict[str, str]:
    return {"type": type(e).__name__, "message": str(e)}


def worker(tmp: Path, rank: int) -> None:
    import torch.distributed as dist

    import attnzero as az
    from attnzero import functional

    torch.set_num_threads(1)
    job = torch.load(tmp / "job.pt", weights_only=False)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )  # fmt: skip
    D = az.distributed
    saved: dict[str, Any] = {"cases": {}}

    real_auto = functional._auto
    for inp, choice in ((inp, choice) for inp in job["cases"] for choice in job["choices"]):
        functional._auto = real_auto if choice == "auto" else (lambda q, k, choice=choice: choice)  # type: ignore[misc]
        dtype_name, layout, causal, *_, softcap, sinks_kind = inp["case"]
        dtype = getattr(torch, dtype_name)

        def local(x: torch.Tensor, layout: str = layout, dtype: torch.dtype = dtype) -> torch.Tensor:
            return D.shard(x.to(dtype), layout=layout).detach().requires_grad_(True)  # (B, H, L, ...)

        q, k, v = local(inp["q"]), local(inp["k"]), local(inp["v"])
        dout = D.shard(inp["dout"].to(dtype), layout=layout)
        sinks: torch.Tensor | None = None
        if sinks_kind == "head":  # a replica on every rank
            sinks = inp["sinks"].to(dtype).clone().requires_grad_(True)  # (Hq,), a fresh leaf per run
        elif sinks_kind == "query":
            sinks = local(inp["sinks"])  # (B, Hq, L): this rank's rows
        # A group per run: a run that raises leaves its posted transfers there, not in the next run's way.
        g = dist.new_group(timeout=timedelta(seconds=CASE_TIMEOUT_S), backend="gloo")
        try:
            with Traffic() as traffic:
                out = D.ring_attention(q, k, v, causal=causal, softcap=softcap, sinks=sinks, layout=layout, group=g)
                out.backward(dout)
            assert q.grad is not None and k.grad is not None and v.grad is not None
            dsinks = None if sinks is None else sinks.grad
            saved["cases"][f"{inp['id']}@{choice}"] = {
                "out": D.gather(out.detach(), layout=layout, group=g),
                "dq": D.gather(q.grad, layout=layout, group=g),
                "dk": D.gather(k.grad, layout=layout, group=g),
                "dv": D.gather(v.grad, layout=layout, group=g),
                "dsinks": D.gather(dsinks, layout=layout, group=g) if sinks_kind == "query" else dsinks,
                "traffic": traffic.log,
            }
        except Exception as e:  # recorded, and the test of this case shows it
            saved["cases"][f"{inp['id']}@{choice}"] = {"error": repr(e)}
    functional._auto = real_auto

    # Only the sinks require grad: the backward needs no ring.
    try:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(1, 2, 8, 8, dtype=torch.float64, generator=gen)  # the same on every rank
        q, k, v = (D.shard(x * s, layout="zigzag").clone() for s in (1.0, 2.0, -1.0))
        head = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
        g1 = dist.new_group(timeout=timedelta(seconds=CASE_TIMEOUT_S), backend="gloo")
        with Traffic() as traffic:
            D.ring_attention(q, k, v, causal=True, sinks=head, layout="zigzag", group=g1).sum().backward()
        assert head.grad is not None
        res: dict[str, Any] = {"traffic": traffic.log, "dsinks": head.grad.clone()}
        head.grad = None
        qg, kg, vg = (t.requires_grad_(True) for t in (q, k, v))
        D.ring_attention(qg, kg, vg, causal=True, sinks=head, layout="zigzag", group=g1).sum().backward()
        res["dsinks_with_qkv"] = head.grad
        saved["sinks_only"] = res
    except Exception as e:
        saved["sinks_only"] = {"error": repr(e)}

    # Features that differ between ranks: every rank raises ValueError, and the group survives.
    y = torch.randn(1, 2, 4, 8)
    g2 = dist.new_group(timeout=timedelta(seconds=CASE_TIMEOUT_S), backend="gloo")
    for name, kw in (
        ("mismatch_softcap", {"softcap": None if rank == 0 else 2.5}),
        ("mismatch_sinks", {"sinks": torch.zeros(2) if rank == 0 else None}),
    ):
        try:
            D.ring_attention(y, y, y, group=g2, **kw)
            saved[name] = {"type": "none", "message": ""}
        except Exception as e:
            saved[name] = _error(e)
    try:  # the group still works after the rejected calls
        again = D.ring_attention(y, y, y, causal=True, sinks=torch.zeros(2), group=g2)
        saved["after_mismatch"] = {"finite": bool(torch.isfinite(again).all())}
    except Exception as e:
        saved["after_mismatch"] = _error(e)
    torch.save(saved, tmp / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]))
