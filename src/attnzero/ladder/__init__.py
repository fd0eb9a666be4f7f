"""The ladder: from the seeds' ``softmax(Q Kᵀ/√d_k) V`` to the Triton kernel, one runnable rung at a time.

Every rung is a module here with a ``run(out, small=..., say=...)`` that runs its step, checks it in
float64 against the rung before, measures it at a fixed shape and, given a folder, draws its
pictures from what the code recorded while it ran (``attnzero.trace``). ``docs/ladder.md`` (and
``docs/ladder.zh-CN.md``) explain each rung and include its code from these files.

    attnzero ladder            every rung, pictures into out/ladder
    attnzero ladder 4          one rung (also: python -m attnzero.ladder 4)
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from .common import Printer, Result

# rung number → module (each defines TITLE and run)
RUNGS: dict[int, str] = {
    0: "r0_seeds",
    1: "r1_masks",
    2: "r2_heads",
    3: "r3_safe_softmax",
    4: "r4_online",
    5: "r5_tiles",
    6: "r6_backward",
    7: "r7_triton",
    8: "r8_decode",
    9: "r9_ring",
    10: "r10_mods",
}


def module(n: int) -> ModuleType:
    """The module of rung ``n``."""
    if n not in RUNGS:
        raise ValueError(f"rung: expected one of {sorted(RUNGS)}, got {n}")
    return importlib.import_module(f"{__name__}.{RUNGS[n]}")


def run(n: int, out: Path | None = None, *, small: bool = False, quiet: bool = False) -> Result:
    """Run rung ``n``: print its steps, its check and its numbers; pictures into ``out`` if given."""
    mod = module(n)
    say = Printer(quiet=quiet)
    say(f"── Rung {n}: {mod.TITLE} ──")
    result: Result = mod.run(out, small=small, say=say)
    verdict = "OK" if result.ok else "FAILED"
    say(f"check: {result.check}: max error {result.error:.2e} (bound {result.tol:.2g}) {verdict}")
    result.lines = say.lines
    return result


def main(rungs: list[int] | None = None, out: str | None = "out/ladder", small: bool = False) -> int:
    """``attnzero ladder``: run the rungs (all by default); exit status 0 when every check passes."""
    from .common import pictures_available

    folder = Path(out) if out else None
    if folder is not None and not pictures_available():
        print("(pictures need matplotlib: pip install matplotlib; the rungs still run and check)")
        folder = None
    failed = []
    for n in rungs if rungs else sorted(RUNGS):
        result = run(n, folder, small=small)
        if not result.ok:
            failed.append(n)
        print()
    if folder is not None:
        print(f"pictures in {folder}/")
    if failed:
        print(f"rungs whose check failed: {failed}")
        return 1
    return 0


def write_docs(rungs: list[int] | None = None, root: Path = Path(".")) -> int:
    """``attnzero ladder --docs``: run the rungs with pictures into ``docs/ladder/`` and rewrite the
    code and output blocks of ``docs/ladder.md`` and ``docs/ladder.zh-CN.md``."""
    from . import docs

    pages = [root / "docs" / "ladder.md", root / "docs" / "ladder.zh-CN.md"]
    missing = [str(p) for p in pages if not p.is_file()]
    if missing:
        print(f"--docs runs from the repository root; not found: {missing}")
        return 2
    outputs: dict[int, list[str]] = {}
    status = 0
    for n in rungs if rungs else sorted(RUNGS):
        result = run(n, root / "docs" / "ladder")
        outputs[n] = result.lines
        status |= 0 if result.ok else 1
        print()
    texts = {page: docs.refresh(page.read_text(encoding="utf-8"), outputs) for page in pages}
    written: list[Path] = []
    try:  # both pages or neither: each written to a new file first, then moved over the old
        for page, text in texts.items():
            new = page.with_suffix(".md.new")
            new.write_text(text, encoding="utf-8")
            written.append(new)
        for page, new in zip(pages, written):
            new.replace(page)
            print(f"rewrote {page}")
    except OSError as e:
        print(f"--docs: cannot write {e.filename}: {e.strerror or e}; the pages are as they were")
        for new in written:
            new.unlink(missing_ok=True)
        return 2
    return status
