"""A record of what the code actually did: which tiles a backend visited, which splits a decode
kernel ran, which block a ring rank held at which step. The ladder (``attnzero ladder``) draws its
pictures from these records, so a picture shows the schedule that ran, not a drawing of the plan.

Instrumented code calls ``note(kind, **fields)``; it costs one truth test of a list when nothing is
recording. ``recording()`` collects every event noted while it is open, from every thread::

    with trace.recording() as rec:
        az.attention(q, k, v, causal=True, backend="flash")
    tiles = rec.of("flash.tile")     # [Event(kind="flash.tile", fields={...}), ...]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .locks import ForkSafeLock

_LOCK = ForkSafeLock()
_ACTIVE: list[Record] = []  # the open recordings (nested ones all receive every event)


@dataclass(frozen=True)
class Event:
    """One thing that happened: a ``kind`` ("flash.tile", "triton.program", "decode.split",
    "ring.step", ...) and the fields its instrumented site chose to record."""

    kind: str
    fields: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


@dataclass
class Record:
    """The events noted while a ``recording()`` was open, in the order they were noted."""

    events: list[Event] = field(default_factory=list)

    def of(self, kind: str) -> list[Event]:
        """The events of one kind."""
        return [e for e in self.events if e.kind == kind]


def active() -> bool:
    """True while some ``recording()`` is open (instrumented code may skip building its fields)."""
    return bool(_ACTIVE)


def note(kind: str, **fields: Any) -> None:
    """Record one event in every open recording; nothing when none is open."""
    if not _ACTIVE:
        return
    event = Event(kind, fields)
    with _LOCK:
        for rec in _ACTIVE:
            rec.events.append(event)


@contextmanager
def recording() -> Iterator[Record]:
    """Collect the events noted, from any thread, until the block ends."""
    rec = Record()
    with _LOCK:
        _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        with _LOCK:
            _ACTIVE.remove(rec)
