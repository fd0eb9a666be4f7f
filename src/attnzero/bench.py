"""The benchmark: time and peak memory of attention implementations, side by side.

Run by ``attnzero bench`` (:func:`main`; ``benchmarks/bench.py`` runs the same). Implementations:
our backends (``flash``, ``reference``), torch's fused ``scaled_dot_product_attention``
(``torch``), and ``naive`` — the seeds' formula, ``softmax(masked_fill(Q Kᵀ / √d)) V``.

* Time: every implementation of one case runs in the same loop, interleaved (ours, torch, ours,
  torch, …), so that load from elsewhere on the machine hits all of them alike; the median of the
  repeats is reported, and the ratio to torch is taken from those medians.
* FLOPs (docs/MATH.md): forward ``4·B·H·Lq·Lk·D`` (Dv = D), ×0.5 when causal, ×3.5 forward+backward.
* Memory: the extra peak resident memory of one call beyond its inputs, measured in a fresh
  subprocess (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs`` after a
  warm-up), so nothing else in the process can hide or add to it. Linux only; None elsewhere.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .functional import attention

IMPLS = ("flash", "reference", "torch", "naive")


def naive(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """The seeds' formula, materialised in one go (what the issue calls the naive seed code)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, L)
    if causal:
        L = q.shape[-2]
        keep = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(keep == 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (B, H, L, Dv)


def call(impl: str, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """One attention call of ``impl`` (a backend name, "torch" or "naive")."""
    if impl == "torch":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if impl == "naive":
        return naive(q, k, v, causal)
    out = attention(q, k, v, causal=causal, backend=impl)  # type: ignore[arg-type]
    assert isinstance(out, Tensor)
    return out


def flops(B: int, H: int, L: int, D: int, causal: bool, backward: bool) -> float:
    """4·B·H·L·L·D, ×0.5 causal, ×3.5 forward+backward (docs/MATH.md)."""
    f = 4.0 * B * H * L * L * D
    return f * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)


def score_bytes(impl: str, B: int, H: int, L: int, backward: bool) -> int:
    """The L×L float32 memory an implementation that materialises the scores needs (0 otherwise):
    scores and probabilities, plus their gradients when training."""
    if impl not in ("naive", "reference"):
        return 0
    return B * H * L * L * 4 * (4 if backward else 2)


@dataclass
class Case:
    impl: str
    L: int
    causal: bool
    backward: bool
    B: int = 1
    H: int = 8
    D: int = 64
    dtype: str = "float32"


def _inputs(case: Case) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    dt = getattr(torch, case.dtype)
    g = case.backward
    q, k, v = (torch.randn(case.B, case.H, case.L, case.D, dtype=dt, requires_grad=g) for _ in range(3))
    dout = torch.randn(case.B, case.H, case.L, case.D, dtype=dt) if g else None
    return q, k, v, dout


def runner(case: Case) -> Callable[[], None]:
    """A no-argument function running the case once (forward, or forward + backward)."""
    q, k, v, dout = _inputs(case)

    def run() -> None:
        if case.backward:
            q.grad = k.grad = v.grad = None
            call(case.impl, q, k, v, case.causal).backward(dout)
        else:
            with torch.no_grad():
                call(case.impl, q, k, v, case.causal)

    return run


def interleaved_samples(
    runs: dict[str, Callable[[], None]],
    repeats: int,
    *,
    warmups: int = 1,
    min_sample_s: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
    rotate: bool = False,
) -> dict[str, list[float]]:
    """Seconds per call of each run, one sample per repeat, the runs interleaved repeat by repeat
    (ours, torch, ours, …) after ``warmups`` calls of each: sample r of every run comes from the same
    round. With ``min_sample_s`` a sample is as many calls as take at least that long (measured once
    after the warm-up), so that a call of microseconds is not timed alone; ``clock`` may be
    ``time.process_time`` (CPU time) instead of wall time. With ``rotate`` each repeat starts one run
    later (a, b, c; b, c, a; …), so that no run always follows the same one — for runs that leave
    state behind (the heap, the caches) that the next one pays."""
    for _ in range(warmups):
        for fn in runs.values():
            fn()
    calls = dict.fromkeys(runs, 1)
    if min_sample_s > 0:
        for name, fn in runs.items():
            t0 = clock()
            fn()
            calls[name] = max(1, int(min_sample_s / max(clock() - t0, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(repeats):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            fn, n = runs[name], calls[name]
            t0 = clock()
            for _ in range(n):
                fn()
            times[name].append((clock() - t0) / n)
    return times


def time_interleaved(runs: dict[str, Callable[[], None]], repeats: int, **options: Any) -> dict[str, float]:
    """Median seconds per call of each run over ``interleaved_samples(runs, repeats, **options)``."""
    return {name: statistics.median(ts) for name, ts in interleaved_samples(runs, repeats, **options).items()}


# ---------------------------------------------------------------------------------------------
# Memory


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert m is not None, f"{field} missing from /proc/self/status"
    return int(m.group(1)) / 1024.0


def extra_peak_mb(fn: Callable[[], Any], warmup: Callable[[], Any] | None = None) -> float:
    """Peak resident memory during ``fn()`` above what was resident before it, in MB (Linux).
    Call in a fresh process: the allocator of a long-lived one may hide reused memory."""
    if warmup is not None:
        warmup()  # load the kernels' code and the thread pool before measuring
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _status_mb("VmRSS")
    fn()
    return _status_mb("VmHWM") - before


def _child(spec: dict[str, Any]) -> float:
    """Run in the subprocess: the extra peak of one case (inputs allocated before measuring)."""
    torch.manual_seed(0)
    case = Case(**spec)
    small = Case(**{**spec, "L": min(spec["L"], 1024)})  # big enough to start every code path
    return extra_peak_mb(runner(case), warmup=runner(small))


def peak_memory_mb(case: Case, timeout: float = 600.0) -> float | None:
    """Extra peak memory of one call of ``case``, measured in a fresh Python process; None when
    /proc is not there (not Linux)."""
    try:
        with open("/proc/self/clear_refs", "w"):
            pass
    except OSError:
        return None
    code = "import json, sys; from attnzero.bench import _child; print(_child(json.loads(sys.argv[1])))"
    res = subprocess.run(
        [sys.executable, "-c", code, json.dumps(asdict(case))],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(f"memory measurement of {case} failed:\n{res.stderr[-2000:]}")
    return float(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# A whole sweep


@dataclass
class Row:
    impl: str
    L: int
    mode: str  # "fwd" or "fwd+bwd"
    mask: str  # "full" or "causal"
    seconds: float | None
    gflops: float | None
    vs_torch: float | None  # our throughput / torch's, same run
    peak_mb: float | None
    note: str = ""


def sweep(
    lengths: Sequence[int],
    impls: Sequence[str] = IMPLS,
    *,
    modes: Sequence[bool] = (False, True),
    masks: Sequence[bool] = (False, True),
    repeats: int = 5,
    memory: bool = True,
    max_bytes: float = 8e9,
    B: int = 1,
    H: int = 8,
    D: int = 64,
    log: Callable[[str], None] | None = None,
) -> list[Row]:
    """Time (and measure the memory of) every implementation over ``lengths`` × forward /
    forward+backward × full / causal, the memory on the first of ``masks`` only. Implementations that
    would need more than ``max_bytes`` for the L×L scores are skipped with a note."""
    rows: list[Row] = []
    for L in lengths:
        for backward in modes:
            for causal in masks:
                mode, mask = ("fwd+bwd" if backward else "fwd"), ("causal" if causal else "full")
                todo: list[str] = []
                skipped: list[str] = []
                for impl in impls:
                    need = score_bytes(impl, B, H, L, backward)
                    (skipped if need > max_bytes else todo).append(impl)
                runs = {impl: runner(Case(impl, L, causal, backward, B, H, D)) for impl in todo}
                secs = time_interleaved(runs, repeats)
                del runs
                fl = flops(B, H, L, D, causal, backward)
                for impl in impls:
                    if impl in skipped:
                        gb = score_bytes(impl, B, H, L, backward) / 1e9
                        rows.append(Row(impl, L, mode, mask, None, None, None, None, f"skipped: needs ~{gb:.0f} GB"))
                        continue
                    s = secs[impl]
                    ratio = secs["torch"] / s if "torch" in secs and impl != "torch" else None
                    measured = memory and causal == masks[0]  # on the first mask asked for (full, by default)
                    mem = peak_memory_mb(Case(impl, L, causal, backward, B, H, D)) if measured else None
                    rows.append(Row(impl, L, mode, mask, s, fl / s / 1e9, ratio, mem))
                    if log is not None:
                        r = rows[-1]
                        log(
                            f"L={L:6d} {mode:7s} {mask:6s} {impl:9s} {s * 1e3:9.1f} ms {r.gflops:7.1f} GFLOP/s"
                            + (f"  ×{ratio:.3f} of torch" if ratio is not None else "")
                            + (f"  peak +{mem:.0f} MB" if mem is not None else "")
                        )
    return rows


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    model = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        m = re.search(r"^Model name:\s+(.+)$", out, re.MULTILINE)
        model = m.group(1).strip() if m else model
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


# ---------------------------------------------------------------------------------------------
# The command: ``attnzero bench`` (and ``benchmarks/bench.py``, which runs it)

QUICK_LENGTHS = (512, 1024, 2048, 4096)
FULL_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def main(
    *,
    full: bool = False,
    lengths: Sequence[int] | None = None,
    impls: Sequence[str] | None = None,
    repeats: int | None = None,
    fwd_only: bool = False,
    causal_only: bool = False,
    no_memory: bool = False,
    out: str | Path = "out/bench",
) -> int:
    """Run :func:`sweep` with a progress bar; print a table, write bench.json and bench.png under
    ``out``. Default: L = 512 … 4096, 3 repeats, no memory; ``full``: L = 512 … 16384, 5 repeats
    and the peak memory (unless ``no_memory``). Exit status 2 when matplotlib or rich is missing
    or an implementation is unknown, else 0."""
    from .extras import need

    if not need("bench", ("matplotlib", "rich")):
        return 2
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from . import viz

    chosen = list(impls or IMPLS)
    unknown = [i for i in chosen if i not in IMPLS]
    if unknown:
        print(f"attnzero bench: --impls: expected some of {', '.join(IMPLS)}, got {', '.join(unknown)}",
              file=sys.stderr)
        return 2
    lengths = list(lengths or (FULL_LENGTHS if full else QUICK_LENGTHS))
    modes = [False] if fwd_only else [False, True]
    masks = [True] if causal_only else [False, True]
    repeats = repeats or (5 if full else 3)
    console = Console(width=max(Console().width, 110))
    info = machine()
    console.print(f"{info['cpu']}, {info['cores']}, torch {info['torch']}")
    total = len(lengths) * len(modes) * len(masks) * len(chosen)
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        task = progress.add_task("timing", total=total)

        def log(line: str) -> None:
            progress.update(task, advance=1, description=" ".join(line.split()[:4]))

        rows = sweep(lengths, chosen, modes=modes, masks=masks, repeats=repeats,
                     memory=full and not no_memory, log=log)
        progress.update(task, completed=total, description="done")

    table = Table(title="attention: time per call (median of the repeats), throughput, memory", header_style="bold")
    for name, justify in (("L", "right"), ("pass", "left"), ("mask", "left"), ("impl", "left"), ("ms", "right"),
                          ("GFLOP/s", "right"), ("× torch", "right"), ("peak extra MB", "right"), ("note", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(
            str(r.L), r.mode, r.mask, r.impl,
            "–" if r.seconds is None else f"{r.seconds * 1e3:.1f}",
            "–" if r.gflops is None else f"{r.gflops:.1f}",
            "" if r.vs_torch is None else f"{r.vs_torch:.2f}",
            "" if r.peak_mb is None else f"{r.peak_mb:.0f}",
            r.note,
        )
    console.print(table)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.json").write_text(json.dumps({"machine": info, "rows": [asdict(r) for r in rows]}, indent=1))
    viz.save_bench_png(rows, folder / "bench.png")
    console.print("× torch = torch's time / ours (above 1: faster than torch).")
    console.print(f"Files:\n  {(folder / 'bench.json').resolve()}\n  {(folder / 'bench.png').resolve()}")
    return 0
