"""What every rung of the ladder shares: its result, the float64 check against the rung before, a
median timer, a peak-memory probe, and a figure helper (matplotlib, drawn off-screen)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..functional import attention


@dataclass
class Result:
    """What one rung ran and found.

    ``check`` names the comparison (this rung's result against the rung before, in float64),
    ``error`` is its max-abs difference and ``tol`` the bound it must stay under; ``numbers`` holds the
    rung's measurements at its fixed shape (times in seconds, memory in MB, counts);
    ``pictures`` the files it wrote; ``lines`` what it printed."""

    rung: int
    title: str
    check: str
    error: float
    tol: float
    numbers: dict[str, Any] = field(default_factory=dict)
    pictures: list[Path] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error <= self.tol  # NaN compares False: it never passes


class Printer:
    """Prints a rung's lines and keeps them for its ``Result`` (and for the docs)."""

    def __init__(self, quiet: bool = False) -> None:
        self.lines: list[str] = []
        self.quiet = quiet

    def __call__(self, text: str = "") -> None:
        for line in str(text).split("\n"):
            self.lines.append(line)
            if not self.quiet:
                print(line, flush=True)


def attend(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
    """``az.attention``'s output (without ``return_lse`` it is one tensor; ``backend=`` picks the
    code that runs)."""
    out = attention(q, k, v, **kw)
    assert isinstance(out, Tensor)
    return out


def max_error(a: Tensor, b: Tensor) -> float:
    """max |a - b| in float64; NaN or inf anywhere in either gives inf (never a pass)."""
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"compared tensors differ in shape: {tuple(a64.shape)} vs {tuple(b64.shape)}")
    if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
        return float("inf")
    return float((a64 - b64).abs().max()) if a64.numel() else 0.0


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pictures_available() -> bool:
    """True when matplotlib is installed (the rungs still run and check without it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def figure(path: Path, *, size: tuple[float, float] = (6.0, 4.0), ncols: int = 1, nrows: int = 1) -> Iterator[Any]:
    """A matplotlib figure saved to ``path`` (PNG) when the block ends; yields ``(fig, axes)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
