"""Attention throughput and memory: the same run as ``attnzero bench --full``, from a checkout.

    .venv/bin/python benchmarks/bench.py            # = attnzero bench --full: L = 512 … 16384, memory too
    .venv/bin/python benchmarks/bench.py --quick    # = attnzero bench: L = 512 … 4096, 3 repeats, no memory

Every other flag is ``attnzero bench``'s (``--lengths``, ``--impls``, ``--repeats``, ``--no-memory``,
``--fwd-only``, ``--causal-only``, ``--out``; see ``attnzero bench --help``). The measuring and the
printing live in ``attnzero.bench``; this file only keeps the script's defaults.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from attnzero import cli


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--quick" in args:
        args.remove("--quick")  # attnzero bench's own defaults are the quick sweep
    else:
        args.insert(0, "--full")
    return cli.main(["bench", *args])


if __name__ == "__main__":
    sys.exit(main())
