"""Bad input: every public entry point raises ValueError/TypeError naming the argument, what was
expected and what was given, before doing any work and without changing any state."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnzero as az

B, HQ, HKV, LQ, LK, D, DV = 2, 4, 2, 5, 7, 16, 8


def q_() -> torch.Tensor:
    return torch.randn(B, HQ, LQ, D)


def k_() -> torch.Tensor:
    return torch.randn(B, HKV, LK, D)


def v_() -> torch.Tensor:
    return torch.randn(B, HKV, LK, DV)


def call_attention(**over: Any) -> Any:
    args = {"q": q_(), "k": k_(), "v": v_()}
    kw = {n: over.pop(n) for n in list(over) if n in args}
    args.update(kw)
    return az.attention(args["q"], args["k"], args["v"], **over)


def call_weights(**over: Any) -> Any:
    args = {"q": q_(), "k": k_()}
    args.update({n: over.pop(n) for n in list(over) if n in args})
    return az.attention_weights(args["q"], args["k"], **over)


# (case id, overrides, exception type, message regex). The message names the argument first.
QK_CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("q_not_tensor", {"q": [[1.0]]}, TypeError, r"q: expected a torch\.Tensor, got list"),
    ("k_not_tensor", {"k": 3.0}, TypeError, r"k: expected a torch\.Tensor, got float"),
    (
        "q_3_dims",
        {"q": torch.randn(B, LQ, D)},
        ValueError,
        r"q: expected 4 dims \(B, H, L, D\), got 3 dims of shape \(2, 5, 16\)",
    ),
    ("k_5_dims", {"k": torch.randn(1, B, HKV, LK, D)}, ValueError, r"k: expected 4 dims .*got 5 dims"),
    (
        "q_integer",
        {"q": torch.ones(B, HQ, LQ, D, dtype=torch.int64)},
        TypeError,
        r"q: expected a floating dtype .*got torch\.int64",
    ),
    (
        "k_bool",
        {"k": torch.ones(B, HKV, LK, D, dtype=torch.bool)},
        TypeError,
        r"k: expected a floating dtype .*got torch\.bool",
    ),
    (
        "mixed_dtypes",
        {"k": torch.randn(B, HKV, LK, D, dtype=torch.float64)},
        TypeError,
        r"k: dtype torch\.float64 does not match q's torch\.float32",
    ),
    (
        "mixed_devices",
        {"k": torch.empty(B, HKV, LK, D, device="meta")},
        ValueError,
        r"k: device meta does not match q's cpu",
    ),
    ("batch_mismatch", {"k": torch.randn(3, HKV, LK, D)}, ValueError, r"k: batch 3 does not match q's 2"),
    ("head_dim_mismatch", {"k": torch.randn(B, HKV, LK, 8)}, ValueError, r"k: head dim 8 does not match q's 16"),
    (
        "heads_not_dividing",
        {"k": torch.randn(B, 3, LK, D)},
        ValueError,
        r"k: expected a number of key/value heads that divides q's 4 heads, got 3",
    ),
    (
        "mask_not_broadcastable",
        {"mask": torch.ones(3, LK, dtype=torch.bool)},
        ValueError,
        r"mask: shape \(3, 7\) is not broadcastable to \(B, Hq, Lq, Lk\) = \(2, 4, 5, 7\)",
    ),
    (
        "mask_5_dims",
        {"mask": torch.ones(1, B, HQ, LQ, LK, dtype=torch.bool)},
        ValueError,
        r"mask: shape \(1, 2, 4, 5, 7\) is not broadcastable",
    ),
    (
        "mask_wrong_builder",
        {"mask": az.masks.causal(LQ + 1, LK)},
        ValueError,
        r"mask: shape \(1, 1, 6, 7\) is not broadcastable",
    ),
    ("mask_not_tensor", {"mask": [[True]]}, TypeError, r"mask: expected a torch\.Tensor or an attnzero Mask, got list"),
    (
        "mask_device",
        {"mask": torch.ones(LQ, LK, dtype=torch.bool, device="meta")},
        ValueError,
        r"mask: device meta does not match q's cpu",
    ),
    (
        "bias_not_broadcastable",
        {"bias": torch.randn(B, 3, LQ, LK)},
        ValueError,
        r"bias: shape \(2, 3, 5, 7\) is not broadcastable to \(B, Hq, Lq, Lk\) = \(2, 4, 5, 7\)",
    ),
    (
        "bias_integer",
        {"bias": torch.ones(LQ, LK, dtype=torch.int32)},
        TypeError,
        r"bias: expected a floating dtype .*got torch\.int32",
    ),
    (
        "bias_bool",
        {"bias": torch.ones(LQ, LK, dtype=torch.bool)},
        TypeError,
        r"bias: expected a floating dtype \(a keep-mask goes to mask=\), got torch\.bool",
    ),
    ("bias_not_tensor", {"bias": 0.5}, TypeError, r"bias: expected a torch\.Tensor, got float"),
    ("negative_window", {"window": -1}, ValueError, r"window: expected left >= 0 \(or None\), got -1"),
    ("negative_window_right", {"window": (2, -3)}, ValueError, r"window: expected right >= 0 \(or None\), got -3"),
    ("window_not_int", {"window": (1.5, 0)}, TypeError, r"window: expected left to be None or an int, got 1\.5"),
    (
        "window_triple",
        {"window": (1, 2, 3)},
        TypeError,
        r"window: expected None, an int or a \(left, right\) pair, got \(1, 2, 3\)",
    ),
    ("scale_inf", {"scale": float("inf")}, ValueError, r"scale: expected a finite number, got inf"),
    ("scale_nan", {"scale": float("nan")}, ValueError, r"scale: expected a finite number, got nan"),
    ("scale_not_number", {"scale": "0.1"}, TypeError, r"scale: expected None or a real number, got '0\.1'"),
    ("scale_tensor", {"scale": torch.tensor(0.1)}, TypeError, r"scale: expected None or a real number, got tensor"),
    (
        "scale_huge_int",
        {"scale": 10**400},
        ValueError,
        r"scale: expected a finite float, got an integer of 1329 bits",
    ),
    (
        "no_kv_heads",
        {"k": torch.randn(B, 0, LK, D)},
        ValueError,
        r"k: expected a number of key/value heads that divides q's 4 heads, got 0",
    ),
    ("causal_not_bool", {"causal": "yes"}, TypeError, r"causal: expected a bool, got 'yes'"),
]

ATTN_ONLY_CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("v_not_tensor", {"v": None}, TypeError, r"v: expected a torch\.Tensor, got NoneType"),
    ("v_length_mismatch", {"v": torch.randn(B, HKV, LK - 1, DV)}, ValueError, r"v: length 6 does not match k's 7"),
    ("v_heads_mismatch", {"v": torch.randn(B, 1, LK, DV)}, ValueError, r"v: 1 heads do not match k's 2"),
    ("v_batch_mismatch", {"v": torch.randn(1, HKV, LK, DV)}, ValueError, r"v: batch 1 does not match q's 2"),
    (
        "v_dtype",
        {"v": torch.randn(B, HKV, LK, DV).half()},
        TypeError,
        r"v: dtype torch\.float16 does not match q's torch\.float32",
    ),
    (
        "v_integer",
        {"v": torch.ones(B, HKV, LK, DV, dtype=torch.int8)},
        TypeError,
        r"v: expected a floating dtype .*got torch\.int8",
    ),
    ("dropout_one", {"dropout_p": 1.0}, ValueError, r"dropout_p: expected a float in \[0, 1\), got 1\.0"),
    ("dropout_negative", {"dropout_p": -0.1}, ValueError, r"dropout_p: expected a float in \[0, 1\), got -0\.1"),
    ("dropout_not_number", {"dropout_p": "0.1"}, TypeError, r"dropout_p: expected a float in \[0, 1\), got '0\.1'"),
    ("unknown_backend", {"backend": "fast"}, ValueError, r"backend: expected one of 'auto', 'reference', .*got 'fast'"),
    ("return_lse_not_bool", {"return_lse": 1}, TypeError, r"return_lse: expected a bool, got 1"),
    ("sinks_other_device", {"sinks": torch.zeros(HQ, device="meta")}, ValueError, r"sinks: device meta does not match"),
    ("sinks_wrong_heads", {"sinks": torch.zeros(HQ + 1)}, ValueError, r"sinks: expected shape \(Hq,\) = \(4,\)"),
    ("sinks_batch_of_one", {"sinks": torch.zeros(1, HQ, LQ)}, ValueError, r"sinks: expected shape .*\(1, 4, 5\)"),
    ("bias_other_device", {"bias": torch.zeros(LQ, LK, device="meta")}, ValueError, r"bias: device meta does not"),
]


def _ids(cases: list[tuple[Any, ...]]) -> list[str]:
    return [c[0] for c in cases]


@pytest.mark.parametrize(
    ("case", "over", "exc", "msg"), QK_CASES + ATTN_ONLY_CASES, ids=_ids(QK_CASES + ATTN_ONLY_CASES)
)
def test_attention_bad_input(case: str, over: dict[str, Any], exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        call_attention(**over)


@pytest.mark.parametrize(("case", "over", "exc", "msg"), QK_CASES, ids=_ids(QK_CASES))
def test_attention_weights_bad_input(case: str, over: dict[str, Any], exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        call_weights(**over)


def test_attention_weights_takes_no_value_or_dropout() -> None:
    with pytest.raises(TypeError):
        az.attention_weights(q_(), k_(), dropout_p=0.1)  # type: ignore[call-arg]


def test_validation_happens_before_any_work() -> None:
    """A bad late argument (backend) raises before any tensor is touched: inputs are unchanged and
    no graph is built."""
    q = q_().requires_grad_()
    before = q.detach().clone()
    with pytest.raises(ValueError, match="backend"):
        az.attention(q, k_(), v_(), backend="nope")
    assert q.grad is None and torch.equal(q.detach(), before)


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention: the messages name query / key / value / attn_mask


def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


SDPA_CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "query_not_tensor",
        lambda: az.scaled_dot_product_attention([1.0], t(2, 3), t(2, 3)),
        TypeError,
        r"query: expected a torch\.Tensor, got list",
    ),
    (
        "key_1_dim",
        lambda: az.scaled_dot_product_attention(t(2, 3), t(3), t(2, 3)),
        ValueError,
        r"key: expected at least 2 dims \(\.\.\., L, E\), got 1\. torch: Expected query, key, and value to all be  "
        r"at least 2 dimensional, but got query\.dim: 2 key\.dim: 1 and value\.dim: 2 instead\.",
    ),
    (
        "value_integer",
        lambda: az.scaled_dot_product_attention(t(2, 3), t(2, 3), torch.ones(2, 3, dtype=torch.long)),
        TypeError,
        r"value: expected a floating dtype .*got torch\.int64",
    ),
    (
        "heads_without_gqa",
        lambda: az.scaled_dot_product_attention(t(2, 4, 5, 8), t(2, 2, 7, 8), t(2, 2, 7, 8)),
        RuntimeError,
        r"key: leading dims \(2, 2\) do not broadcast with query's at dim 1 \(2 against 4\)\. torch: The size of "
        r"tensor a \(4\) must match the size of tensor b \(2\) at non-singleton dimension 1",
    ),
    (
        "gqa_not_dividing",
        lambda: az.scaled_dot_product_attention(t(2, 4, 5, 8), t(2, 3, 7, 8), t(2, 3, 7, 8), enable_gqa=True),
        ValueError,
        r"key: expected a number of heads that divides query's 4 \(enable_gqa\), got 3\. torch: Number of heads in "
        r"key and value must divide the number of heads in query",
    ),
    (
        "batch_dims",
        lambda: az.scaled_dot_product_attention(t(2, 4, 5, 8), t(3, 4, 7, 8), t(3, 4, 7, 8)),
        ValueError,
        r"key: leading dims \(3, 4\) do not broadcast with query's at dim 0 \(3 against 2\)",
    ),
    (
        "head_dim",
        lambda: az.scaled_dot_product_attention(t(2, 4, 5, 8), t(2, 4, 7, 6), t(2, 4, 7, 8)),
        ValueError,
        r"key: head dim 6 does not match query's 8",
    ),
    (
        "value_length",
        lambda: az.scaled_dot_product_attention(t(2, 4, 5, 8), t(2, 4, 7, 8), t(2, 4, 6, 8)),
        ValueError,
        r"value: length 6 does not match key's 7",
    ),
    (
        "dtypes",
        lambda: az.scaled_dot_product_attention(t(2, 5, 8), t(2, 7, 8, dtype=torch.float64), t(2, 7, 8)),
        TypeError,
        r"key: dtype torch\.float64 does not match query's torch\.float32\. torch: Expected query, key, and value to "
        r"have the same dtype, but got query\.dtype: float key\.dtype: double and value\.dtype: float instead\.",
    ),
    (
        "devices",
        lambda: az.scaled_dot_product_attention(t(2, 5, 8), t(2, 7, 8), torch.empty(2, 7, 8, device="meta")),
        ValueError,
        r"value: device meta does not match query's cpu\. torch: Expected query, key, and value to have the same "
        r"device type, but got query\.device: cpu key\.device: cpu and value\.device: meta instead\.",
    ),
    (
        "mask_not_broadcastable",
        lambda: az.scaled_dot_product_attention(
            t(2, 4, 5, 8), t(2, 4, 7, 8), t(2, 4, 7, 8), attn_mask=torch.ones(3, 7, dtype=torch.bool)
        ),
        ValueError,
        r"attn_mask: shape \(3, 7\) is not broadcastable to \(2, 4, 5, 7\)",
    ),
    (
        "float_mask_not_broadcastable",
        lambda: az.scaled_dot_product_attention(t(3, 5, 8), t(3, 7, 8), t(3, 7, 8), attn_mask=torch.zeros(2, 5, 7)),
        ValueError,
        r"attn_mask: shape \(2, 5, 7\) is not broadcastable to \(3, 5, 7\)",
    ),
    (
        "mask_5d_not_broadcastable",
        lambda: az.scaled_dot_product_attention(
            t(2, 3, 4, 5, 8), t(2, 3, 4, 7, 8), t(2, 3, 4, 7, 8), attn_mask=torch.ones(3, 5, 7, dtype=torch.bool)
        ),
        ValueError,
        r"attn_mask: shape \(3, 5, 7\) is not broadcastable to \(2, 3, 4, 5, 7\)",
    ),
    (
        "mask_integer",
        lambda: az.scaled_dot_product_attention(
            t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), attn_mask=torch.ones(5, 7, dtype=torch.long)
        ),
        TypeError,
        r"attn_mask: expected a bool or floating tensor, got torch\.int64",
    ),
    (
        "mask_dtype",
        lambda: az.scaled_dot_product_attention(
            t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), attn_mask=torch.zeros(5, 7, dtype=torch.float64)
        ),
        TypeError,
        r"attn_mask: expected dtype bool, float32 or query's torch\.float32, got torch\.float64",
    ),
    (
        "mask_with_is_causal",
        lambda: az.scaled_dot_product_attention(
            t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), attn_mask=torch.ones(5, 7, dtype=torch.bool), is_causal=True
        ),
        ValueError,
        r"is_causal: expected False when attn_mask is given \(as torch\), got True",
    ),
    (
        "causal_bias_with_is_causal",
        lambda: az.scaled_dot_product_attention(
            t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), attn_mask=causal_upper_left(5, 7), is_causal=True
        ),
        ValueError,
        r"is_causal: expected False with a CausalBias attn_mask \(it is the causal pattern already\), got True",
    ),
    (
        "causal_bias_lengths",
        lambda: az.scaled_dot_product_attention(t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), attn_mask=causal_lower_right(5, 6)),
        ValueError,
        r"attn_mask: a CausalBias of \(L, S\) = \(5, 6\) does not match query's and key's lengths \(5, 7\)",
    ),
    (
        "mask_not_tensor",
        lambda: az.scaled_dot_product_attention(t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), attn_mask=[[True]]),
        TypeError,
        r"attn_mask: expected a torch\.Tensor, got list",
    ),
    (
        "dropout",
        lambda: az.scaled_dot_product_attention(t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), dropout_p=1.5),
        ValueError,
        r"dropout_p: expected a float in \[0, 1\), got 1\.5",
    ),
    (
        "scale",
        lambda: az.scaled_dot_product_attention(t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), scale=float("-inf")),
        ValueError,
        r"scale: expected a finite number, got -inf",
    ),
    (
        "is_causal",
        lambda: az.scaled_dot_product_attention(t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), is_causal=None),
        TypeError,
        r"is_causal: expected a bool, got None",
    ),
    (
        "enable_gqa",
        lambda: az.scaled_dot_product_attention(t(2, 5, 8), t(2, 7, 8), t(2, 7, 8), enable_gqa="no"),
        TypeError,
        r"enable_gqa: expected a bool, got 'no'",
    ),
]


@pytest.mark.parametrize(("case", "call", "exc", "msg"), SDPA_CASES, ids=_ids(SDPA_CASES))
def test_sdpa_bad_input(case: str, call: Callable[[], Any], exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        call()


# ---------------------------------------------------------------------------------------------
# Error classes: torch raises RuntimeError for a mismatch of shapes, dtypes or devices; attnzero's
# errors are ValueError / TypeError and RuntimeError too, so code written for either catches them.


def test_error_classes() -> None:
    assert issubclass(az.ArgumentError, ValueError) and issubclass(az.ArgumentError, RuntimeError)
    assert issubclass(az.ArgumentTypeError, TypeError) and issubclass(az.ArgumentTypeError, RuntimeError)


@pytest.mark.parametrize(
    ("case", "over", "exc", "msg"), QK_CASES + ATTN_ONLY_CASES, ids=_ids(QK_CASES + ATTN_ONLY_CASES)
)
def test_attention_bad_input_is_a_runtime_error(
    case: str, over: dict[str, Any], exc: type[Exception], msg: str
) -> None:
    with pytest.raises(RuntimeError, match=msg) as info:
        call_attention(**over)
    assert isinstance(info.value, exc)


@pytest.mark.parametrize(("case", "call", "exc", "msg"), SDPA_CASES, ids=_ids(SDPA_CASES))
def test_sdpa_bad_input_is_a_runtime_error(case: str, call: Callable[[], Any], exc: type[Exception], msg: str) -> None:
    with pytest.raises(RuntimeError, match=msg) as info:
        call()
    assert isinstance(info.value, exc)


# Misuse that torch's own function answers with a RuntimeError: ``except RuntimeError`` catches
# attnzero's drop-in the same way.
TORCH_MISUSE: dict[str, Callable[[], tuple[tuple[torch.Tensor, ...], dict[str, Any]]]] = {
    "head_dim": lambda: ((t(2, 4, 5, 8), t(2, 4, 7, 6), t(2, 4, 7, 8)), {}),
    "heads": lambda: ((t(2, 4, 5, 8), t(2, 2, 7, 8), t(2, 2, 7, 8)), {}),
    "batch": lambda: ((t(2, 4, 5, 8), t(3, 4, 7, 8), t(3, 4, 7, 8)), {}),
    "gqa_not_dividing": lambda: ((t(2, 4, 5, 8), t(2, 3, 7, 8), t(2, 3, 7, 8)), {"enable_gqa": True}),
    "dtype": lambda: ((t(2, 5, 8), t(2, 7, 8, dtype=torch.float64), t(2, 7, 8)), {}),
    "integer_value": lambda: ((t(2, 5, 8), t(2, 7, 8), torch.ones(2, 7, 8, dtype=torch.long)), {}),
    "device": lambda: ((t(2, 5, 8), t(2, 7, 8), torch.empty(2, 7, 8, device="meta")), {}),
    "mask_shape": lambda: ((t(2, 4, 5, 8), t(2, 4, 7, 8), t(2, 4, 7, 8)), {"attn_mask": torch.ones(3, 7) > 0}),
    "mask_dtype": lambda: ((t(2, 5, 8), t(2, 7, 8), t(2, 7, 8)), {"attn_mask": torch.zeros(5, 7).half()}),
    "mask_integer": lambda: ((t(2, 5, 8), t(2, 7, 8), t(2, 7, 8)), {"attn_mask": torch.ones(5, 7).long()}),
    "mask_device": lambda: ((t(2, 5, 8), t(2, 7, 8), t(2, 7, 8)), {"attn_mask": torch.ones(5, 7, device="meta")}),
    "causal_bias_lengths": lambda: ((t(2, 5, 8), t(2, 7, 8), t(2, 7, 8)), {"attn_mask": causal_lower_right(5, 6)}),
}


@pytest.mark.parametrize("fn", [F.scaled_dot_product_attention, az.scaled_dot_product_attention], ids=["torch", "az"])
@pytest.mark.parametrize("case", list(TORCH_MISUSE))
def test_misuse_is_a_runtime_error_as_in_torch(fn: Callable[..., torch.Tensor], case: str) -> None:
    args, kw = TORCH_MISUSE[case]()
    with pytest.raises(RuntimeError):
        fn(*args, **kw)


# ---------------------------------------------------------------------------------------------
# Integers beyond int64 (window sides, scale): a clear error or their meaning, never OverflowError


@pytest.mark.parametrize(
    ("window", "same_as"),
    [
        (2**63, (None, 0)),
        ((2**63, 0), (None, 0)),
        ((1, 2**64), (1, None)),
        ((10**30, 10**30), None),
        ((None, 2**70), None),
        ((LQ + LK, LQ + LK), None),  # reaching past every key already
        ((LK - 2, 1), (LK - 2, 1)),  # and a window that blocks something stays as it is
    ],
)
@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_huge_window_sides_are_unbounded(
    window: Any, same_as: tuple[int | None, int | None] | None, backend: str
) -> None:
    q, k, v = q_(), k_(), v_()
    out = az.attention(q, k, v, window=window, backend=backend)
    torch.testing.assert_close(out, az.attention(q, k, v, window=same_as, backend=backend))
    torch.testing.assert_close(az.attention_weights(q, k, window=window), az.attention_weights(q, k, window=same_as))


def test_window_check_normalises_sides_that_reach_every_key() -> None:
    from attnzero import checks

    assert checks.window(2**63) == (None, 0)
    assert checks.window((2**62, 2**100)) == (None, None)
    assert checks.window((12, 3), 5, 7) == (None, 3)  # left >= Lq + Lk: every key
    assert checks.window((11, 12), 5, 7) == (11, None)
    assert checks.window([2, 1], 5, 7) == (2, 1)



# ---------------------------------------------------------------------------------------------
# ScaledDotProductAttention (seed 002)

SDPA_MODULE_CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "Q_not_tensor",
        lambda: az.ScaledDotProductAttention()([1.0], t(2, 3, 4), t(2, 3, 4)),
        TypeError,
        r"Q: expected a torch\.Tensor, got list",
    ),
    (
        "Q_1_dim",
        lambda: az.ScaledDotProductAttention()(t(4), t(2, 3, 4), t(2, 3, 4)),
        ValueError,
        r"Q: expected at least 2 dims \(\.\.\., L, d\), got 1",
    ),
    (
        "V_integer",
        lambda: az.ScaledDotProductAttention()(t(2, 3, 4), t(2, 3, 4), torch.ones(2, 3, 4, dtype=torch.int32)),
        TypeError,
        r"V: expected a floating dtype .*got torch\.int32",
    ),
    (
        "K_last_dim",
        lambda: az.ScaledDotProductAttention()(t(2, 3, 4), t(2, 3, 5), t(2, 3, 4)),
        ValueError,
        r"K: last dim 5 does not match Q's 4",
    ),
    (
        "V_length",
        lambda: az.ScaledDotProductAttention()(t(2, 3, 4), t(2, 3, 4), t(2, 5, 4)),
        ValueError,
        r"V: length 5 does not match K's 3",
    ),
    (
        "leading_dims",
        lambda: az.ScaledDotProductAttention()(t(2, 3, 4), t(3, 3, 4), t(3, 3, 4)),
        ValueError,
        r"K, V: leading dims \(3,\), \(3,\) do not broadcast with Q's \(2,\)",
    ),
    (
        "dtypes",
        lambda: az.ScaledDotProductAttention()(t(2, 3, 4), t(2, 3, 4, dtype=torch.float64), t(2, 3, 4)),
        TypeError,
        r"K: dtype torch\.float64 does not match Q's torch\.float32",
    ),
    (
        "mask_shape",
        lambda: az.ScaledDotProductAttention()(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), mask=torch.ones(4, 3)),
        ValueError,
        r"mask: shape \(4, 3\) is not broadcastable to \(2, 3, 3\)",
    ),
    (
        "mask_not_tensor",
        lambda: az.ScaledDotProductAttention()(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), mask=[[1]]),
        TypeError,
        r"mask: expected a torch\.Tensor, got list",
    ),
    ("d_k_zero", lambda: az.ScaledDotProductAttention(0), ValueError, r"d_k: expected None or a positive int, got 0"),
    (
        "d_k_float",
        lambda: az.ScaledDotProductAttention(64.0),
        ValueError,
        r"d_k: expected None or a positive int, got 64\.0",
    ),  # type: ignore[arg-type]
    (
        "dropout",
        lambda: az.ScaledDotProductAttention(4, dropout=1.5),
        ValueError,
        r"dropout: expected a float in \[0, 1\], got 1\.5",
    ),
]


@pytest.mark.parametrize(("case", "call", "exc", "msg"), SDPA_MODULE_CASES, ids=_ids(SDPA_MODULE_CASES))
def test_sdpa_module_bad_input(case: str, call: Callable[[], Any], exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        call()


# ---------------------------------------------------------------------------------------------
# MultiHeadAttention (seed 000)

CTOR_CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("num_heads_zero", {"num_heads": 0}, ValueError, r"num_heads: expected a positive int, got 0"),
    ("num_heads_negative", {"num_heads": -4}, ValueError, r"num_heads: expected a positive int, got -4"),
    ("d_model_not_int", {"d_model": 32.0}, ValueError, r"d_model: expected a positive int, got 32\.0"),
    (
        "not_divisible",
        {"d_model": 30},
        ValueError,
        r"num_heads: expected a divisor of d_model 30, got 4",
    ),  # the seed asserts
    (
        "kv_heads_not_dividing",
        {"num_kv_heads": 3},
        ValueError,
        r"num_kv_heads: expected a divisor of num_heads 4, got 3",
    ),
    ("kv_heads_zero", {"num_kv_heads": 0}, ValueError, r"num_kv_heads: expected None or a positive int, got 0"),
    ("kdim_zero", {"kdim": 0}, ValueError, r"kdim: expected None or a positive int, got 0"),
    ("vdim_negative", {"vdim": -1}, ValueError, r"vdim: expected None or a positive int, got -1"),
    ("dropout", {"dropout": 1.5}, ValueError, r"dropout: expected a float in \[0, 1\], got 1\.5"),
    ("backend", {"backend": "fast"}, ValueError, r"backend: expected one of .*got 'fast'"),
]


@pytest.mark.parametrize(("case", "over", "exc", "msg"), CTOR_CASES, ids=_ids(CTOR_CASES))
def test_mha_constructor_bad_input(case: str, over: dict[str, Any], exc: type[Exception], msg: str) -> None:
    kw: dict[str, Any] = {"d_model": 32, "num_heads": 4} | over
    with pytest.raises(exc, match=msg):
        az.MultiHeadAttention(**kw)


def x_(L: int = 3, E: int = 32, B: int = 2) -> torch.Tensor:
    return torch.randn(B, L, E)


FORWARD_CASES: list[tuple[str, Callable[[az.MultiHeadAttention], Any], type[Exception], str]] = [
    ("query_not_tensor", lambda m: m("x"), TypeError, r"query: expected a torch\.Tensor, got str"),
    (
        "query_2_dims",
        lambda m: m(torch.randn(3, 32)),
        ValueError,
        r"query: expected 3 dims \(B, L, d_model\), got 2 dims of shape \(3, 32\)",
    ),
    ("query_last_dim", lambda m: m(x_(E=16)), ValueError, r"query: expected last dim 32, got 16"),
    ("key_last_dim", lambda m: m(x_(), x_(5, 16), x_(5)), ValueError, r"key: expected last dim 32, got 16"),
    ("value_last_dim", lambda m: m(x_(), x_(5), x_(5, 8)), ValueError, r"value: expected last dim 32, got 8"),
    (
        "query_integer",
        lambda m: m(torch.ones(2, 3, 32, dtype=torch.long)),
        TypeError,
        r"query: expected a floating dtype .*got torch\.int64",
    ),
    (
        "query_dtype",
        lambda m: m(x_().double()),
        TypeError,
        r"query: dtype torch\.float64 does not match W_q\.weight's torch\.float32",
    ),
    (
        "key_device",
        lambda m: m(x_(), torch.empty(2, 5, 32, device="meta")),
        ValueError,
        r"key: device meta does not match W_q\.weight's cpu",
    ),
    ("batch", lambda m: m(x_(), x_(5, B=3), x_(5, B=3)), ValueError, r"key, value: batch 3, 3 do not match query's 2"),
    ("value_length", lambda m: m(x_(), x_(5), x_(6)), ValueError, r"value: length 6 does not match key's 5"),
    (
        "mask_shape",
        lambda m: m(x_(), mask=torch.ones(3, 4)),
        ValueError,
        r"mask: shape \(3, 4\) is not broadcastable to \(B, Hq, Lq, Lk\) = \(2, 4, 3, 3\)",
    ),
    (
        "key_padding_mask_shape",
        lambda m: m(x_(), key_padding_mask=torch.ones(2, 4, dtype=torch.bool)),
        ValueError,
        r"key_padding_mask: expected shape \(B, Lk\) = \(2, 3\), got \(2, 4\)",
    ),
    (
        "key_padding_mask_type",
        lambda m: m(x_(), key_padding_mask=[[True]]),
        TypeError,
        r"key_padding_mask: expected a torch\.Tensor, got list",
    ),
    ("causal", lambda m: m(x_(), causal=1), TypeError, r"causal: expected a bool, got 1"),
    ("need_weights", lambda m: m(x_(), need_weights="yes"), TypeError, r"need_weights: expected a bool, got 'yes'"),
]


@pytest.mark.parametrize(("case", "call", "exc", "msg"), FORWARD_CASES, ids=_ids(FORWARD_CASES))
def test_mha_forward_bad_input_leaves_module_unchanged(
    case: str, call: Callable[[az.MultiHeadAttention], Any], exc: type[Exception], msg: str
) -> None:
    m = az.MultiHeadAttention(32, 4)  # training mode, parameters requiring grad
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    buffers = {n: b.clone() for n, b in m.named_buffers()}
    with pytest.raises(exc, match=msg):
        call(m)
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} changed"
        assert p.grad is None, f"{n} got a gradient"
    for n, b in m.named_buffers():
        assert torch.equal(b, buffers[n]), f"buffer {n} changed"
    assert m.training
    out = m.eval()(x_())  # and it still works
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 32)


def test_messages_name_expected_and_given() -> None:
    """The example message of issue 2, verbatim."""
    with pytest.raises(ValueError, match=re.escape("k: head dim 8 does not match q's 16")):
        az.attention(torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))


def test_torchs_causal_bias_is_refused_as_a_mask_or_bias() -> None:
    """A CausalBias is a tensor whose data is not its pattern (uninitialised memory of its own shape):
    the mask and bias slots took it as it is — a result that changed with that memory. The drop-in
    reads one (its attn_mask); az.attention refuses it by name, pointing to causal=True."""
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 6, 8)
    for slot in ("mask", "bias"):
        with pytest.raises(TypeError, match=rf"{slot}: expected a tensor or an az.masks Mask, got torch's CausalBias"):
            az.attention(q, k, k, **{slot: causal_lower_right(4, 6)})
    torch.testing.assert_close(
        az.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(4, 6)), az.attention(q, k, k, causal=True)
    )


def test_the_drop_in_refuses_value_heads_beside_no_key_heads() -> None:
    """enable_gqa with key 0 heads and value 3 (query 0): each count divides Hq = 0, and spreading 3
    heads over 0 divided by zero (torch's own call dies of SIGFPE)."""
    q, k, v = torch.randn(1, 0, 1, 2), torch.randn(1, 0, 3, 2), torch.randn(1, 3, 3, 2)
    with pytest.raises(ValueError, match="value: 3 heads cannot be grouped with key's 0"):
        az.scaled_dot_product_attention(q, k, v, enable_gqa=True)
