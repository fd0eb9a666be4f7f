"""Pictures of attention: heatmap PNGs (matplotlib) and one self-contained interactive HTML page.

Everything here takes the attention weights of a whole model for one sentence as a tensor

    weights (N, H, L, L)   N layers, H heads, L tokens; row i = what token i attends to (rows sum to 1)

plus the L token strings. matplotlib is imported only when a PNG is drawn (it comes with the
``hf`` extra); the HTML page needs nothing but a browser — its script and style are inline, it
loads nothing from the network. The page itself is a file of the package,
``attnzero/resources/head_view.html``, which :func:`html_page` fills with the data.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

# Fonts that draw Chinese characters, tried in this order when a token needs one.
CJK_FONTS = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Source Han Sans SC",
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "Droid Sans Fallback",
    "AR PL UMing CN",
    "Microsoft YaHei",
    "SimHei",
    "PingFang SC",
    "Heiti SC",
)


@dataclass
class SentenceView:
    """One sentence for the pictures: its tokens, the weights (N, H, L, L) and the token to follow."""

    title: str
    tokens: list[str]
    weights: Tensor
    focus: int

    def __post_init__(self) -> None:
        if self.weights.ndim != 4 or self.weights.shape[-1] != self.weights.shape[-2]:
            raise ValueError(f"weights: expected (layers, heads, L, L), got {tuple(self.weights.shape)}")
        if self.weights.shape[-1] != len(self.tokens):
            raise ValueError(
                f"tokens: expected {self.weights.shape[-1]} tokens to match weights, got {len(self.tokens)}"
            )
        if not 0 <= self.focus < len(self.tokens):
            raise ValueError(f"focus: expected an index in [0, {len(self.tokens)}), got {self.focus}")


def top_tokens(row: Tensor, tokens: Sequence[str], k: int = 3) -> list[tuple[str, float]]:
    """The k tokens with the largest weight in ``row`` (L,), largest first."""
    values, index = row.float().topk(min(k, row.numel()))
    return [(tokens[i], v) for i, v in zip(index.tolist(), values.tolist())]


def needs_cjk(tokens: Sequence[str]) -> bool:
    """Whether any token has a CJK character (which matplotlib's default font cannot draw)."""
    return any(_is_cjk(c) for t in tokens for c in t)


def _is_cjk(c: str) -> bool:
    return 0x2E80 <= ord(c) <= 0x9FFF or 0xF900 <= ord(c) <= 0xFAFF or 0xFF00 <= ord(c) <= 0xFFEF


def cjk_font() -> str | None:
    """The name of an installed font that draws Chinese, or None when there is none."""
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    return next((name for name in CJK_FONTS if name in installed), None)


def _labels(tokens: Sequence[str], have_cjk_font: bool) -> list[str]:
    """Tick labels; without a CJK font a Chinese character is written as its code point, U+6211."""
    if have_cjk_font:
        return list(tokens)
    return ["".join(f"U+{ord(c):04X}" if _is_cjk(c) else c for c in t) for t in tokens]


def _setup_matplotlib(texts: Sequence[str]) -> tuple[object, list[str]]:
    """pyplot on the file-only Agg backend, with a CJK fallback font where the texts need one;
    returns pyplot and the texts as they can be drawn (see :func:`_labels`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    font = cjk_font() if needs_cjk(texts) else None
    if font is not None:
        plt.rcParams["font.family"] = ["DejaVu Sans", font]  # DejaVu for Latin, the CJK font for the rest
    else:
        plt.rcParams["font.family"] = ["DejaVu Sans"]
    return plt, _labels(texts, font is not None or not needs_cjk(texts))


def save_focus_png(view: SentenceView, path: str | Path) -> Path:
    """One panel per layer: rows are heads, columns the tokens, colour = how much the focus token
    attends to each token in that head. Returns the path written."""
    plt, all_labels = _setup_matplotlib([*view.tokens, view.title])
    *labels, title = all_labels
    N, H, L, _ = view.weights.shape
    rows = view.weights[:, :, view.focus, :].float().cpu()  # (N, H, L): the focus token's row in every head
    cols = min(3, N)
    nrows = math.ceil(N / cols)
    fig, axes = plt.subplots(  # type: ignore[attr-defined]
        nrows, cols, figsize=(cols * (1.2 + 0.32 * L), nrows * (0.8 + 0.25 * H)), squeeze=False,
        constrained_layout=True,
    )
    image = None
    for n in range(nrows * cols):
        ax = axes[n // cols][n % cols]
        if n >= N:
            ax.axis("off")
            continue
        image = ax.imshow(rows[n].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(f"layer {n}", fontsize=9)
        ax.set_yticks(range(H), [str(h) for h in range(H)], fontsize=6)
        ax.set_ylabel("head", fontsize=7)
        ax.set_xticks(range(L), labels, rotation=90, fontsize=7)
        ax.get_xticklabels()[view.focus].set_color("crimson")
    fig.suptitle(f"{title}: what {labels[view.focus]!r} attends to, per layer and head", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)  # type: ignore[attr-defined]
    return out


def save_layers_png(view: SentenceView, path: str | Path) -> Path:
    """One L×L heatmap per layer, averaged over the heads (row = query token, column = key token)."""
    plt, all_labels = _setup_matplotlib([*view.tokens, view.title])
    *labels, title = all_labels
    N, _, L, _ = view.weights.shape
    mean = view.weights.float().mean(dim=1).cpu()  # (N, L, L): averaged over heads
    cols = min(3, N)
    nrows = math.ceil(N / cols)
    side = 1.5 + 0.3 * L
    fig, axes = plt.subplots(  # type: ignore[attr-defined]
        nrows, cols, figsize=(cols * side, nrows * side), squeeze=False, constrained_layout=True
    )
    for n in range(nrows * cols):
        ax = axes[n // cols][n % cols]
        if n >= N:
            ax.axis("off")
            continue
        ax.imshow(mean[n].numpy(), cmap="magma", vmin=0.0, aspect="equal")
        ax.set_title(f"layer {n} (mean of heads)", fontsize=9)
        ax.set_xticks(range(L), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(L), labels, fontsize=6)
    fig.suptitle(f"{title}: attention weights (row attends to column)", fontsize=10)
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)  # type: ignore[attr-defined]
    return out


def page_data(views: Sequence[SentenceView], digits: int = 4) -> list[dict[str, object]]:
    """What the HTML page embeds: per sentence its title, tokens, focus and rounded weights."""
    data: list[dict[str, object]] = []
    for v in views:
        # rounded in float64, so that each number prints short (0.1234, not 0.12340000271797180)
        w = torch.round(v.weights.detach().cpu().double(), decimals=digits)  # (N, H, L, L)
        data.append({"title": v.title, "tokens": list(v.tokens), "focus": v.focus, "weights": w.tolist()})
    return data


def html_page(views: Sequence[SentenceView], title: str = "attnzero — attention head view") -> str:
    """The interactive page as one string: pick the sentence, layer and head; hover a token to
    see where it looks. Self-contained (inline data, script and style; no network).

    The page is the template ``resources/head_view.html`` with its two blanks filled in one pass:
    ``__TITLE__`` (escaped as HTML text) and ``__DATA__`` (:func:`page_data` as JSON, read by the
    page's script from ``<script type="application/json" id="attention-data">``)."""
    if not views:
        raise ValueError("views: expected at least one sentence, got none")
    payload = json.dumps(page_data(views), ensure_ascii=False, separators=(",", ":"))
    payload = payload.replace("</", "<\\/")  # the JSON sits inside <script>: never let it close the tag
    safe_title = title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    blanks = {"__TITLE__": safe_title, "__DATA__": payload}
    # one pass: a title that happens to contain "__DATA__" stays text
    return re.sub("__TITLE__|__DATA__", lambda m: blanks[m.group(0)], page_template())


def page_template() -> str:
    """The page with its blanks, as shipped in the package (``attnzero/resources/head_view.html``).
    In it, lines join each token on the left (the query) to each token on the right (the key),
    opacity = attention weight; hovering a token keeps only its lines and lists its weights in
    ``#panel``. Tokens are inserted with ``textContent`` only, never as HTML."""
    return resources.files("attnzero").joinpath("resources", "head_view.html").read_text(encoding="utf-8")


def save_html(views: Sequence[SentenceView], path: str | Path, title: str = "attnzero — attention head view") -> Path:
    """Write :func:`html_page` to ``path`` (UTF-8) and return the path."""
    out = Path(path)
    out.write_text(html_page(views, title), encoding="utf-8")
    return out


def save_bench_png(rows: Sequence[object], path: str | Path) -> Path:
    """Time against sequence length (log-log), one panel per pass (fwd, fwd+bwd) × mask (full,
    causal), one line per implementation; plus the extra peak memory where it was measured.
    ``rows`` are ``attnzero.bench.Row`` records (impl, L, mode, mask, seconds, peak_mb)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [vars(r) if not isinstance(r, dict) else r for r in rows]
    panels = sorted({(r["mode"], r["mask"]) for r in recs}, key=lambda p: (p[0] != "fwd", p[1] != "full"))
    with_memory = any(r.get("peak_mb") for r in recs)
    n = len(panels) + (1 if with_memory else 0)
    fig, axes = plt.subplots(1, max(n, 1), figsize=(4.4 * max(n, 1), 3.8), squeeze=False, constrained_layout=True)
    impls = sorted({r["impl"] for r in recs})
    lengths = sorted({r["L"] for r in recs})
    for ax, (mode, mask) in zip(axes[0], panels):
        for impl in impls:
            pts = sorted((r["L"], r["seconds"]) for r in recs
                         if r["impl"] == impl and r["mode"] == mode and r["mask"] == mask and r["seconds"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="ms per call", title=f"{mode}, {mask}")
        ax.set_xticks(lengths, [str(L) for L in lengths], minor=False)
        ax.set_xticks([], minor=True)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if with_memory:
        ax = axes[0][-1]
        for impl in impls:
            for mode, style in (("fwd", "-"), ("fwd+bwd", "--")):
                pts = sorted((r["L"], r["peak_mb"]) for r in recs if r["impl"] == impl and r["mode"] == mode
                             and r.get("peak_mb"))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=f"{impl} {mode}")
        ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="MB", title="extra peak memory")
        ax.set_xticks(lengths, [str(L) for L in lengths], minor=False)
        ax.set_xticks([], minor=True)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
