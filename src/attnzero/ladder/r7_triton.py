"""Rung 7 — the Triton kernel (``kernels/forward.py``), run on the CPU by Triton's interpreter.

The kernel is rung 5's tiled loop written for a GPU: one *program* per (block of query rows, batch,
head), each walking the key blocks its rows can see with the online softmax of rung 4. Without a GPU,
``TRITON_INTERPRET=1`` makes Triton run every program in Python on CPU tensors — slow, but the same
kernel source. While an ``attnzero.trace`` recording is open the launcher runs the kernel with its
``TRACE`` flag on: each program writes into an int32 tensor which key blocks it visited, and the
launcher turns that tensor into one "triton.program" event per program. The picture is drawn from
those events; the tile counts are compared with the flash backend's block counter (rung 5).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

import attnzero as az

from .. import flash, geometry, testing, trace
from .common import Printer, Result, attend, figure, median_time

TITLE = "The Triton kernel under TRITON_INTERPRET=1: the same tiles, program ids drawn"

RERUN = "rerun"  # triton_backend(): the kernels were built for a GPU this machine lacks


def triton_backend() -> tuple[ModuleType | None, str]:
    """``(attnzero.kernels.triton_backend, "")`` ready to run here, or ``(None, why not)``.

    Triton decides at import whether its kernels are compiled (GPU) or interpreted (CPU, under
    ``TRITON_INTERPRET=1``). Without CUDA the variable is set here, before the kernels are first
    imported. If they — or Triton's own ``@triton.jit`` library (``tl.cdiv``, imported with
    ``torch._dynamo`` by whatever loaded it first) — were already imported compiled on a machine
    without a GPU, they cannot be switched in this process: the answer is ``(None, RERUN)`` (the
    rung reruns itself in a fresh interpreter, ``rerun_interpreted``)."""
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from ..kernels import triton_backend as tb
    except ImportError as e:
        return None, f"the Triton rungs need the `triton` package (pip install triton): {e}"
    import triton.language as tl

    library = type(getattr(tl, "cdiv", None)).__name__ in ("InterpretedFunction", "function", "NoneType")
    if not cuda and not (tb.interpreting() and library):
        return None, RERUN
    return tb, ""


def rerun_interpreted(n: int, title: str, out: Path | None, small: bool, say: Printer) -> Result:
    """Run rung ``n`` in a new Python process with ``TRITON_INTERPRET=1`` (this one imported the
    kernels compiled, without a GPU to run them), print its lines here and return its result."""
    say("(the Triton kernels were imported compiled and there is no GPU: rerunning this rung in a new")
    say(" process with TRITON_INTERPRET=1)")
    src = str(Path(az.__file__).resolve().parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "result.pickle"
        folder = "None" if out is None else f"Path({str(out)!r})"
        code = (
            "import pickle\nfrom pathlib import Path\nfrom attnzero import ladder\n"
            f"r = ladder.run({n}, {folder}, small={small}, quiet=True)\n"
            f"Path({str(saved)!r}).write_bytes(pickle.dumps(r))\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not saved.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            say("the rerun failed: " + " | ".join(tail))
            return Result(rung=n, title=title, check="not run (the interpreted rerun failed)", error=float("nan"),
                          tol=0.0)
        result: Result = pickle.loads(saved.read_bytes())
    for line in result.lines[1:-1]:  # without the runner's header and check line (ours print them)
        say(line)
    result.lines = []
    return result


def not_run(n: int, title: str, why: str, say: Printer) -> Result:
    """The result of a Triton rung that cannot run here: it says why and does not pass."""
    say(why)
    return Result(rung=n, title=title, check=f"not run ({why})", error=float("nan"), tol=0.0)


# ---------------------------------------------------------------------------------------------
# The rung


def programs_of(events: list[trace.Event], head: int = 0, batch: int = 0) -> dict[tuple[int, int], tuple[int, bool]]:
    """From the kernel's own record: ``(query block, key block) -> (program id, masked)`` for the
    tiles visited by the programs of one (batch, head)."""
    tiles = {}
    for ev in events:
        if ev["head"] == head and ev["batch"] == batch:
            for nb, masked in zip(ev["key_blocks"], ev["masked"]):
                tiles[(ev["q_block"], nb)] = (ev["pid"], masked)
    return tiles


def flash_tiles(q: Tensor, k: Tensor, v: Tensor, block: tuple[int, int], **kw: Any) -> tuple[Tensor, int]:
    """Rung 5: the flash backend on the same problem with the kernel's tile sizes; its output and
    how many tiles its block counter saw (``flash.COUNTS["forward"]``, one per (chunk, row block, key
    block): one chunk when B = Hkv = 1)."""
    with flash.block_sizes(rows=block[0], cols=block[1]):
        before = flash.COUNTS["forward"]
        out = attend(q, k, v, backend="flash", **kw)
        return out, flash.COUNTS["forward"] - before


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    tb, why = triton_backend()
    if tb is None:
        return rerun_interpreted(7, TITLE, out, small, say) if why == RERUN else not_run(7, TITLE, why, say)
    where = "compiled, on the GPU" if torch.cuda.is_available() else "Triton's interpreter on the CPU"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    B, Hq, Hkv, L, D = (1, 2, 1, 48, 16) if small else (1, 2, 1, 96, 32)
    say(f"the kernel: forward.fwd_kernel, run by {where}")
    say(f"q (B={B}, Hq={Hq}, Lq={L}, D={D}), k, v (B={B}, Hkv={Hkv}, Lk={L}, D={D}), float32; GQA: G = {Hq // Hkv}")
    gen = torch.Generator().manual_seed(7)
    q64, k64, v64 = (torch.randn(B, h, L, D, generator=gen, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    q, k, v = (t.to(torch.float32).to(device) for t in (q64, k64, v64))  # what the kernel reads
    qr, kr, vr = (t.to(torch.float64).cpu() for t in (q, k, v))  # the same values in float64

    cases: list[tuple[str, dict[str, Any]]] = [
        ("causal", {"causal": True}),
        ("window 16", {"causal": True, "window": (16, 0)}),  # a sliding window: keys p - 16 <= j <= p
    ]
    errors, bounds, panels = [], [], []
    numbers: dict[str, Any] = {}
    for name, kw in cases:
        with trace.recording() as rec:
            got = attend(q, k, v, backend="triton", **kw)  # the kernel: float32, under the trace
        events = rec.of("triton.program")
        bm, bn = events[0]["block_m"], events[0]["block_n"]
        golden, flash_count = flash_tiles(qr, kr, vr, (bm, bn), **kw)  # rung 5, float64
        ref32 = attend(q.cpu(), k.cpu(), v.cpu(), backend="reference", **kw)
        verdict = testing.verdict(got.cpu(), ref32, golden)  # DESIGN.md's rule: float32 vs float64
        bounds.append(verdict.bound)

        tiles = programs_of(events)
        n_m, n_n = -(-L // bm), -(-L // bn)
        edge = sum(m for _, m in tiles.values())
        # what geometry (the rule every backend reads) says of each tile, beside what the kernel did
        should = {(i, j) for i in range(n_m) for j in range(n_n)
                  if geometry.classify((i * bm, min(L, (i + 1) * bm)), (j * bn, min(L, (j + 1) * bn)), L, L,
                                       kw.get("causal", False), kw.get("window")) is not geometry.SKIP}
        say(f"\n{name}: {len(events)} programs ({n_m} query blocks × {B * Hq} heads), tiles {bm}×{bn}")
        say(f"  per head the kernel visited {len(tiles)} of {n_m * n_n} tiles ({edge} with range checks), "
            f"skipped {n_m * n_n - len(tiles)}")
        say(f"  flash (rung 5), same tile sizes: {flash_count} tiles (its block counter)")
        same = set(tiles) == should
        say(f"  the visited tiles are those geometry.classify does not skip: {same}")
        # the record must be the schedule the rule gives, or the picture lies: a mismatch fails the rung
        errors.append(verdict.error if same else float("inf"))
        say(f"  max |triton - flash| = {verdict.error:.2e} (float32 kernel vs float64 flash; "
            f"bound {verdict.bound:.1e})")
        key = name.split()[0]
        numbers.update({f"{key}_programs": len(events), f"{key}_tiles": len(tiles), f"{key}_edge_tiles": edge,
                        f"{key}_flash_tiles": flash_count, f"{key}_error": verdict.error})
        panels.append((name, tiles, n_m, n_n, len(events)))

    fn_t = lambda: attend(q, k, v, backend="triton", causal=True)  # noqa: E731
    fn_f = lambda: attend(q.cpu(), k.cpu(), v.cpu(), backend="flash", causal=True)  # noqa: E731
    t_triton = median_time(fn_t, repeats=3, warmup=1)
    t_flash = median_time(fn_f, repeats=5, warmup=1)
    say(f"\ntime, causal, this shape: triton {t_triton * 1e3:.1f} ms ({where}), flash {t_flash * 1e3:.2f} ms "
        "(PyTorch on the CPU)")
    if not torch.cuda.is_available():
        say("  (the interpreter runs each program in Python: it shows what the kernel does, not how fast)")
    numbers.update({"time_triton_s": t_triton, "time_flash_s": t_flash})

    pictures = []
    if out is not None:
        pictures.append(_draw(out / "r7-programs.png", panels))
    return Result(rung=7, title=TITLE, check="triton kernel (float32) vs flash, rung 5 (float64)",
                  error=max(errors), tol=min(bounds), numbers=numbers, pictures=pictures)


def _draw(path: Path, panels: list[tuple[str, dict[tuple[int, int], tuple[int, bool]], int, int, int]]) -> Path:
    """The (query block × key block) grid of head 0, each visited tile colored by the program that
    visited it (from the kernel's record); white: skipped; hatched: visited with range checks."""
    import matplotlib.pyplot as plt

    with figure(path, size=(5.0 * len(panels), 4.6), ncols=len(panels)) as (fig, axes):
        cmap = plt.get_cmap("tab10")
        for ax, (name, tiles, n_m, n_n, programs) in zip(axes[0], panels):
            for (i, j), (pid, masked) in tiles.items():
                ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=cmap(pid % 10), edgecolor="black",
                                           hatch="///" if masked else None, linewidth=0.6))
                ax.text(j + 0.5, i + 0.5, str(pid), ha="center", va="center", fontsize=8,
                        bbox={"facecolor": "white", "alpha": 0.7, "pad": 1, "linewidth": 0})
            ax.set_xlim(0, n_n)
            ax.set_ylim(n_m, 0)
            ax.set_aspect("equal")
            ax.set_xticks(range(n_n + 1))
            ax.set_yticks(range(n_m + 1))
            ax.grid(True, color="0.85", linewidth=0.5)
            ax.set_xlabel("key block")
            ax.set_ylabel("query block")
            ax.set_title(f"{name}: {len(tiles)} of {n_m * n_n} tiles visited\n"
                         f"(head 0; number = program id, {programs} programs in all)", fontsize=9)
        fig.suptitle("fwd_kernel's programs (hatched: edge tile, with range checks)", fontsize=10)
    return path
