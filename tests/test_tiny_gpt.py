"""examples/tiny_gpt.py: a short training run lowers the loss, and generation with the KV cache
gives the same tokens as recomputing the whole sequence every step."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

import attnzero as az

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_gpt.py"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These models are tiny: one thread is as fast, and far faster on a loaded machine, where
    threads that wait for each other spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tg() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiny_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_gpt"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tg: ModuleType) -> tuple[object, torch.Tensor]:
    text = tg.load_text()
    assert 15_000 < len(text) < 100_000
    tok = tg.CharTokenizer(text)
    return tok, tok.encode(text)


def small_model(tg: ModuleType, vocab: int, **kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return tg.build_model(vocab, block_size=32, d_model=48, n_layers=2, n_heads=4, **kw)


def test_tokenizer_round_trip(tg: ModuleType, corpus: tuple[object, torch.Tensor]) -> None:
    tok, data = corpus
    text = tg.load_text()
    assert tok.decode(data) == text
    with pytest.raises(ValueError, match="not in the training text's vocabulary"):
        tok.encode("€")


def test_model_is_made_of_attnzero_attention(tg: ModuleType, corpus: tuple[object, torch.Tensor]) -> None:
    tok, _ = corpus
    model = small_model(tg, tok.vocab_size, n_kv_heads=2)
    attns = [m for m in model.modules() if isinstance(m, az.MultiHeadAttention)]
    assert len(attns) == 2 and all(a.rope is not None and a.num_kv_heads == 2 for a in attns)
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())


def test_short_training_lowers_the_loss(tg: ModuleType, corpus: tuple[object, torch.Tensor]) -> None:
    tok, data = corpus
    model = small_model(tg, tok.vocab_size, n_kv_heads=2)
    before = tg.evaluate(model, data, batches=4)
    losses = tg.train(model, data, steps=60, batch_size=16, lr=1e-2, seed=1)
    after = tg.evaluate(model, data, batches=4)
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5  # the training loss falls
    assert after < before - 0.5, (before, after)  # and so does the loss on fixed windows
    assert after < 3.4  # well below the uniform guess log(61) ≈ 4.11: it learned letter frequencies at least


def test_time_budget_stops_training(tg: ModuleType, corpus: tuple[object, torch.Tensor]) -> None:
    tok, data = corpus
    model = small_model(tg, tok.vocab_size)
    printed: list[str] = []
    losses = tg.train(model, data, steps=10_000, batch_size=2, time_budget=0.0, print_fn=printed.append)
    assert len(losses) <= 1 and "time budget" in printed[-1]


@pytest.mark.parametrize("kv_heads", [None, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_greedy_generation_with_cache_equals_full_recompute(
    tg: ModuleType, corpus: tuple[object, torch.Tensor], kv_heads: int | None
) -> None:
    tok, data = corpus
    model = small_model(tg, tok.vocab_size, n_kv_heads=kv_heads)
    tg.train(model, data, steps=15, batch_size=8, lr=1e-2, seed=2)  # trained a little: peaked logits
    prompts = torch.stack([tok.encode("The keeper "), tok.encode("A fox lived")])  # (2, 11)
    cached = tg.generate(model, prompts, 40, use_cache=True)
    full = tg.generate(model, prompts, 40, use_cache=False)
    assert cached.shape == (2, 51)
    assert torch.equal(cached, full), (tok.decode(cached[0]), tok.decode(full[0]))
    assert torch.equal(cached[:, :11], prompts)


def test_cached_logits_equal_full_logits_past_the_training_context(
    tg: ModuleType, corpus: tuple[object, torch.Tensor]
) -> None:
    """Token-by-token logits through the caches equal one causal pass, also beyond block_size."""
    tok, data = corpus
    model = small_model(tg, tok.vocab_size, n_kv_heads=2).eval()
    seq = data[:50][None]  # (1, 50) > block_size 32
    with torch.no_grad():
        full = model(seq)  # (1, 50, vocab)
        caches = model.new_caches(1, 50)
        steps = [model(seq[:, :20], caches)] + [model(seq[:, t : t + 1], caches) for t in range(20, 50)]
    assert all(len(c) == 50 for c in caches)
    assert float((torch.cat(steps, dim=1) - full).abs().max()) < 1e-5


def test_sampling_is_reproducible(tg: ModuleType, corpus: tuple[object, torch.Tensor]) -> None:
    tok, _ = corpus
    model = small_model(tg, tok.vocab_size)
    prompt = tok.encode("Arne")[None]
    a = tg.generate(model, prompt, 20, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    b = tg.generate(model, prompt, 20, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (1, 24)


def test_main_runs_end_to_end(tg: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    tg.main(["--steps", "3", "--d-model", "32", "--layers", "1", "--block-size", "16", "--batch-size", "4",
             "--new-tokens", "10", "--log-every", "1"])
    out = capsys.readouterr().out
    assert "step     3  loss" in out and "same tokens: True" in out
