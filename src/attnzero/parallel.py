"""The CPU runtime of the flash backend: worker threads, the queue that hands them tasks, and
the scratch memory each one reuses. Nothing here knows about attention: a task is any item, and
``run_tasks(items, fn, scratch, threads, split)`` calls ``fn(item, scratch, own)`` for each.

Why threads of our own: torch's intra-op threads split every single op — a dozen per block of
attention — and wait for all threads at the end of each; when another process holds a core, each
of those waits can cost a scheduler time slice. Here each worker runs whole tasks with
single-threaded ops, and the threads meet once per call.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

# Counters read by tests: of the worker threads' tasks, those split in two near the end ("split")
# and those a thread took from a group another one owns ("help"; see ``Queue``).
COUNTS: dict[str, int] = {"split": 0, "help": 0}
_LOCK = threading.Lock()


def _count(key: str) -> None:
    with _LOCK:
        COUNTS[key] += 1


_SCRATCH = threading.local()  # each thread's kept arenas, by (dtype, device) (see ``arena``)


class Arena:
    """One worker's scratch memory: named buffers reused by every block it computes, so that no
    block allocates its large tensors or touches fresh pages (a fresh large allocation costs page
    faults, about as much as a pass over it)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.bufs: dict[str, Tensor] = {}

    def get(self, name: str, *shape: int) -> Tensor:
        """A tensor of ``shape`` (contents undefined) in the buffer ``name``."""
        n = math.prod(shape)
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < n:
            # a normal tensor even under inference_mode: a kept buffer made there could not be
            # written in place by a later call outside it
            with torch.inference_mode(False):
                buf = self.bufs[name] = torch.empty(n, dtype=self.dtype, device=self.device)
        return buf[:n].view(shape)


def arena(dtype: torch.dtype, device: torch.device) -> Arena:
    """A worker's scratch memory. On CPU it is the calling thread's own and is kept between calls:
    a fresh one would fault its pages in again (same-run A/B, benchmarks/runtime_ab.py: nanoGPT
    training 4–18% slower with fresh scratch, with dropout 3–10%; within noise at the longer
    shapes).
    It holds about three score blocks and a few row blocks of the largest problem the thread has
    run (~10–40 MB in float32); elsewhere a new one (the device's caching allocator reuses
    memory)."""
    if device.type != "cpu":
        return Arena(dtype, device)
    arenas: dict[torch.dtype, Arena] = _SCRATCH.__dict__.setdefault("arenas", {})
    if dtype not in arenas:
        arenas[dtype] = Arena(dtype, device)
    return arenas[dtype]


def run_tasks(
    items: list[tuple[int, Any]],
    fn: Callable[[Any, T, bool], None],
    scratch: Callable[[], T],
    threads: int,
    split: Callable[[Any], tuple[Any, Any] | None],
) -> list[T]:
    """``fn(item, scratch, own)`` for every ``(group, item)`` of ``items`` (costliest first), on
    ``threads`` Python threads that each take the next item when done with one (so a busy core
    slows only its own share) and own one ``scratch()``; returns the scratches. Items of one group
    may add into the same memory: ``own`` tells whether this worker owns the item's group and may
    add there directly, or must add into memory of its own (see ``Queue``), which also says how
    ``split`` halves the last items. On one thread every item is owned and none is split.

    While the workers run, torch is set to 1 intra-op thread (a process-wide setting, restored
    afterwards); so only one call at a time takes the threads, and a call made meanwhile from
    another thread runs the workers' shares one after the other on its own thread. Under
    ``torch.use_deterministic_algorithms(True)`` the shares are a fixed plan (``Queue.plan``)."""
    if threads <= 1 or len(items) <= 1:
        st = scratch()
        for _, item in items:
            fn(item, st, True)
        return [st]
    workers = min(threads, len(items))
    queue = Queue(items, workers, split)
    take: Callable[[int], tuple[Any, bool] | None] = queue.take
    if torch.are_deterministic_algorithms_enabled():
        # A fixed schedule (who computes what, who owns what), the same on every run: the sums
        # into dK / dV then happen in the same order, whatever the timing of the threads.
        plans = [iter(plan) for plan in queue.plan()]
        take = lambda worker: next(plans[worker], None)  # noqa: E731
    if not _THREADED.acquire(blocking=False):
        # another call is on the worker threads: run the workers' shares one after the other here
        # (a deterministic plan gives the same sums as on threads)
        return [_work(w, take, fn, scratch) for w in range(workers)]
    try:
        return _on_threads(take, fn, scratch, workers, _pool(threads - 1))
    finally:
        _THREADED.release()


def _work(worker: int, take: Callable[[int], tuple[Any, bool] | None], fn: Callable[[Any, T, bool], None],
          scratch: Callable[[], T]) -> T:
    """One worker's share: ``fn`` on each item that ``take(worker)`` hands out, with one scratch."""
    st = scratch()
    while (got := take(worker)) is not None:
        fn(got[0], st, got[1])
    return st


_THREADED = threading.Lock()  # held while a call runs on worker threads

# While the workers run, torch is set to 1 intra-op thread (process-wide; restored afterwards), so
# that each worker's ops stay on its own core. Same-run A/B (benchmarks/runtime_ab.py, "ops on
# torch's threads" = False here): without it every case of benchmarks/shapes.py on the workers is
# 9–48% slower, a whole nanoGPT training step 9% (docs/benchmarks.md).
ONE_THREAD_OPS = True
# Before the workers start, torch's spinning OpenMP threads are let go (``_quiet_openmp``; switchable
# for the A/B).
QUIET_OPENMP = True


class Queue:
    """The items of one call, handed to the worker threads one at a time.

    A worker takes the next item of a group it owns; when those are done it claims the next group
    nobody owns (groups in the order of their first item); when every group is claimed it helps
    the group with the most items left, taking its last (cheapest) item, without owning it. So in
    the backward, where a group is a chunk whose dK/dV its items add into, two threads on two
    chunks each add into their own chunk with no private copy, and a thread that runs dry still
    helps with what is left.

    Near the end (fewer items left than threads) a taken item is split in two by ``split`` when it
    can be, and the second half is put back: the last pieces get smaller, so the threads finish
    closer together (an idle thread at the end costs up to a whole item: ~10 ms at L = 2048)."""

    def __init__(self, items: list[tuple[int, Any]], threads: int, split: Callable[[Any], tuple[Any, Any] | None]):
        self.queues: dict[int, deque[Any]] = {}
        for group, item in items:
            self.queues.setdefault(group, deque()).append(item)
        self.free = deque(self.queues)  # unclaimed groups
        self.owned: dict[int, deque[int]] = {}  # worker → its groups that still have items
        self.left, self.threads, self.split = len(items), threads, split
        self.lock = threading.Lock()

    def take(self, worker: int) -> tuple[Any, bool] | None:
        """The next ``(item, own)`` for ``worker``; None when nothing is left."""
        with self.lock:
            got = self._pick(worker)
            if got is None:
                return None
            group, item, own = got
            self.left -= 1
            if self.left < self.threads and (halves := self.split(item)) is not None:
                _count("split")
                item = halves[0]
                self.queues[group].append(halves[1])
                self.left += 1
            if not own:
                _count("help")
            return item, own

    def plan(self) -> list[list[tuple[Any, bool]]]:
        """Every worker's ``(item, own)`` list, handed out as if the workers took one item each in
        turn: a schedule that does not depend on timing (for ``torch.use_deterministic_algorithms``)."""
        plans: list[list[tuple[Any, bool]]] = [[] for _ in range(self.threads)]
        turn = 0
        while (got := self.take(turn % self.threads)) is not None:
            plans[turn % self.threads].append(got)
            turn += 1
        return plans

    def _pick(self, worker: int) -> tuple[int, Any, bool] | None:
        mine = self.owned.setdefault(worker, deque())
        while mine and not self.queues[mine[0]]:
            mine.popleft()  # done (if a helper's split refills it later, that piece is taken as help)
        if mine:
            return mine[0], self.queues[mine[0]].popleft(), True
        if self.free:
            group = self.free.popleft()
            mine.append(group)
            return group, self.queues[group].popleft(), True
        left = [g for g, q in self.queues.items() if q]
        if not left:
            return None
        group = max(left, key=lambda g: len(self.queues[g]))
        return group, self.queues[group].pop(), False


def _on_threads(
    take: Callable[[int], tuple[Any, bool] | None],
    fn: Callable[[Any, T, bool], None],
    scratch: Callable[[], T],
    workers: int,
    pool: ThreadPoolExecutor,
) -> list[T]:
    before = torch.get_num_threads()
    inference = torch.is_inference_mode_enabled()  # thread-local, like grad mode: the caller's holds
    ops_threads = 1 if ONE_THREAD_OPS else before

    def work(worker: int) -> T:
        torch.set_num_threads(ops_threads)  # this worker's ops run on its own core
        with torch.inference_mode(inference), torch.no_grad():  # (inference_mode(False) turns grad on)
            return _work(worker, take, fn, scratch)

    torch.set_num_threads(ops_threads)
    try:
        if QUIET_OPENMP:
            _quiet_openmp()
        helpers = [pool.submit(work, w) for w in range(1, workers)]
        mine = work(0)  # the calling thread is one of the workers
        return [mine] + [f.result() for f in helpers]
    finally:
        torch.set_num_threads(before)


def _quiet_openmp() -> None:
    """Let torch's OpenMP threads go before our workers start (OpenMP 5.0's
    ``omp_pause_resource_all``). After each parallel torch op they spin for a while, waiting for
    the next one, on a core one of our workers needs; torch's next parallel op starts them again.
    Whole runs of benchmarks/shapes.py with and without it: sentence embedding 0.90–1.07× torch
    against 0.68–0.70×, decode 1.85–1.96× against 1.09–1.24×, nanoGPT training 0.68–0.71× against
    0.53–0.57× (docs/benchmarks.md). Linux only; nothing happens where the runtime is not found."""
    pause = _omp_pause()
    if pause is not None:
        pause(1)  # omp_pause_soft


@functools.cache
def _omp_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the OpenMP runtime torch loaded (libgomp, libiomp5 or libomp,
    from the process's memory map; one in torch's own folder first), or None."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            paths = set()
            for line in maps:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                path = fields[5].strip().decode(errors="surrogateescape") if len(fields) == 6 else ""
                if re.search(r"/lib(gomp|iomp5|omp)[^/]*\.so", path) and not path.endswith("(deleted)"):
                    paths.add(path)
    except OSError:
        return None
    here = os.path.dirname(torch.__file__)
    for path in sorted(paths, key=lambda p: (not p.startswith(here), p)):
        try:
            fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        except OSError:
            continue
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn  # type: ignore[no-any-return]
    return None


_POOL: dict[int, ThreadPoolExecutor] = {}


def _pool(workers: int) -> ThreadPoolExecutor:
    """The helper threads, started once and kept (a new process after fork starts its own)."""
    if workers not in _POOL:
        _POOL[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnzero-flash")
    return _POOL[workers]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.clear)  # the parent's threads do not exist in a child
