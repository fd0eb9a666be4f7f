"""A lock for module state that a forked process can still take: ``os.fork`` copies a lock as it
is, held or not, but not the thread that holds it — a DataLoader worker forked while another thread
of its parent was building the kernel or a score_mod would wait on that copy forever. The child
gets a new lock instead (``os.register_at_fork``); what the lock guarded is read again there."""

from __future__ import annotations

import os
import threading
from typing import Any


class ForkSafeLock:
    """``threading.Lock`` for ``with`` blocks, made anew in a forked child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()
