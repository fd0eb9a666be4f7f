"""What the CPU benchmark scripts share besides ``attnzero.bench.time_interleaved`` (the timing):
the competing load of ``--busy``, the line that says what a run was measured on, and the markdown
tables they print for docs/benchmarks.md."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from attnzero.bench import machine

BUSY = "busy: a competing process runs 2-thread float32 1024×1024 matmuls for the whole run"


def _burn(stop: Any, running: Any, parent: int) -> None:
    """The competing load: 2-thread float32 matmuls until told to stop or the parent is gone.
    Ctrl-C reaches the whole process group: the parent stops this process, so it ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(2)
    a, b, c = torch.randn(1024, 1024), torch.randn(1024, 1024), torch.empty(1024, 1024)
    torch.mm(a, b, out=c)
    running.set()
    while not stop.is_set() and os.getppid() == parent:
        torch.mm(a, b, out=c)


def _end(proc: Any, stop: Any) -> None:
    stop.set()
    proc.join(timeout=5)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join()


@contextmanager
def busy_load(on: bool = True) -> Iterator[None]:
    """With ``on``, a spawned process keeps two cores busy with float32 matmuls while the block
    runs; it is stopped when the block ends however it ends (an exception, Ctrl-C, SIGTERM, which
    is turned into SystemExit here), and it stops by itself if this process dies."""
    if not on:
        yield
        return
    ctx = mp.get_context("spawn")
    stop, running = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_burn, args=(stop, running, os.getpid()), daemon=True, name="busy-load")
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None

    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    if main:
        signal.signal(signal.SIGTERM, terminated)
    proc.start()
    try:
        if not running.wait(timeout=120):
            raise RuntimeError("--busy: the competing matmul process did not start within 120 s")
        yield
    finally:
        _end(proc, stop)
        if main:
            signal.signal(signal.SIGTERM, before)


def describe(busy: bool) -> str:
    """One line: the machine, torch's threads and whether a competing load ran."""
    m = machine()
    return f"{m['date']} · {m['cpu']} · {m['cores']} · torch {m['torch']} · " + (BUSY if busy else "quiet")


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> Iterator[str]:
    """A markdown table, line by line (rows may be computed lazily: each line comes when ready)."""
    yield "| " + " | ".join(header) + " |"
    yield "|" + "|".join("---" for _ in header) + "|"
    for row in rows:
        yield "| " + " | ".join(row) + " |"


def ms(seconds: float) -> str:
    """Milliseconds, with more decimals for the shorter calls."""
    digits = 3 if seconds < 1e-3 else 2 if seconds < 0.1 else 1
    return f"{seconds * 1e3:.{digits}f}"
