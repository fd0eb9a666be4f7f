"""Rung 6 — the backward by recomputation: dQ, dK, dV from O and the lse, never storing P.

Autograd through the formula (rungs 0–3, ``attnzero.reference``) keeps what every step needs for
its gradient, the L × L probabilities P among them: memory grows with L². The flash backend keeps
only q, k, v, the output O and the log-sum-exp (O(L)) and, in the backward, recomputes each tile of
P from them: ``p_ij = exp(s_ij − lse_i)`` is exact, no running max needed, since the lse is the
row's final normaliser. With ``D_i = Σ_d dO_id O_id`` the gradients are, tile by tile
(``flash._backward_block``)::

    dV_j += Σ_i p_ij dO_i            dp_ij = dO_i · v_j
    ds_ij = p_ij (dp_ij − D_i)       dQ_i += scale Σ_j ds_ij k_j       dK_j += scale Σ_i ds_ij q_i

This rung runs the real backward (``az.attention(..., backend="flash")`` then ``.backward``) with
small tiles, checks dQ, dK, dV against autograd through the formula in float64, reads back the
tiles the backward visited (``attnzero.trace``), and measures the memory of both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import attnzero as az
from attnzero import bench, flash, trace
from attnzero.functional import BackendName
from attnzero.masks import keep_block
from attnzero.trace import Record

from .common import Printer, Result, figure, max_error, median_time
from .r5_tiles import BACKENDS, draw_tiles, first_pair, legend

TITLE = "Backward by recomputation: dQ, dK, dV from O and the lse"


def flash_grads(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, rows: int, cols: int, **mask_args: Any
) -> tuple[tuple[Tensor, ...], Record]:
    """(dQ, dK, dV) of ``(O · dout).sum()`` by the flash backend, with tiles of ``rows`` × ``cols``,
    and the record of its forward and backward tiles. The forward saves q, k, v, O and the lse;
    the backward recomputes P from them, tile by tile."""
    with flash.block_sizes(rows=rows, cols=cols), trace.recording() as rec:
        out = az.attention(q, k, v, backend="flash", **mask_args)  # (B, H, L, D)
        grads = torch.autograd.grad(out, (q, k, v), dout)  # dQ, dK, dV: (B, H, L, D) each
    return grads, rec


def formula_grads(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, **mask_args: Any) -> tuple[Tensor, ...]:
    """(dQ, dK, dV) by autograd through the formula: ``attnzero.reference`` materialises the scores
    and P (B, H, L, L), and autograd keeps them for the backward."""
    out = az.attention(q, k, v, backend="reference", **mask_args)  # (B, H, L, D)
    return torch.autograd.grad(out, (q, k, v), dout)


def saved_mb(fn: Callable[[], object]) -> float:
    """MB of the tensors autograd keeps for the backward while ``fn()`` builds its graph (each
    storage counted once; the inputs included): read by ``torch.autograd.graph.saved_tensors_hooks``,
    which sees every tensor a forward saves, a custom autograd.Function's as well."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out  # the graph and what it saved go with it
    return sum(storages.values()) / 2**20


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    gen = torch.Generator().manual_seed(0)  # the rung's own generator: torch's global one is left alone
    B, H, L, D = (1, 2, 64, 16) if small else (1, 2, 128, 32)
    r = c = 16
    say(f"q, k, v, dO: (B, H, L, D) = {(B, H, L, D)}, float64; tiles of {r} rows × {c} keys")
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)  # (B, H, L, D)
    ids = [0] * (3 * L // 8) + [1] * (L - 3 * L // 8)  # two packed documents
    cases: dict[str, dict[str, Any]] = {
        "causal": {"causal": True},
        "causal documents": {"causal": True, "mask": az.masks.document(ids)},
    }
    error = 0.0
    numbers: dict[str, Any] = {}
    records: dict[str, Record] = {}
    for name, args in cases.items():
        before = flash.COUNTS["backward"]
        grads, rec = flash_grads(q, k, v, dout, r, c, **args)
        counted = flash.COUNTS["backward"] - before
        want = formula_grads(q, k, v, dout, **args)
        errs = [max_error(g, w) for g, w in zip(grads, want, strict=True)]
        error = max(error, *errs)
        fwd = [e for e in rec.of("flash.tile") if e["pass_"] == "forward"]
        bwd = [e for e in rec.of("flash.tile") if e["pass_"] == "backward"]
        same = sorted((e["rows"], e["cols"]) for e in fwd) == sorted((e["rows"], e["cols"]) for e in bwd)
        verdict = "the same blocks" if same else "NOT the same blocks"
        if not same or len(bwd) != counted:  # the record must be what ran (and counted), or the picture lies
            error = math.inf
        say(f"{name:16s}: dQ {errs[0]:.1e}  dK {errs[1]:.1e}  dV {errs[2]:.1e}   tiles: forward {len(fwd)}, "
            f"backward {len(bwd)} ({verdict}; flash.COUNTS['backward'] +{counted})")  # fmt: skip
        numbers[f"tiles_backward_{name}"] = len(bwd)
        records[name] = rec

    # memory: what autograd keeps for the backward, and the extra peak of forward + backward
    Bm, Hm, Dm = 1, 8, 64
    lengths = (128, 256, 512) if small else (512, 1024, 2048)
    # the extra peak, in a fresh process per case (seconds each): not when small, and only from L = 1024,
    # where the L × L tensors dwarf what the allocator keeps from the warm-up run (below, it varies run to run)
    peak_from = None if small else 1024
    say(f"memory, causal forward + backward, (B, H, D) = {(Bm, Hm, Dm)}, float32:")
    say("      L   saved: formula    flash   |  extra peak: formula    flash")
    mem: dict[str, list[tuple[int, float, float | None]]] = {"reference": [], "flash": []}
    for Lm in lengths:
        cells = []
        for impl in BACKENDS:
            qkv = [torch.randn(Bm, Hm, Lm, Dm, generator=gen, requires_grad=True) for _ in range(3)]  # (B, H, L, D)
            saved = saved_mb(partial(az.attention, *qkv, causal=True, backend=impl))
            # extra peak resident memory of one forward + backward in a fresh process (bench.py; None
            # where /proc is not there)
            case = bench.Case(impl, Lm, causal=True, backward=True, B=Bm, H=Hm, D=Dm)
            peak = bench.peak_memory_mb(case) if peak_from is not None and Lm >= peak_from else None
            mem[impl].append((Lm, saved, peak))
            numbers[f"saved_{impl}_L{Lm}_mb"] = saved
            if peak is not None:
                numbers[f"peak_{impl}_L{Lm}_mb"] = peak
            cells.append((saved, peak))
        (s_ref, p_ref), (s_fl, p_fl) = cells
        peaks = "     (not measured)" if p_ref is None or p_fl is None else f"{p_ref:10.1f} MB {p_fl:7.1f} MB"
        say(f"  {Lm:5d}   {s_ref:10.1f} MB {s_fl:7.1f} MB   |  {peaks}")

    # time at a fixed shape: forward + backward, the flash backend (its own block sizes) against the formula
    Bt, Ht, Lt, Dt = (1, 4, 128, 64) if small else (1, 8, 1024, 64)
    qt, kt, vt, dt = (torch.randn(Bt, Ht, Lt, Dt, generator=gen, requires_grad=i < 3) for i in range(4))
    say(f"time, causal forward + backward, (B, H, L, D) = {(Bt, Ht, Lt, Dt)}, float32:")
    for impl in BACKENDS:

        def step(i: BackendName = impl) -> None:
            o = az.attention(qt, kt, vt, causal=True, backend=i)  # (B, H, L, D)
            assert isinstance(o, Tensor)
            torch.autograd.grad(o, (qt, kt, vt), dt)

        secs = median_time(step, repeats=3)
        numbers[f"time_{impl}_s"] = secs
        say(f"  {impl:9s} {secs * 1e3:8.2f} ms")

    pictures = []
    if out is not None:
        path = out / "r6-memory.png"
        with figure(path, size=(6.5, 4.0)) as (_, axes):
            ax = axes[0][0]
            for impl, colour, label in (("reference", "#d94801", "formula (autograd keeps P)"),
                                        ("flash", "#2171b5", "flash (keeps O and lse)")):  # fmt: skip
                ax.plot([p[0] for p in mem[impl]], [p[1] for p in mem[impl]], "o-", color=colour,
                        label=f"{label}: saved for backward")  # fmt: skip
                measured = [(p[0], p[2]) for p in mem[impl] if p[2] is not None]
                if measured:
                    ax.plot(*zip(*measured, strict=True), "s--", color=colour, label=f"{label}: extra peak")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length L")
            ax.set_ylabel("MB")
            ax.set_title(f"causal forward + backward, B={Bm}, H={Hm}, D={Dm}, float32", fontsize=9)
            ax.legend(fontsize=7)
        pictures.append(path)
        path = out / "r6-tiles.png"
        name = "causal documents"
        with figure(path, size=(8.0, 5.0), ncols=2) as (fig, axes):
            keep = keep_block(cases[name]["mask"], True, None, L, L, (0, L), (0, L), q.device)
            assert keep is not None
            for ax, pass_ in zip(axes[0], ("forward", "backward"), strict=True):
                mine = first_pair([e for e in records[name].of("flash.tile") if e["pass_"] == pass_])
                draw_tiles(ax, mine, L, keep.reshape(L, L), f"{name}, {pass_}: {len(mine)} tiles")
            legend(fig, ncol=2)
            fig.subplots_adjust(bottom=0.22)
        pictures.append(path)
        say(f"pictures: {', '.join(str(p) for p in pictures)}")
    return Result(
        rung=6, title=TITLE, check="flash dQ, dK, dV vs autograd through the formula, float64",
        error=error, tol=1e-12, numbers=numbers, pictures=pictures,
    )  # fmt: skip
