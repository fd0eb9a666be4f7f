"""Rung 9: ring attention on two processes — which rank holds which key/value block at each step,
and why the zigzag layout balances the causal work that the contiguous one does not.

Two processes on this machine join a ``torch.distributed`` group (gloo). Each holds a slice of one
sequence and calls ``attnzero.distributed.ring_attention`` on it; the key/value blocks travel round
the ring. The ring notes every step it takes (``attnzero.trace``, event "ring.step": the block it
holds, the pieces it computes); each rank sends its record back to this process, which draws it.
The check: the slices put together equal the single-process flash backend of rung 5, in float64.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from .. import attention, trace
from ..distributed import Layout, gather, ring_attention, shard
from .common import Printer, Result, figure, max_error, median_time

TITLE = "ring attention on two processes: who holds which block, contiguous vs zigzag"

WORLD = 2
LAYOUTS: tuple[Layout, ...] = ("contiguous", "zigzag")

# A rank's job: fn(rank, world, job) runs inside an initialised process group; what it returns
# (tensors, lists, dicts) comes back to the parent.
RankFn = Callable[[int, int, dict[str, Any]], Any]


# ---------------------------------------------------------------------------------------------
# Two processes: a tiny launcher (what torchrun does, for one machine and one call)


def launch(fn: RankFn, job: dict[str, Any], world: int = WORLD, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world, job)`` on ``world`` new processes joined in a gloo group on this
    machine; returns what each rank returned, by rank. ``fn`` must be importable (a module-level
    function). A rank that raises makes this raise; one that waits for a dead peer gives up after
    ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="attnzero-ring-") as tmp:
        folder = Path(tmp)
        torch.save(job, folder / "job.pt")  # a file, not shared memory: works where /dev/shm is small
        mp.start_processes(_rank_main, args=(fn, world, str(folder), timeout_s), nprocs=world, start_method="spawn")
        return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _rank_main(rank: int, fn: RankFn, world: int, folder: str, timeout_s: float) -> None:
    """One process of ``launch``: join the group (a file on disk is the meeting point, so no port
    can be taken), run ``fn``, save its result."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on 127.0.0.1, whatever the hostname says
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the machine's cores
    store = Path(folder) / "store"
    dist.init_process_group(
        "gloo", init_method=store.as_uri(), rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        result = fn(rank, world, torch.load(Path(folder) / "job.pt", weights_only=False))
        torch.save(result, Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# What each rank runs


def ring_rank(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One rank: for each layout, cut the whole-sequence q, k, v (B, H, N, D) into this rank's slice
    (B, H, L, D), run the ring forward and backward with the recorder on, and put the slices of the
    output and gradients back together (rank 0 keeps them). Then time the ring forward."""
    q_all, k_all, v_all, dout_all = job["q"], job["k"], job["v"], job["dout"]  # (B, H, N, D) each
    result: dict[str, Any] = {"rank": rank}
    for layout in LAYOUTS:
        q, k, v = (shard(t, layout).clone().requires_grad_() for t in (q_all, k_all, v_all))  # (B, H, L, D)
        with trace.recording() as rec:
            out = ring_attention(q, k, v, causal=True, layout=layout)  # (B, H, L, D): this rank's rows
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), shard(dout_all, layout))  # the second trip
        whole = [gather(t.detach(), layout) for t in (out, dq, dk, dv)]  # (B, H, N, D) each, every rank
        result[layout] = {
            "steps": [dict(e.fields) for e in rec.of("ring.step")],  # plain dicts: they cross processes
            "tensors": whole if rank == 0 else None,
        }
    # The time of one causal ring forward at a fixed shape, nothing recording; each call starts
    # together on every rank (a barrier), so a rank's time is the ring's time.
    qt, kt, vt = job["timed"]  # (B, H, N, D) float32
    result["time"] = {}
    for layout in LAYOUTS:
        q, k, v = (shard(t, layout) for t in (qt, kt, vt))

        def call(q: Tensor = q, k: Tensor = k, v: Tensor = v, layout: Layout = layout) -> Tensor:
            dist.barrier()
            return ring_attention(q, k, v, causal=True, layout=layout)

        result["time"][layout] = median_time(call, repeats=job["repeats"])
    return result


# ---------------------------------------------------------------------------------------------
# Reading the record


def positions(at: list[int], chunk: int, start: int, stop: int) -> Tensor:
    """Global positions of the local indices ``start .. stop-1`` of a slice made of chunks of
    ``chunk`` positions starting at the global positions ``at`` (a "ring.step" event's ``q_at`` or
    ``kv_at``)."""
    i = torch.arange(start, stop)
    return torch.tensor(at)[i // chunk] + i % chunk


def pairs(kind: str, rows: int, cols: int) -> int:
    """(query, key) pairs a block computes: all of them (full), or those with key ≤ query counted
    from the block's corner (diagonal: the block's own causal)."""
    if kind == "full":
        return rows * cols
    return sum(min(i + 1, cols) for i in range(rows))


def work(steps: list[dict[str, Any]]) -> dict[str, int]:
    """One rank's work in one pass, from its "ring.step" events: pairs and backend calls of each
    kind, and the steps whose whole block was skipped."""
    w = {"full": 0, "diagonal": 0, "calls full": 0, "calls diagonal": 0, "skipped steps": 0}
    for ev in steps:
        if not ev["blocks"]:
            w["skipped steps"] += 1
        for r0, r1, c0, c1, kind in ev["blocks"]:
            w[kind] += pairs(kind, r1 - r0, c1 - c0)
            w[f"calls {kind}"] += 1
    return w


def coverage(steps: list[dict[str, Any]], n: int) -> Tensor:
    """(N, N) map of the global score matrix from the events of one pass: at (i, j) the rank that
    computed query i against key j, -1 where none did (and -2 where two did: never, if the ring is
    right)."""
    who = torch.full((n, n), -1, dtype=torch.long)
    for ev in steps:
        for r0, r1, c0, c1, kind in ev["blocks"]:
            rows = positions(ev["q_at"], ev["chunk"], r0, r1)  # (r,)
            cols = positions(ev["kv_at"], ev["chunk"], c0, c1)  # (c,)
            keep = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool)
            if kind == "diagonal":
                keep = keep.tril()  # key j ≤ query i inside the block
            block = who[rows[:, None], cols[None, :]]  # (r, c), a copy
            taken = keep & (block != -1)
            block = torch.where(keep, torch.full_like(block, ev["rank"]), block)
            block[taken] = -2
            who[rows[:, None], cols[None, :]] = block
    return who


# ---------------------------------------------------------------------------------------------
# Pictures


_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple")


def _draw_ring(path: Path, records: dict[Layout, list[dict[str, Any]]], n: int) -> None:
    """Per layout (row) and step (column): the global score matrix, each rank's computed pairs in
    its colour; the title says which rank holds whose keys/values."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    world = records[LAYOUTS[0]][0]["world"]
    cmap = ListedColormap(["white", *_COLORS[:world]])
    with figure(path, size=(3.3 * world, 3.4 * len(LAYOUTS)), nrows=len(LAYOUTS), ncols=world) as (_, axes):
        for row, layout in enumerate(LAYOUTS):
            forward = [ev for ev in records[layout] if ev["pass_"] == "forward"]
            for step in range(world):
                at_step = sorted((ev for ev in forward if ev["step"] == step), key=lambda ev: ev["rank"])
                who = coverage(at_step, n)  # (N, N): rank, or -1
                ax = axes[row, step]
                ax.imshow(np.asarray(who + 1), cmap=cmap, vmin=0, vmax=world, interpolation="nearest")
                chunk = at_step[0]["chunk"]
                for x in range(chunk, n, chunk):  # the chunk grid of this layout
                    ax.axhline(x - 0.5, color="0.8", lw=0.5)
                    ax.axvline(x - 0.5, color="0.8", lw=0.5)
                holds = ", ".join(f"r{ev['rank']}←K/V r{ev['src']}" for ev in at_step)
                ax.set_title(f"{layout}, step {step}\n{holds}", fontsize=9)
                ax.set_xlabel("key position", fontsize=8)
                ax.set_ylabel("query position", fontsize=8)
                ax.tick_params(labelsize=7)
        handles = [Patch(color=_COLORS[r], label=f"computed by rank {r}") for r in range(world)]
        axes[0, 0].legend(handles=handles, loc="upper right", fontsize=7)


def _draw_balance(path: Path, per_rank: dict[Layout, list[dict[str, int]]]) -> None:
    """Per layout: each rank's forward work from the record, (query, key) pairs in full and
    diagonal blocks, stacked; the skipped steps written on top."""
    world = len(per_rank[LAYOUTS[0]])
    top = max(w["full"] + w["diagonal"] for ws in per_rank.values() for w in ws)
    with figure(path, size=(3.4 * len(LAYOUTS), 3.4), ncols=len(LAYOUTS)) as (_, axes):
        for col, layout in enumerate(LAYOUTS):
            ax = axes[0, col]
            ranks = list(range(world))
            full = [per_rank[layout][r]["full"] for r in ranks]
            diag = [per_rank[layout][r]["diagonal"] for r in ranks]
            ax.bar(ranks, full, color="tab:blue", label="full blocks")
            ax.bar(ranks, diag, bottom=full, color="tab:orange", label="diagonal blocks")
            for r in ranks:
                skipped = per_rank[layout][r]["skipped steps"]
                ax.text(r, full[r] + diag[r] + 0.02 * top, f"{full[r] + diag[r]}\nskipped steps: {skipped}",
                        ha="center", va="bottom", fontsize=8)  # fmt: skip
            ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
            ax.set_ylim(0, 1.3 * top)
            ax.set_title(f"{layout}: work per rank (forward)", fontsize=9)
            ax.set_ylabel("(query, key) pairs computed", fontsize=8)
            ax.legend(fontsize=7, loc="upper left")


# ---------------------------------------------------------------------------------------------
# The rung


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    # 1. one causal problem in float64, the whole sequence (N = W·L positions)
    B, H, N, D = (1, 2, 32, 8) if small else (1, 2, 256, 16)
    Bt, Ht, Nt, Dt = (1, 2, 256, 32) if small else (1, 8, 4096, 64)  # the timed shape, float32
    g = torch.Generator().manual_seed(9)
    q, k, v, dout = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(4))
    timed = [torch.randn(Bt, Ht, Nt, Dt, generator=g) for _ in range(3)]
    say(f"{WORLD} processes (gloo on this machine), causal, (B, H, N, D) = {(B, H, N, D)} float64, "
        f"{N // WORLD} positions per rank")  # fmt: skip
    ranks = launch(ring_rank, {"q": q, "k": k, "v": v, "dout": dout, "timed": timed, "repeats": 3 if small else 5})

    # 2. rung 5's single-process flash on the whole sequence, forward and backward
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = attention(*leaves, causal=True, backend="flash")  # (B, H, N, D)
    assert isinstance(want_out, Tensor)
    want = [want_out.detach(), *torch.autograd.grad(want_out, leaves, dout)]

    # 3. what each rank did, from its record
    records = {lay: [ev for res in ranks for ev in res[lay]["steps"]] for lay in LAYOUTS}
    per_rank = {lay: [work([ev for ev in res[lay]["steps"] if ev["pass_"] == "forward"]) for res in ranks]
                for lay in LAYOUTS}  # fmt: skip
    errors: dict[str, float] = {}
    for layout in LAYOUTS:
        say(f"\n{layout}: query positions {_chunks_said(records[layout])}")
        for res in ranks:
            forward = sorted((ev for ev in res[layout]["steps"] if ev["pass_"] == "forward"), key=lambda e: e["step"])
            said = "; ".join(f"step {ev['step']}: K/V of r{ev['src']} " + (
                ", ".join(f"{kind} {r1 - r0}×{c1 - c0}" for r0, r1, c0, c1, kind in ev["blocks"]) or "skipped"
            ) for ev in forward)  # fmt: skip
            w = per_rank[layout][res["rank"]]
            say(f"  rank {res['rank']}: {said}  →  {w['full'] + w['diagonal']} pairs")
        got = ranks[0][layout]["tensors"]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            errors[f"{layout} {name}"] = max_error(a, b)
        said = ", ".join(f"{name} {errors[f'{layout} {name}']:.1e}" for name in ("out", "dq", "dk", "dv"))
        say(f"  ring vs single-process flash: {said}")
    totals = {lay: [w["full"] + w["diagonal"] for w in per_rank[lay]] for lay in LAYOUTS}
    ratios = ", ".join(f"{lay} {max(totals[lay]) / min(totals[lay]):.2f}" for lay in LAYOUTS)
    say(f"\nbusiest rank / least busy: {ratios} (the ring waits for its busiest rank)")

    # 4. time at a fixed shape: the ring (2 processes) vs one process with the flash backend
    t_ring = {lay: max(res["time"][lay] for res in ranks) for lay in LAYOUTS}
    t_flash = median_time(lambda: attention(*timed, causal=True, backend="flash"), repeats=3 if small else 5)
    cores = os.cpu_count() or 1
    say(f"\ntime of one causal forward at (B, H, N, D) = {(Bt, Ht, Nt, Dt)} float32, median:")
    rows = [(f"ring, {lay}, {WORLD} processes × {max(1, cores // WORLD)} thread(s)", t_ring[lay]) for lay in LAYOUTS]
    rows.append((f"one process, flash, {torch.get_num_threads()} thread(s)", t_flash))
    for label, seconds in rows:
        say(f"  {label + ':':<46}{seconds * 1e3:8.1f} ms")
    say(f"  (this machine has {cores} cores and the ranks share them: a ring is for a sequence too long for "
        "one device, not for speed on one machine)")  # fmt: skip

    pictures = []
    if out is not None:
        for name, draw in (("r9-ring.png", lambda p: _draw_ring(p, records, N)),
                           ("r9-balance.png", lambda p: _draw_balance(p, per_rank))):  # fmt: skip
            path = out / name
            draw(path)
            pictures.append(path)
    return Result(
        rung=9, title=TITLE,
        check="ring out, dq, dk, dv (2 processes, contiguous and zigzag) vs single-process flash (float64)",
        error=max(errors.values()), tol=1e-12, pictures=pictures,
        numbers={"errors": errors, "work": per_rank, "time_ring_s": t_ring, "time_flash_s": t_flash,
                 "shape": (Bt, Ht, Nt, Dt), "cores": cores},
    )  # fmt: skip


def _chunks_said(steps: list[dict[str, Any]]) -> str:
    """'r0: 0-15, r1: 16-31' from the events: the global positions of each rank's queries."""
    first = {ev["rank"]: ev for ev in steps if ev["step"] == 0 and ev["pass_"] == "forward"}
    parts = []
    for r, ev in sorted(first.items()):
        spans = [f"{a}-{a + ev['chunk'] - 1}" for a in ev["q_at"]]
        parts.append(f"r{r}: {' + '.join(spans)}")
    return ", ".join(parts)
