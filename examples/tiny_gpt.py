"""A tiny character-level GPT built from attnzero's modules: trains on the CPU, generates with a KV cache.

    .venv/bin/python examples/tiny_gpt.py                       # ~2 minutes of training, then a sample
    .venv/bin/python examples/tiny_gpt.py --time-budget 20 --kv-heads 2 --prompt "The keeper"

The model is the usual decoder: token embedding → N pre-norm blocks → final norm → logits, where a
block is ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` and ``attn`` is ``az.MultiHeadAttention``
with causal attention and rotary positions (so there is no position embedding table), optionally
with fewer key/value heads (GQA). Generation keeps one ``az.KVCache`` per block: a prefill of the
prompt, then one token per step, each step attending to the cache instead of recomputing the whole
sequence — and giving the same tokens (``tests/test_tiny_gpt.py`` checks it).

The pieces are importable: ``build_model``, ``CharTokenizer``, ``train``, ``generate``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import attnzero as az

DATA = Path(__file__).resolve().parent / "data" / "lighthouse.txt"


# ---------------------------------------------------------------------------------------------
# Data


class CharTokenizer:
    """One id per distinct character of the training text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        unknown = sorted(set(text) - set(self.stoi))
        if unknown:
            raise ValueError(f"text: characters {unknown!r} are not in the training text's vocabulary")
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_text(path: Path | str = DATA) -> str:
    return Path(path).read_text(encoding="utf-8")


def get_batch(data: Tensor, batch_size: int, block_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random windows of the token stream: inputs x (B, T) and next-token targets y (B, T)."""
    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + block_size] for s in starts.tolist()])  # (B, T)
    y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts.tolist()])  # (B, T)
    return x, y


# ---------------------------------------------------------------------------------------------
# Model


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 128  # training context; rotary positions extend past it at generation
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (MHA); a divisor of n_heads gives GQA, 1 MQA
    dropout: float = 0.0
    backend: str = "auto"


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = az.MultiHeadAttention(
            cfg.d_model, cfg.n_heads, cfg.dropout, num_kv_heads=cfg.n_kv_heads, bias=False, rope=True,
            backend=cfg.backend,  # type: ignore[arg-type]
        )
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: Tensor, cache: az.KVCache | None = None) -> Tensor:
        # x (B, L, d_model). With a cache the attention is causal over the cached tokens too.
        a = self.attn(self.ln1(x), causal=True, cache=cache)
        assert isinstance(a, Tensor)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied input and output embeddings
        self.apply(self._init)
        for block in self.blocks:  # residual projections scaled down with depth (GPT-2)
            assert isinstance(block, Block)
            for lin in (block.attn.W_o, block.mlp[2]):
                assert isinstance(lin, nn.Linear)
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor, caches: Sequence[az.KVCache] | None = None) -> Tensor:
        """idx (B, L) token ids → logits (B, L, vocab). With ``caches`` (one per block, from
        ``new_caches``), ``idx`` holds only the new tokens and positions continue the cache."""
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"caches: expected {len(self.blocks)} (one per block), got {len(caches)}")
        x = self.tok_emb(idx)  # (B, L, d_model)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.ln_f(x))  # (B, L, vocab)

    def new_caches(self, batch_size: int, max_len: int) -> list[az.KVCache]:
        """One empty KV cache per block, on the model's device and dtype."""
        w = self.head.weight
        a = self.blocks[0].attn
        assert isinstance(a, az.MultiHeadAttention)
        return [
            az.KVCache(batch_size, max_len, a.num_kv_heads, a.d_k, dtype=w.dtype, device=w.device)
            for _ in self.blocks
        ]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(vocab_size: int, **overrides: object) -> TinyGPT:
    """A TinyGPT with GPTConfig's defaults, any of them overridden by keyword."""
    return TinyGPT(GPTConfig(vocab_size=vocab_size, **overrides))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Training


def loss_on(model: TinyGPT, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)  # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # mean over B·T next-token predictions


@torch.no_grad()
def evaluate(model: TinyGPT, data: Tensor, *, batches: int = 8, batch_size: int = 16, seed: int = 0) -> float:
    """Mean loss over fixed random windows of ``data``."""
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    losses = [float(loss_on(model, *get_batch(data, batch_size, model.cfg.block_size, g))) for _ in range(batches)]
    model.train(was_training)
    return sum(losses) / len(losses)


def train(
    model: TinyGPT,
    data: Tensor,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    time_budget: float | None = None,
    seed: int = 0,
    log_every: int = 0,
    print_fn: Callable[[str], None] = print,
) -> list[float]:
    """AdamW on random windows of ``data`` for ``steps`` steps, or until ``time_budget`` seconds
    have passed. Returns the training loss of every step; prints the mean every ``log_every``."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    warmup = max(1, min(20, steps // 10))
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        elapsed = time.perf_counter() - start
        if time_budget is not None and elapsed > time_budget:
            print_fn(f"time budget of {time_budget:g}s reached after {step} steps")
            break
        # progress through the run: by steps, or by time when the budget ends it sooner
        t = max(step / max(1, steps - 1), elapsed / time_budget if time_budget else 0.0)
        for group in opt.param_groups:  # linear warm-up, then cosine decay to lr/10
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * t))
        x, y = get_batch(data, batch_size, model.cfg.block_size, g)
        loss = loss_on(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            recent = losses[-log_every:]
            print_fn(
                f"step {step + 1:5d}  loss {sum(recent) / len(recent):.3f}  ({time.perf_counter() - start:5.1f}s)"
            )
    model.eval()
    return losses


# ---------------------------------------------------------------------------------------------
# Generation


def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """Next token ids (B, 1) from the last position's logits (B, vocab): greedy at temperature 0."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(
    model: TinyGPT,
    idx: Tensor,
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Continue the prompts ``idx (B, L0)`` by ``max_new_tokens`` tokens → (B, L0 + max_new_tokens).

    With ``use_cache``: one forward over the prompt fills the caches, then each step feeds only the
    newest token. Without: each step runs the whole sequence again. Both compute the same logits."""
    model.eval()
    B, L0 = idx.shape
    out = idx
    caches = model.new_caches(B, L0 + max_new_tokens) if use_cache else None
    logits = model(idx, caches)[:, -1]  # (B, vocab): prefill
    for i in range(max_new_tokens):
        nxt = _pick(logits, temperature, top_k, generator)  # (B, 1)
        out = torch.cat((out, nxt), dim=1)  # (B, L0 + i + 1)
        if i + 1 < max_new_tokens:
            logits = (model(nxt, caches) if use_cache else model(out))[:, -1]
    return out


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="most training steps (default 2000)")
    p.add_argument("--time-budget", type=float, default=120.0, help="most seconds of training (default 120)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default = --heads")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--prompt", default="The keeper ")
    p.add_argument("--new-tokens", type=int, default=400)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    text = load_text(args.data)
    tok = CharTokenizer(text)
    data = tok.encode(text)
    n_val = len(data) // 10
    train_data, val_data = data[:-n_val], data[-n_val:]
    model = build_model(
        tok.vocab_size, block_size=args.block_size, d_model=args.d_model, n_layers=args.layers,
        n_heads=args.heads, n_kv_heads=args.kv_heads,
    )
    print(f"data: {args.data.name}, {len(text)} characters, vocabulary {tok.vocab_size}")
    print(f"model: {model.num_params():,} parameters, {asdict(model.cfg)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"before training: val loss {evaluate(model, val_data):.3f} (uniform guess: {math.log(tok.vocab_size):.3f})")
    losses = train(
        model, train_data, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        time_budget=args.time_budget, seed=args.seed, log_every=args.log_every,
        print_fn=lambda line: print(line, flush=True),
    )
    print(f"after {len(losses)} steps: train loss {sum(losses[-20:]) / len(losses[-20:]):.3f}, "
          f"val loss {evaluate(model, val_data):.3f}")

    prompt = tok.encode(args.prompt)[None]  # (1, L0)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    sample = generate(model, prompt, args.new_tokens, temperature=args.temperature, top_k=args.top_k, generator=g)
    t_cache = time.perf_counter() - t0
    print("\n--- sample (KV cache) ---")
    print(tok.decode(sample[0]))
    print("---")

    t0 = time.perf_counter()
    greedy_cached = generate(model, prompt, args.new_tokens, use_cache=True)
    t1 = time.perf_counter()
    greedy_full = generate(model, prompt, args.new_tokens, use_cache=False)
    t2 = time.perf_counter()
    same = torch.equal(greedy_cached, greedy_full)
    print(f"sampling {args.new_tokens} tokens with the cache: {args.new_tokens / t_cache:.0f} tokens/s")
    print(f"greedy: with cache {args.new_tokens / (t1 - t0):.0f} tokens/s, full recompute "
          f"{args.new_tokens / (t2 - t1):.0f} tokens/s; same tokens: {same}")


if __name__ == "__main__":
    main()
