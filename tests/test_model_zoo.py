"""The model zoo: transformers' architectures, tiny and random, with attnzero as their attention.

Every architecture transformers ships with a language-model head (its causal-LM, masked-LM and
seq2seq-LM auto mappings) or an image-classification head (its auto mapping) — enumerated from those
mappings, about 300 — is built from its own default config shrunk to a tiny size (hidden 32,
2 layers, 4 heads, vocabulary 99, 32x32 images), and either

* gives the output eager gives within 1e-5 (float32) — logits of a batch with padding (left for
  decoders, right otherwise), or an image classifier's logits and last hidden state — **matched**;
* is **refused when it is loaded** (``_from_config(..., attn_implementation="attnzero")`` raises
  ``ValueError`` saying why and what to use instead): its attention bypasses transformers'
  AttentionInterface (REFUSED_AT_LOAD says which and why, from its source);
* or **raises naming the keyword** on its first forward: it asks attnzero for something attnzero
  cannot compute yet (REFUSED_AT_FORWARD; none at present — logit soft-capping and attention sinks,
  per head or per query, are computed: Gemma 2, T5Gemma, VaultGemma, gpt-oss, Flint, Granite-SWA,
  HY-V4, MiMo-V2-Flash and Inkling 2 are matched).

Which one is expected is written down here for every architecture, so a model that starts to be
refused, or to run, fails the test. A few architectures need more than a shrunk default config
(NOT_SWEPT, each with why); they are not skipped, they are not part of the sweep.

The named zoo below goes further for the architectures people run most: against sdpa as well,
greedy generate() with left padding (decoders and seq2seq), output_attentions against eager, and
gradients; plus encoders, vision and vision-language models with tiny dummy inputs.

Everything is tiny and random: nothing is downloaded (HF_HUB_OFFLINE=1); the whole file runs in
well under 90 s on two CPU cores.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import falcon_keeps_its_own_table, need

os.environ["HF_HUB_OFFLINE"] = "1"

need("transformers")

import transformers  # noqa: E402
from transformers.models.auto import configuration_auto, modeling_auto  # noqa: E402

from attnzero.integrations import transformers as hf  # noqa: E402

transformers.utils.logging.set_verbosity_error()
NAME = hf.register()


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    """Tiny models gain nothing from intra-op threads, and on a busy machine their spinning costs
    more than the work (this file runs ~2.5x faster on two shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- tiny configs
# (pattern of an int field of a config, tiny value); the first pattern that matches wins.
_TINY: list[tuple[re.Pattern[str], int]] = [
    (re.compile(p), v)
    for p, v in [
        (
            r"(hidden_size|d_model|n_embd|embed_dim|hidden_dim|model_dim|dim|word_embed_proj_dim|embedding_size|"
            r"encoder_hidden_size|d_embed|attention_hidden_size|embedding_dim|emb_dim|entity_emb_size|d_latents)",
            32,
        ),
        (r"(entity_vocab_size|vocab_size_per_layer_input)", 99),
        (r"num_latents", 8),
        (
            r"(num_hidden_layers|n_layer|n_layers|num_layers|encoder_layers|decoder_layers|num_decoder_layers|"
            r"num_encoder_layers|num_blocks)",
            2,
        ),
        (r"(num_attention_heads|n_head|n_heads|num_heads|encoder_attention_heads|decoder_attention_heads)", 4),
        (
            r"(intermediate_size|ffn_dim|n_inner|d_ff|encoder_ffn_dim|decoder_ffn_dim|ffn_hidden_size|"
            r"moe_intermediate_size|shared_expert_intermediate_size|intermediate_dim|expert_intermediate_size|"
            r"mlp_dim)",
            48,
        ),
        (r"vocab_size", 99),
        (r"(max_position_embeddings|n_positions|max_seq_len|max_sequence_length|n_ctx|seq_length)", 64),
        (r"(head_dim|kv_channels|d_kv|attention_head_dim|d_head)", 8),
        (r"(num_experts|num_local_experts|n_routed_experts|moe_num_experts)", 4),
        (r"(num_experts_per_tok|moe_topk|top_k|num_experts_per_token|moe_k)", 2),
        (r"(n_group|topk_group|n_shared_experts)", 1),
        (r"sliding_window", 4),  # shorter than the sequences: the window matters
        (r"(kv_lora_rank|q_lora_rank)", 16),
        (r"(qk_rope_head_dim|qk_nope_head_dim|v_head_dim)", 8),
        (r"(first_k_dense_replace|num_dense_layers|moe_layer_start_index)", 1),
        (r"rotary_dim", 4),
        (r"(image_size|img_size)", 32),  # vision: 32x32 images in 8x8 patches
        (r"patch_size", 8),
    ]
]
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
_SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}


def _shrink(fields: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that make a config of these (default) fields tiny. Only shrunk fields
    are passed: whatever a config derives from them (layer types, head dims) it derives again."""
    out: dict[str, Any] = {}
    heads = next((fields[h] for h in _HEADS if isinstance(fields.get(h), int)), None)
    for key, value in fields.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = _shrink(value)  # a sub-config (text / vision / encoder ...)
        elif key in _KV_HEADS and isinstance(value, int):
            out[key] = 1 if value == 1 else 4 if value == heads else 2  # keep MHA, MQA or GQA
        elif value is None and key in ("head_dim", *_KV_HEADS):
            out[key] = 8 if key == "head_dim" else 4  # some configs leave them None and break
        elif isinstance(value, int) and not isinstance(value, bool):
            tiny = next((v for p, v in _TINY if p.fullmatch(key)), None)
            if tiny is not None:
                out[key] = tiny
            elif key in _SPECIAL_TOKENS and value >= 99:
                out[key] = _SPECIAL_TOKENS[key]
    # per-layer lists (layer types, MoE / dense pattern): one layer of each kind, at least two
    layers = next((fields[k] for k in _LAYERS if isinstance(fields.get(k), int)), None)
    for key, value in fields.items():
        if isinstance(value, list) and layers and layers > 2 and len(value) == layers:
            kinds = list({repr(v): v for v in value}.values())
            out[key] = (kinds + [value[0]] * 2)[: max(2, len(kinds))]
            for k in _LAYERS:
                if k in fields:
                    out[k] = len(out[key])
    return out


#: Hand-set fields where the shrunk default config is not self-consistent (or still large).
OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "esm": {"vocab_size": 99, "pad_token_id": 0, "mask_token_id": 98},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": 4, "lru_width": 32},
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 16, "attn_layer_indices": [1]},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "layer_types": ["linear_attention", "attention"]},
    "bailing_hybrid": {"num_expert_group": 1},
    "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1},
    "neomme": {"head_dim": 16},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "gemma4_text": {"hidden_size_per_layer_input": 8},
    "gemma4": {"text_config": {"hidden_size_per_layer_input": 8}},
    "longcat_flash": {"expert_ffn_hidden_size": 48},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16], "axial_pos_shape": [8, 8]},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "swin": {"depths": [1, 1], "num_heads": [4, 4], "window_size": 2, "patch_size": 4},
    "swinv2": {"depths": [1, 1], "num_heads": [4, 4], "window_size": 2, "patch_size": 4},
    "donut-swin": {"depths": [1, 1], "num_heads": [4, 4], "window_size": 2, "patch_size": 4},
    # one sliding and one indexed (top-k key selecting) layer, each reading its own keys and values
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention"], "num_hidden_layers": 2,
                   "index_layers": [1], "kv_source_layers": [0, 1], "head_dim": 16, "index_num_heads": 1,
                   "mlp_only_layers": []},
}


def tiny_config(model_type: str, **extra: Any) -> transformers.PretrainedConfig:
    config_class = configuration_auto.CONFIG_MAPPING[model_type]
    kwargs = _shrink(config_class().to_dict())
    for key, value in {**OVERRIDES.get(model_type, {}), **extra}.items():  # a dict amends a sub-config
        kwargs[key] = {**kwargs.get(key, {}), **value} if isinstance(value, dict) else value
    return config_class(**kwargs)


# ------------------------------------------------------------------------------ the sweep
def _head_class(model_type: str) -> type[transformers.PreTrainedModel]:
    """The model with a language-model head: encoder-decoder (BART, T5, ...) where there is one, so
    that encoder padding and cross-attention run too, else the decoder, else the masked LM; for
    vision models, the image classifier."""
    for mapping in (
        modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    ):
        if model_type in mapping:
            name = mapping[model_type]
            return getattr(transformers, name if isinstance(name, str) else name[0])  # type: ignore[no-any-return]
    raise KeyError(model_type)


def _maps(mapping: Any, model_type: str, cls: type) -> bool:
    names = mapping.get(model_type, ())
    return cls.__name__ in ((names,) if isinstance(names, str) else names)


def _sweep_types() -> list[str]:
    """Language models (their LM auto mappings), then image classifiers not among them."""
    seen = dict.fromkeys(
        [
            *modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            *modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            *modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
            *modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        ]
    )
    return list(seen)


def _batch(model: transformers.PreTrainedModel, left: bool) -> dict[str, torch.Tensor]:
    """Two sequences of 7 tokens, the second with 3 pads (left for decoders, else right)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (2, 7), generator=gen)
    keep = torch.ones(2, 7, dtype=torch.long)
    keep[1, slice(0, 3) if left else slice(4, 7)] = 0
    batch = {"input_ids": ids.masked_fill(keep == 0, 0), "attention_mask": keep}
    if model.config.is_encoder_decoder:
        batch["decoder_input_ids"] = torch.randint(3, 99, (2, 5), generator=gen)
    return batch


def _logits(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else out[0]


def _outputs(out: Any) -> list[torch.Tensor]:
    """The logits, and the last hidden state when the model returned its hidden states."""
    hidden = getattr(out, "hidden_states", None)
    return [_logits(out)] + ([hidden[-1]] if hidden else [])


def sweep(model_type: str) -> tuple[str, str | float]:
    """Build ``model_type`` tiny with attnzero; run a padded batch with attnzero, then with eager.
    ("matched", max |diff|), ("differs", max |diff|), ("load", why) or ("forward", why)."""
    cls = _head_class(model_type)
    config = tiny_config(model_type)
    text = getattr(config, "text_config", None)
    if not isinstance(config, cls.config_class) and isinstance(text, cls.config_class):
        config = text  # a text-only head (Emu3ForCausalLM, ...) of a multimodal model type
    torch.manual_seed(0)
    try:
        model = cls._from_config(config, attn_implementation=NAME).eval()
    except ValueError as e:
        if str(e).startswith("attn_implementation:"):
            return "load", str(e)
        raise
    if _maps(modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, model_type, cls):
        channels = getattr(model.config, "num_channels", 3)
        batch = {"pixel_values": torch.randn(2, channels, 32, 32, generator=torch.Generator().manual_seed(0))}
        batch["output_hidden_states"] = True  # type: ignore[assignment]  # a classifier may start at 0
    else:
        decoder = _maps(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, model_type, cls)
        batch = _batch(model, left=decoder)  # left padding, the harder case, for decoders
    with torch.no_grad():
        try:
            ours = _outputs(model(**batch))
        except (ValueError, TypeError) as e:
            return "forward", str(e)
        model.set_attn_implementation("eager")
        theirs = _outputs(model(**batch))
    keep = batch["attention_mask"].bool() if "attention_mask" in batch else None
    diff = 0.0
    for a, b in zip(ours, theirs, strict=True):
        rows = keep if keep is not None and a.shape[:2] == keep.shape else slice(None)  # padding: not compared
        diff = max(diff, (a - b)[rows].abs().max().item())
    return ("matched" if diff <= 1e-5 else "differs"), diff


# ----------------------------------------------------------------------- what is expected
_NO_CALL = "attention layers that never call transformers' AttentionInterface"

#: Refused when loaded, with what the message names: the layer computing attention on a mask built
#: for the implementation name, the model's own table keyed by that name, or attention layers that
#: never call the interface (attnzero would not run in them).
REFUSED_AT_LOAD: dict[str, str] = {
    "big_bird": "attention layer BigBirdSelfAttention",
    "bigbird_pegasus": "attention layer BigBirdPegasusSelfAttention",  # swapped in for short inputs
    "bloom": "attention layer BloomAttention",
    "convbert": "attention layer ConvBertSelfAttention",
    "cpmant": _NO_CALL,
    "cvt": _NO_CALL,
    "data2vec-vision": "own table DATA2VEC_VISION_SELF_ATTENTION_CLASSES",
    # appends its compressor's additive block bias to the mask it is handed, cast to the mask's dtype
    "deepseek_v4": "attention layer DeepseekV4Attention",
    "deberta": _NO_CALL,
    "deberta-v2": _NO_CALL,
    "donut-swin": _NO_CALL,
    "falcon": "own table FALCON_ATTENTION_CLASSES",
    "flaubert": _NO_CALL,
    "fsmt": _NO_CALL,
    "funnel": _NO_CALL,
    "git": "own table GIT_SELF_ATTENTION_CLASSES",
    "got_ocr2": _NO_CALL,  # its vision encoder; the language model alone would run
    "gpt_neo": "own table GPT_NEO_ATTENTION_CLASSES",
    "gpt_neox_japanese": "attention layer GPTNeoXJapaneseAttention",
    "granite_speech": _NO_CALL,
    "granite_speech_plus": _NO_CALL,
    "hiera": _NO_CALL,
    "ibert": "attention layer IBertSelfAttention",
    "imagegpt": _NO_CALL,
    "led": "attention layer LEDEncoderSelfAttention",
    "levit": _NO_CALL,
    "longformer": "attention layer LongformerSelfAttention",
    "luke": "attention layer LukeSelfAttention",
    "megatron-bert": "attention layer MegatronBertSelfAttention",
    "mobilevit": _NO_CALL,
    "mobilevitv2": _NO_CALL,
    "mpnet": "attention layer MPNetSelfAttention",
    "mpt": "attention layer MptAttention",
    "mra": _NO_CALL,
    "mvp": "attention layer MvpAttention",
    "nystromformer": "attention layer NystromformerSelfAttention",
    "openai-gpt": _NO_CALL,
    "perceiver": _NO_CALL,
    "prophetnet": _NO_CALL,
    "pvt": _NO_CALL,
    "pvt_v2": _NO_CALL,
    "reformer": _NO_CALL,
    "rembert": "attention layer RemBertSelfAttention",
    "roformer": "attention layer RoFormerSelfAttention",
    "rwkv": _NO_CALL,
    "squeezebert": "attention layer SqueezeBertSelfAttention",
    "swiftformer": _NO_CALL,
    "swinv2": _NO_CALL,
    "tapas": "attention layer TapasSelfAttention",
    "trocr": "attention layer TrOCRAttention",
    "xglm": "attention layer XGLMAttention",
    "xlm": _NO_CALL,
    "xlnet": _NO_CALL,
    "yoso": _NO_CALL,
}
# Falcon runs from transformers 5.25 on; the sweep then expects it to match eager.
if not falcon_keeps_its_own_table():
    del REFUSED_AT_LOAD["falcon"]

#: Refused on the first forward, naming the keyword attnzero cannot compute yet (the keywords of
#: ``hf.UNSUPPORTED_KEYWORDS``). Empty since softcap and s_aux / sinks are computed; the models that
#: pass them (gemma2, t5gemma, vaultgemma; gpt_oss, flint, granite_swa, granitemoe_swa, hy_v4,
#: mimo_v2_flash; inkling2_text and inkling2_loop_text with per-query sinks) are swept as matched.
REFUSED_AT_FORWARD: dict[str, str] = {}

#: Architectures whose attention passes softcap or sinks: swept, and expected to match eager.
SOFTCAP_OR_SINKS = ["flint", "gemma2", "gpt_oss", "granite_swa", "granitemoe_swa", "hy_v4", "inkling2_loop_text",
                    "inkling2_text", "mimo_v2_flash", "t5gemma", "vaultgemma"]  # fmt: skip

_DRAFTER = "a drafter that runs only inside a target model's generate() (its shared key/value states)"
_CONV = "convolutional, no attention; its downsampling stages need images larger than 32x32"
_MULTIMODAL = "needs inputs of another modality that a text batch does not give"
#: Not part of the sweep: a shrunk default config does not make a runnable model of them (or it
#: needs more than a padded text batch). Each is listed with why; none of them is skipped silently.
NOT_SWEPT: dict[str, str] = {
    "blt": "byte-latent model: patcher/encoder/global/decoder sub-configs the generic shrinking does not fit",
    "cohere_compass_text": "its default config has no per-layer RoPE parameters (KeyError in its own rotary setup)",
    "dbrx": "its nested attention config loses rope_theta when rebuilt from keywords",
    "dory": "layer counts split over input/recurrent/output stacks that must add up",
    "dots3_note": "multimodal wrapper whose adapter must match the text size (text model swept: dots3_note_text)",
    "gemma3n": "its vision tower is a timm model (timm is not a dependency); the text model is swept as gemma3n_text",
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
    "musicgen": "text-to-audio: the decoder reads audio codebook ids and the config composes three sub-models",
    "musicgen_melody": "text-to-audio: the decoder reads audio codebook ids and the config composes three sub-models",
    "musicflamingo": _MULTIMODAL + " (audio), and its sub-configs have no model_type to shrink by",
    "nemo_speechlm": _MULTIMODAL + " (audio), and its audio sizes must match a head config",
    "voxtral_realtime": _MULTIMODAL + " (audio features)",
    "qwen4_exp": "its default config leaves the sparse-attention token budget None",
    "qwen4_exp_text": "its default config leaves the sparse-attention token budget None",
    "xlstm": "no attention (mLSTM cells) and its chunked kernels need sizes the shrinking breaks",
    "xmod": "needs a language adapter chosen with set_default_language() before any forward",
    "zamba": "hybrid with a shared transformer block whose tied-weight layout follows the full layer count",
    "zamba2": "hybrid with a shared transformer block whose adapters follow the full layer count",
    "zaya": "its config accepts only one expert per token, which the shrinking does not know",
    "vibevoice_asr": "speech model whose convolutional tokenizers stay large after shrinking (several seconds)",
    "convnext": _CONV,
    "convnextv2": _CONV,
    "efficientnet": _CONV,
    "dinat": "needs the natten package (neighbourhood-attention kernels), not a dependency of attnzero",
    "timm_wrapper": "a timm model (timm is not a dependency of attnzero), whose attention transformers does not route",
    "shieldgemma2": _MULTIMODAL + " (a prompt with the image)",
    "siglip2": "its NaFlex patches need a pixel attention mask and spatial shapes beside the pixels",
}

SWEEP = [t for t in _sweep_types() if t not in NOT_SWEPT]


def test_the_sweep_covers_the_auto_mappings() -> None:
    """The lists above name architectures transformers ships, and the sweep is most of them."""
    universe = set(_sweep_types())
    assert len(universe) > 200, "transformers' LM auto mappings were not enumerated"
    assert set(NOT_SWEPT) <= universe, f"stale: {sorted(set(NOT_SWEPT) - universe)}"
    assert set(REFUSED_AT_LOAD) | set(REFUSED_AT_FORWARD) | set(SOFTCAP_OR_SINKS) <= set(SWEEP)
    assert set(SOFTCAP_OR_SINKS).isdisjoint(set(REFUSED_AT_LOAD) | set(REFUSED_AT_FORWARD))
    assert len(SWEEP) >= 0.9 * len(universe)


@pytest.mark.parametrize("model_type", SWEEP)
def test_sweep(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []  # per attention call: whether softcap or sinks reached attnzero
    real = hf.attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("softcap") is not None or kwargs.get("sinks") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "attention", spy)
    outcome, detail = sweep(model_type)
    if model_type in REFUSED_AT_LOAD:
        assert outcome == "load", f"{model_type}: expected a refusal at load, got {outcome}: {detail}"
        assert REFUSED_AT_LOAD[model_type] in str(detail) and "Use attn_implementation='eager'" in str(detail)
    elif model_type in REFUSED_AT_FORWARD:
        keyword = REFUSED_AT_FORWARD[model_type]
        assert outcome == "forward", f"{model_type}: expected a refusal of {keyword}, got {outcome}: {detail}"
        assert str(detail).startswith(f"{keyword}:") and "not support" in str(detail) and "'eager'" in str(detail)
    else:
        assert outcome == "matched", f"{model_type}: {outcome}: {detail}"
    assert any(asked) == (model_type in SOFTCAP_OR_SINKS), (
        f"{model_type}: softcap / sinks {'reached' if any(asked) else 'did not reach'} attnzero"
    )


# ------------------------------------------------------------------------------ the named zoo
def _build(model_type: str, impl: str, cls: type[transformers.PreTrainedModel] | None = None, **extra: Any) -> Any:
    torch.manual_seed(0)
    cls = cls or _head_class(model_type)
    return cls._from_config(tiny_config(model_type, **extra), attn_implementation=impl).eval()


def _each(model: Any, impls: list[str], run: Callable[[], Any]) -> list[Any]:
    """``run()`` once under each implementation, on the same weights."""
    results = []
    for impl in impls:
        model.set_attn_implementation(impl)
        results.append(run())
    return results


def _close(ours: torch.Tensor, theirs: torch.Tensor, rows: Any = slice(None), atol: float = 1e-5) -> None:
    diff = (ours - theirs)[rows].abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.2e} > {atol:g}"


DECODERS = ["gpt2", "gpt_neox", "gptj", "opt", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma",
            "gemma3_text", "phi3", "olmo2", "cohere", "starcoder2", "deepseek_v3"]  # fmt: skip


@pytest.mark.parametrize("model_type", DECODERS)
@torch.no_grad()
def test_decoder_equals_sdpa_and_generates_as_eager(model_type: str) -> None:
    """Left padding: logits against sdpa (the sweep compared eager), then greedy generate() —
    prefill and one query at a time against the growing cache — gives eager's tokens."""
    model = _build(model_type, NAME)
    batch = _batch(model, left=True)
    ours, theirs = _each(model, [NAME, "sdpa"], lambda: model(**batch).logits)
    _close(ours, theirs, batch["attention_mask"].bool())
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    ours, theirs = _each(model, [NAME, "eager"], lambda: model.generate(**batch, **kwargs))
    assert ours.shape == (2, 7 + 4) and torch.equal(ours, theirs)


ENCODERS = ["bert", "roberta", "distilbert", "albert", "electra", "modernbert"]


@pytest.mark.parametrize("model_type", ENCODERS)
@torch.no_grad()
def test_encoder_hidden_states_equal_eager_and_sdpa(model_type: str) -> None:
    model = _build(model_type, NAME, cls=getattr(transformers, modeling_auto.MODEL_MAPPING_NAMES[model_type]))
    batch = _batch(model, left=False)
    ours, eager, sdpa = _each(model, [NAME, "eager", "sdpa"], lambda: model(**batch, output_hidden_states=True))
    real = batch["attention_mask"].bool()
    for theirs in (eager, sdpa):
        for a, b in zip(ours.hidden_states, theirs.hidden_states, strict=True):
            _close(a, b, real)


@pytest.mark.parametrize("model_type", ["bart", "t5"])
@torch.no_grad()
def test_seq2seq_equals_sdpa_and_generates_as_eager(model_type: str) -> None:
    """Encoder padding (right), decoder self-attention with the cache, cross-attention; T5's
    relative position bias arrives as position_bias and is added to the scores."""
    model = _build(model_type, NAME)
    batch = _batch(model, left=False)
    ours, theirs = _each(model, [NAME, "sdpa"], lambda: model(**batch).logits)
    _close(ours, theirs)
    source = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    kwargs = {"max_new_tokens": 4, "do_sample": False, "eos_token_id": None, "decoder_start_token_id": 0}
    ours, theirs = _each(model, [NAME, "eager"], lambda: model.generate(**source, **kwargs))
    assert torch.equal(ours, theirs)


@torch.no_grad()
def test_whisper_equals_eager_and_generates_as_eager() -> None:
    model = _build(
        "whisper", NAME, transformers.WhisperForConditionalGeneration, max_source_positions=8, num_mel_bins=8
    )
    features = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))  # (B, mel bins, 2 × positions)
    decoder = {"decoder_input_ids": torch.tensor([[1, 5, 6, 7], [1, 8, 9, 10]])}
    ours, eager, sdpa = _each(model, [NAME, "eager", "sdpa"], lambda: model(input_features=features, **decoder).logits)
    _close(ours, eager)
    _close(ours, sdpa)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "decoder_start_token_id": 1, "eos_token_id": None}
    ours, theirs = _each(model, [NAME, "eager"], lambda: model.generate(input_features=features, **kwargs))
    assert torch.equal(ours, theirs)


_IMAGE = {"image_size": 32, "patch_size": 8}


@torch.no_grad()
def test_vit_equals_eager_and_sdpa() -> None:
    model = _build("vit", NAME, cls=transformers.ViTForImageClassification, **_IMAGE)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ours, eager, sdpa = _each(model, [NAME, "eager", "sdpa"], lambda: model(pixels).logits)
    _close(ours, eager)
    _close(ours, sdpa)


@pytest.mark.parametrize("model_type", ["clip", "siglip"])
@torch.no_grad()
def test_vision_language_equals_eager_and_sdpa(model_type: str) -> None:
    """The text tower with padding (CLIP's causal text mask), the vision tower over patches."""
    cls = getattr(transformers, modeling_auto.MODEL_MAPPING_NAMES[model_type])
    model = _build(model_type, NAME, cls=cls, vision_config=_IMAGE, text_config={"max_position_embeddings": 16})
    batch = _batch(model, left=False)
    batch["pixel_values"] = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    if model_type == "siglip":  # SigLIP's text tower pools the last position and takes no mask
        batch.pop("attention_mask")
        batch["input_ids"] = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    outputs = _each(model, [NAME, "eager", "sdpa"], lambda: model(**batch))
    for theirs in outputs[1:]:
        _close(outputs[0].logits_per_image, theirs.logits_per_image)
        _close(outputs[0].image_embeds, theirs.image_embeds)


# ----------------------------------------------------------------- attentions and gradients
@pytest.mark.parametrize("model_type", ["bert", "gpt2", "llama", "t5", "vit"])
@torch.no_grad()
def test_output_attentions_equal_eager(model_type: str) -> None:
    if model_type == "vit":
        model = _build("vit", NAME, cls=transformers.ViTModel, **_IMAGE)
        inputs: dict[str, torch.Tensor] = {"pixel_values": torch.randn(2, 3, 32, 32)}
        rows: Any = slice(None)
    else:
        model = _build(model_type, NAME)
        inputs = _batch(model, left=model_type in ("gpt2", "llama"))
        rows = inputs["attention_mask"].bool()[:, None, :, None]  # real query rows
    ours, theirs = _each(model, [NAME, "eager"], lambda: model(**inputs, output_attentions=True))
    names = ["attentions", "encoder_attentions", "decoder_attentions", "cross_attentions"]
    compared = 0
    for name in names:
        for a, b in zip(getattr(ours, name, None) or (), getattr(theirs, name, None) or (), strict=True):
            assert a is not None and a.shape == b.shape
            r = rows if a.shape[-2] == 7 else slice(None)  # decoder rows of T5 are not padded
            _close(a * (r if isinstance(r, torch.Tensor) else 1), b * (r if isinstance(r, torch.Tensor) else 1))
            compared += 1
    assert compared >= 2


@pytest.mark.parametrize("model_type", ["llama", "bert", "t5"])
def test_gradients_equal_eager(model_type: str) -> None:
    """A loss over the padded batch (right padding: no real token is predicted from a padded
    position, whose fully blocked row attnzero answers with 0 where eager averages the padding):
    every parameter's gradient as eager's."""
    model = _build(model_type, NAME)
    batch = _batch(model, left=False)
    labels = batch["decoder_input_ids"] if model.config.is_encoder_decoder else batch["input_ids"]
    labels = labels.masked_fill(labels == 0, -100)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(**batch, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours, theirs = _each(model, [NAME, "eager"], grads)
    assert ours.keys() == theirs.keys() and len(ours) > 10
    for name in ours:
        _close(ours[name], theirs[name], atol=1e-5)
