"""The demo's terminal table: per layer and head, the word the followed token attends to most."""

from __future__ import annotations

from typing import Any

import torch

from .. import viz
from .focus import is_special


def print_focus_table(console: Any, number: int, text: str, view: viz.SentenceView) -> None:
    """Rows: layers; columns: heads; each cell the word the focus token attends to most. [CLS] and
    [SEP] are left out: many heads park most of their weight there, which hides what they do.
    ``console`` is a ``rich.console.Console``."""
    from rich.table import Table

    N, H = view.weights.shape[:2]
    word = view.tokens[view.focus]
    table = Table(
        title=f'Sentence {number}: "{text}"\nwhich word does "{word}" (token {view.focus}) attend to most, '
        "per layer and head? (weight shown; [CLS]/[SEP] left out, where many heads park their attention)",
        show_lines=False, header_style="bold", title_justify="left",
    )
    table.add_column("layer", justify="right", min_width=5, no_wrap=True)
    words = torch.tensor([not is_special(t) for t in view.tokens])  # (L,): True = a word of the sentence
    for h in range(H):
        table.add_column(f"h{h}", justify="center", no_wrap=True)
    table.add_column("top 3 words, mean of heads", no_wrap=True)
    shown = min(3, int(words.sum()))  # words listed: a sentence of one or two has no third ([CLS] at -1)
    for n in range(N):
        cells = []
        for h in range(H):
            if not shown:  # (a text the tokenizer reads as no word: nothing to show)
                cells.append("—")
                continue
            row = view.weights[n, h, view.focus].float().where(words, torch.tensor(-1.0))  # specials out
            ((tok, w),) = viz.top_tokens(row, view.tokens, k=1)
            cells.append(f"{tok}\n[dim]{w:.2f}[/dim]")
        mean = view.weights[n, :, view.focus].float().mean(0).where(words, torch.tensor(-1.0))  # (L,): mean of heads
        top = ", ".join(f"{t} {w:.2f}" for t, w in viz.top_tokens(mean, view.tokens, k=shown))
        table.add_row(str(n), *cells, top)
    console.print()
    console.print(table)
