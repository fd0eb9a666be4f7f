"""What the README says about others' results, checked: who gives NaN for a fully masked row
(the seeds' formula and nn.MultiheadAttention; not torch's scaled_dot_product_attention on CPU,
which gives 0 as attnzero does), and that dropout draws its own random stream."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import attnzero as az

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme() -> str:
    return " ".join(README.read_text(encoding="utf-8").split())  # line breaks as spaces


def _seed_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The seeds' attention: masked_fill(mask == 0, -inf), then softmax."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(mask == 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_fully_masked_row_matches_torch_cpu_and_who_gives_nan() -> None:
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    keep = torch.rand(5, 5) < 0.7
    keep[:, 0] = True
    keep[2] = False  # row 2 sees no key
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert torch.equal(theirs[:, :, 2], torch.zeros_like(theirs[:, :, 2]))  # torch 2.13 on CPU: 0
    torch.testing.assert_close(az.scaled_dot_product_attention(q, k, v, attn_mask=keep), theirs)
    assert torch.isnan(_seed_formula(q, k, v, keep)[:, :, 2]).all()  # the seeds: NaN
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    out, _ = mha(x, x, x, attn_mask=~keep)  # nn.MultiheadAttention: True = blocked
    assert torch.isnan(out[:, 2]).all()  # nn.MultiheadAttention: NaN
    sentence = _readme()
    for claim in (
        "a fully masked row is 0, not the NaN that the seeds' `masked_fill(mask == 0, -inf)` + softmax",
        "and `nn.MultiheadAttention` give (torch's own `F.scaled_dot_product_attention` gives 0 on CPU",
    ):
        assert claim in sentence, claim


def test_readme_says_dropout_has_its_own_stream() -> None:
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    torch.manual_seed(5)
    theirs = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    ours = {}
    for b in ("reference", "flash"):
        torch.manual_seed(5)
        ours[b] = az.attention(q, k, v, dropout_p=0.5, backend=b)
    assert not torch.allclose(ours["reference"], theirs)  # other entries than torch's
    torch.testing.assert_close(ours["flash"], ours["reference"])  # the same entries on every backend
    claim = "dropout drops other entries than torch's, and the same ones on every attnzero backend"
    assert claim in _readme()
