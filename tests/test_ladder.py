"""The ladder as a whole: its documents include only code that exists, exactly as the files have it;
the English and the Chinese pages have the same rungs, code, outputs and pictures; the command runs.
(Each rung's own checks are in test_ladder_basics / _tiles / _triton and test_ring_ladder.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import absent

from attnzero import ladder
from attnzero.cli import main as cli_main
from attnzero.ladder import docs
from attnzero.ladder.common import Result, max_error, pictures_available

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "ladder.md", ROOT / "docs" / "ladder.zh-CN.md"]
RUNG_HEADING = re.compile(r"^## (?:Rung|第) (\d+)")
PICTURE = re.compile(r"!\[[^\]]*\]\((ladder/[^)]+)\)")


def rungs_of(text: str) -> list[int]:
    return [int(m.group(1)) for line in text.splitlines() if (m := RUNG_HEADING.match(line))]


@pytest.mark.parametrize("page", PAGES, ids=["en", "zh"])
def test_every_rung_has_a_section_in_order(page: Path) -> None:
    assert rungs_of(page.read_text(encoding="utf-8")) == sorted(ladder.RUNGS)


@pytest.mark.parametrize("page", PAGES, ids=["en", "zh"])
def test_included_code_is_the_code_in_the_files_now(page: Path) -> None:
    """Every include names a function or class that exists, and its block is that source, byte for
    byte (``attnzero ladder --docs`` rewrites them)."""
    text = page.read_text(encoding="utf-8")
    includes = [b for b in docs.blocks(text) if b.kind == "include"]
    assert len(includes) >= len(ladder.RUNGS)
    assert docs.stale(text) == []


@pytest.mark.parametrize("page", PAGES, ids=["en", "zh"])
def test_every_rung_shows_its_output_and_its_pictures_exist(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    outputs = sorted(int(b.target) for b in docs.blocks(text) if b.kind == "output")
    assert outputs == sorted(ladder.RUNGS)
    lines = text.splitlines()
    for b in docs.blocks(text):
        if b.kind == "output":
            assert any(line.startswith("check:") and line.endswith("OK") for line in lines[b.start : b.end]), b
    pictures = PICTURE.findall(text)
    assert pictures
    for rel in pictures:
        assert (page.parent / rel).is_file(), rel


def test_english_and_chinese_pages_have_the_same_code_outputs_and_pictures() -> None:
    en, zh = (p.read_text(encoding="utf-8") for p in PAGES)
    assert [(b.kind, b.target) for b in docs.blocks(en)] == [(b.kind, b.target) for b in docs.blocks(zh)]
    assert PICTURE.findall(en) == PICTURE.findall(zh)


def test_pictures_in_the_docs_are_the_ones_the_command_writes(tmp_path: Path) -> None:
    """The docs show only pictures that ``attnzero ladder`` draws (same file names)."""
    if not pictures_available():
        absent("matplotlib is not installed (pip install matplotlib)")  # under CI=true: a failure, not a skip
    drawn: set[str] = set()
    for n in ladder.RUNGS:
        drawn |= {p.name for p in ladder.run(n, tmp_path, small=True, quiet=True).pictures}
    shown = {Path(rel).name for rel in PICTURE.findall(PAGES[0].read_text(encoding="utf-8"))}
    assert shown <= drawn, shown - drawn
    assert drawn <= {p.name for p in (ROOT / "docs" / "ladder").glob("*.png")}


def test_source_of_reads_functions_methods_and_classes() -> None:
    src = docs.source_of("attnzero/ladder/docs.py::source_of")
    assert src.startswith("def source_of(ref: str) -> str:")
    assert docs.source_of("attnzero/ladder/common.py::Result.ok").startswith("@property\ndef ok(self)")
    assert docs.source_of("attnzero/ladder/common.py::Printer").startswith("class Printer:")
    for bad in ("attnzero/nope.py::f", "attnzero/ladder/docs.py::nope", "attnzero/ladder/docs.py"):
        with pytest.raises(ValueError, match="include"):
            docs.source_of(bad)


def test_refresh_rewrites_included_code_and_outputs_and_stale_sees_drift() -> None:
    page = (
        "intro\n<!-- include: attnzero/ladder/common.py::max_error -->\n```python\nold\n```\n"
        "<!-- output: 3 -->\n```text\nold output\n```\n"
    )
    assert docs.stale(page) == ["attnzero/ladder/common.py::max_error"]
    fresh = docs.refresh(page, {3: ["new output", "check: x OK"]})
    assert docs.stale(fresh) == []
    assert "def max_error" in fresh and "new output\ncheck: x OK\n```" in fresh
    assert docs.refresh(fresh) == fresh
    with pytest.raises(ValueError, match="fenced block"):
        docs.blocks("<!-- output: 1 -->\ntext\n")


def test_max_error_never_passes_nan_or_inf() -> None:
    import torch

    a = torch.zeros(3)
    assert max_error(a, a + 1e-3) == pytest.approx(1e-3)
    assert max_error(a, torch.tensor([0.0, float("nan"), 0.0])) == float("inf")
    assert not Result(0, "t", "c", float("nan"), 1.0).ok


def test_unknown_rung_is_refused() -> None:
    with pytest.raises(ValueError, match="rung"):
        ladder.module(11)
    with pytest.raises(SystemExit):
        cli_main(["ladder", "x"])


def test_the_command_runs_a_rung_and_python_dash_m_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ladder", "0", "--small", "--no-pictures"]) == 0
    out = capsys.readouterr().out
    assert "Rung 0" in out and re.search(r"check: .* OK", out)
    res = subprocess.run(
        [sys.executable, "-m", "attnzero.ladder", "4", "--small", "--no-pictures"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Rung 4" in res.stdout and "OK" in res.stdout
