"""Whole models on the CPU with attnzero's drop-in (``az.scaled_dot_product_attention``) in place of
torch's ``F.scaled_dot_product_attention``: attnzero's step time ÷ torch's (below 1.0: faster), the
three variants interleaved step by step on one model (same weights, same optimizer).

* nanoGPT's training step: ``compile.py``'s GPT (nanoGPT's model) with 4 layers, n_embd 128,
  4 heads, block 256, batch 12, vocabulary 65, no dropout; zero_grad, forward, backward, AdamW.
* ViT-Tiny (``ViTTiny`` below, timm's ``vit_tiny_patch16_224`` configuration), batch 8 of
  224×224 images: the forward in inference (eval, no grad) and a training step (AdamW).

The variants take turns step by step, each round starting one later (a step leaves the heap and
the caches to the next). The third variant, "no attention", replaces the attention call by its
value input (same shape): the time of every op around attention. ``attention part`` = (attnzero −
no attention) ÷ (torch − no attention) is attention's own share of the step, ratio of the two;
when it is clearly worse than the attention-only ratio at the same shape (``--only sdpa``), the
ops around attention got slower with attnzero's call between them.

Each row runs in ``PROCESSES`` fresh processes, or as many as ``--processes`` says (``python
benchmarks/cpu_models.py ROW ROUNDS`` prints one process's samples). A whole step here swings by a
third with the state of glibc's heap, which the process's own history settles: glibc grows the heap
and trims it back around the 1.2–4.8 MB activations, and one process takes no page faults per ViT
forward, another ~28000 (~110 MB of fresh pages), step after step. The ratio is the median over
every round of every process of attnzero's step ÷ torch's step in the same round (paired, so that
the machine's slow drifts cancel); the range after it is the processes' own medians, and the 95 %
interval resamples whole processes (under load their medians spread ±10 %: the interval says
whether a row's ratio is below 1.0 beyond that spread).

    .venv/bin/python benchmarks/cpu_kernel.py --only models [--busy] [--quick] [--processes N]
        [--models nanogpt vit vit-train] [--heap fixed]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from compile import GPT
from harness import ms, table
from torch import Tensor, nn

import attnzero as az
from attnzero.bench import interleaved_samples

MODES = {"torch": "torch", "attnzero": "dropin", "no attention": "none"}  # label: the model's switch

# Each row in this many fresh processes (a process's heap settles which of its steps take page
# faults), and per process this many rounds for each repeat of the other tables (14 at the default 7).
PROCESSES = 3
ROUNDS_PER_REPEAT = 2

# glibc's heap with no trimming and no per-size switch to mmap (``--heap fixed``): the activations
# then reuse the same pages step after step, in every process. As it comes, glibc hands the heap's
# top back to the system whenever more than twice the largest freed block lies free there, and the
# next step faults those pages in again; whether that happens depends on where the process's small
# long-lived allocations landed: ViT-Tiny's MLP, 2364 page faults and ~30 % longer in one process,
# none in the next (docs/benchmarks.md, sixth session).
FIXED_HEAP = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


class ViTAttention(nn.Module):
    """Multi-head self-attention over all tokens (no mask), by the function ``attention`` names."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.attention = heads, "torch"
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, N, C/H)
        if self.attention == "torch":
            y = F.scaled_dot_product_attention(q, k, v)
        elif self.attention == "dropin":
            y = az.scaled_dot_product_attention(q, k, v)
        else:  # "none": no attention, the ops around it alone
            y = v
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = ViTAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViTTiny(nn.Module):
    """A Vision Transformer with timm's ``vit_tiny_patch16_224`` configuration: 16×16 patches of a
    224×224 RGB image (196 tokens and a class token, learned position embeddings), width 192,
    depth 12, 3 heads of 64, MLP 4× with GELU, pre-LayerNorm (eps 1e-6), the class token's final
    norm into a 1000-way head (5.7 M parameters). Smaller images or depth for smoke runs."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 192, depth: int = 12, heads: int = 3,
                 mlp_ratio: int = 4, classes: int = 1000) -> None:  # fmt: skip
        super().__init__()
        tokens = (image // patch) ** 2 + 1
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, tokens, dim))
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads, mlp_ratio) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, 196, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])  # (B, classes)


def use(model: nn.Module, switch: str) -> None:
    """Every attention module of ``model`` calls ``switch`` ("torch", "dropin" or "none")."""
    for m in model.modules():
        if hasattr(m, "attention"):
            setattr(m, "attention", switch)  # noqa: B010 (nn.Module types attributes as tensors or modules)


def train_step(model: nn.Module, loss: Callable[[], Tensor]) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    return step


def variants(model: nn.Module, step: Callable[[], None]) -> dict[str, Callable[[], None]]:
    """The step with each attention in turn (the switch set before each step)."""

    def with_mode(switch: str) -> Callable[[], None]:
        def run() -> None:
            use(model, switch)
            step()

        return run

    return {label: with_mode(switch) for label, switch in MODES.items()}


Built = tuple[str, nn.Module, Callable[[], None]]  # the row's label, the model, one step


def nanogpt(quick: bool) -> Built:
    B, L, layers = (2, 64, 1) if quick else (12, 256, 4)
    model = GPT(vocab=65, block=L, d_model=128, n_head=4, n_layer=layers, dropout=(0.0, 0.0), attention="torch")
    idx, targets = torch.randint(0, 65, (B, L)), torch.randint(0, 65, (B, L))
    label = f"nanoGPT: {layers} layers, n_embd 128, 4 heads, block {L}, batch {B}; train step (AdamW)"
    return label, model, train_step(model, lambda: model(idx, targets))


def vit(quick: bool, train: bool) -> Built:
    B, image, depth = (2, 64, 2) if quick else (8, 224, 12)
    model = ViTTiny(image=image, depth=depth)
    images, labels = torch.randn(B, 3, image, image), torch.randint(0, 1000, (B,))
    label = f"ViT-Tiny/16{'' if depth == 12 else f' ({depth} blocks)'}, {image}×{image}, batch {B}; "
    if train:
        return label + "train step (AdamW)", model, train_step(model, lambda: F.cross_entropy(model(images), labels))
    model.eval()

    def forward() -> None:
        with torch.no_grad():
            model(images)

    return label + "forward, inference", model, forward


ROWS: dict[str, Callable[[bool], Built]] = {
    "nanogpt": nanogpt,
    "vit": lambda quick: vit(quick, False),
    "vit-train": lambda quick: vit(quick, True),
}


def samples(row: str, quick: bool, rounds: int) -> tuple[str, dict[str, list[float]]]:
    """Row ``row``'s label and, in this process, each variant's step times, one per round."""
    torch.manual_seed(0)
    label, model, step = ROWS[row](quick)
    return label, interleaved_samples(variants(model, step), rounds, warmups=2, rotate=True)


def in_fresh_process(row: str, quick: bool, rounds: int, heap: str = "default") -> tuple[str, dict[str, list[float]]]:
    """``samples`` in a new Python process (this file run as a script), with glibc's heap as it comes
    or (``heap="fixed"``) with FIXED_HEAP."""
    command = [sys.executable, str(Path(__file__).resolve()), row, str(rounds)] + (["--quick"] if quick else [])
    env = os.environ | FIXED_HEAP if heap == "fixed" else None
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    label, times = json.loads(done.stdout.splitlines()[-1])
    return label, times


def paired(times: dict[str, list[float]], a: str, b: str) -> list[float]:
    """a's time ÷ b's time, round by round."""
    return [x / y for x, y in zip(times[a], times[b], strict=True)]


def interval(ratios: list[list[float]], draws: int = 2000) -> tuple[float, float]:
    """A 95 % interval of the pooled median of ``ratios`` (a list of rounds' ratios per process), by
    resampling whole processes: a process's own state moves all its rounds together."""
    pick = random.Random(0)
    n = len(ratios)
    resampled = ([r for i in pick.choices(range(n), k=n) for r in ratios[i]] for _ in range(draws))
    medians = sorted(statistics.median(rounds) for rounds in resampled)
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def section(quick: bool, repeats: int, processes: int = PROCESSES, rows: list[str] | None = None,
            heap: str = "default") -> Iterator[str]:  # fmt: skip
    rounds = ROUNDS_PER_REPEAT * repeats
    yield ("whole models, float32: attnzero's drop-in in place of torch's SDPA (attnzero ÷ torch: below 1 is faster); "
           f"{processes} fresh processes × {rounds} rounds, the order rotated; the median of the rounds' ratios "
           "[the processes' medians], and its 95 % interval over processes (bootstrap)"
           + ("; glibc's heap fixed (no trimming)" if heap == "fixed" else ""))  # fmt: skip
    yield ""

    def cells() -> Iterator[list[str]]:
        for row in rows or list(ROWS):
            runs = [in_fresh_process(row, quick, rounds, heap) for _ in range(processes)]
            label = runs[0][0]
            pooled = {name: [t for _, times in runs for t in times[name]] for name in MODES}
            ours, theirs, none = (statistics.median(pooled[name]) for name in ("attnzero", "torch", "no attention"))
            ratios = [paired(times, "attnzero", "torch") for _, times in runs]
            ratio = statistics.median(r for process in ratios for r in process)
            each = sorted(statistics.median(r) for r in ratios)
            low, high = interval(ratios)
            part = f"{(ours - none) / (theirs - none):.2f}" if theirs > none else "–"
            spread = f"{ratio:.2f} [{each[0]:.2f}–{each[-1]:.2f}]"
            yield [label, ms(theirs), ms(ours), spread, f"{low:.2f}–{high:.2f}", ms(none), part]

    header = ["model; pass", "torch ms", "attnzero ms", "attnzero ÷ torch", "95 % interval", "no attention ms",
              "attention part"]  # fmt: skip
    yield from table(header, cells())


if __name__ == "__main__":  # one process's samples of one row: ROW ROUNDS [--quick], as JSON on the last line
    print(json.dumps(samples(sys.argv[1], "--quick" in sys.argv, int(sys.argv[2]))))
