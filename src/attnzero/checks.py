"""Argument checks for the public entry points.

Each check raises ``ArgumentTypeError`` (wrong kind of thing, wrong dtype) or ``ArgumentError``
(wrong shape or value) with a message that names the argument, what was expected and what was
given. They are ``TypeError`` / ``ValueError`` and also ``RuntimeError``, the class torch raises
for the same misuse (``except RuntimeError`` catches them, as it catches torch's). Checks never
modify anything, so a failed call leaves every tensor, module and cache as it was.

Sizes may be symbolic (``torch.compile`` with dynamic shapes, ``torch.export`` of a batch whose size
depends on the data): a size condition is then decided where the sizes allow it, and otherwise
assumed and left to a runtime assert of the compiled program (see ``holds``), never guessed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .masks import Mask

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ArgumentError(ValueError, RuntimeError):
    """A bad value or shape: a ``ValueError``, and a ``RuntimeError`` like torch's own errors."""


class ArgumentTypeError(TypeError, RuntimeError):
    """A bad kind of argument or dtype: a ``TypeError``, and a ``RuntimeError`` like torch's."""


def _jit_traced() -> ArgumentError:
    return ArgumentError(
        "torch.jit.trace: attnzero cannot be traced to TorchScript (its sizes would be traced as tensors); use "
        "torch.compile or torch.export"
    )


def _guard_or(cond: Any, fallback: bool) -> bool:
    """A symbolic condition decided (and guarded on) where its sizes allow, else ``fallback``. Only
    symbolic sizes come here, and they come with torch.fx's symbolic_shapes already loaded (it is
    not imported with attnzero: it takes a third of a second)."""
    if isinstance(cond, Tensor):  # sizes traced as tensors: torch.jit.trace
        raise _jit_traced()
    from torch.fx.experimental import symbolic_shapes

    name = "guard_or_true" if fallback else "guard_or_false"
    decide = getattr(symbolic_shapes, name, bool)  # torch < 2.7: no sizes that depend on data; bool() guards
    return bool(decide(cond))


def holds(cond: Any) -> bool:
    """A shape condition, as a bool. Plain bools are what they are. A symbolic one is decided when
    the sizes allow it (guarding on sizes that have a value hint); one that depends on data (a
    batch of ``x[keep]`` under ``torch.export``) is taken to hold, and ``torch._check`` makes the
    compiled program assert it when it runs."""
    if isinstance(cond, bool):
        return cond
    if not _guard_or(cond, True):
        return False
    torch._check(cond)
    return True


def known(cond: Any) -> bool:
    """Whether a shape condition is known to hold: plain bools as they are; a symbolic one is
    decided where the sizes allow it, and counts as False where it depends on data (a choice made
    on it must then be right either way)."""
    return cond if isinstance(cond, bool) else _guard_or(cond, False)


def surely(cond: Any) -> bool:
    """Whether a shape condition holds for every size a compiled or exported program may see: plain
    bools as they are; a symbolic one only where it is known without a guard. For a choice that is
    right either way (a shortcut), which must not cut the sizes the program takes (``known`` would
    guard on the example's sizes: an exported program then refuses others)."""
    if isinstance(cond, bool):
        return cond
    if isinstance(cond, Tensor):  # sizes traced as tensors: torch.jit.trace
        raise _jit_traced()
    from torch.fx.experimental import symbolic_shapes

    decide = getattr(symbolic_shapes, "statically_known_true", None)
    return bool(decide(cond)) if decide is not None else False


def is_zero(n: Any) -> bool:
    """Whether a size is known to be 0 (see ``known``: a compiled program whose size depends on
    data learns it when it runs, inside the op; see ``ops.py``)."""
    return known(n == 0)


def tensor(name: str, x: Any, ndim: int | None = None, layout: str = "", empty_ok: bool = False) -> Tensor:
    """``x`` is a floating-point tensor (with ``ndim`` dims when given), non-empty unless ``empty_ok``."""
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:
        raise ArgumentTypeError(
            f"{name}: expected a dense torch.Tensor, got a nested tensor ({x.layout}); pad the sequences and pass "
            "a padding mask, or pack them for az.attention_varlen"
        )
    if ndim is not None and x.ndim != ndim:
        raise ArgumentError(
            f"{name}: expected {ndim} dims {layout}, got {x.ndim} dims of shape {tuple(x.shape)}".replace("  ", " ")
        )
    if x.dtype not in FLOAT_DTYPES:
        raise ArgumentTypeError(
            f"{name}: expected a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}"
        )
    if not empty_ok and is_zero(x.numel()):
        raise ArgumentError(f"{name}: expected a non-empty tensor, got shape {tuple(x.shape)}")
    return x


def same_kind(name: str, x: Tensor, ref_name: str, ref: Tensor, *, dtypes_may_differ: bool = False) -> None:
    """``x`` has ``ref``'s dtype (unless ``dtypes_may_differ``: under autocast) and device."""
    if x.dtype != ref.dtype and not dtypes_may_differ:
        raise ArgumentTypeError(f"{name}: dtype {x.dtype} does not match {ref_name}'s {ref.dtype}")
    if x.device != ref.device:
        raise ArgumentError(f"{name}: device {x.device} does not match {ref_name}'s {ref.device}")


def qkv(q: Any, k: Any, v: Any | None, empty_ok: bool = False) -> tuple[int, int, int, int, int]:
    """q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); with ``empty_ok`` any size may be 0
    (DESIGN.md: the functional API takes zero-size inputs). Returns (B, Hq, Hkv, Lq, Lk).
    (Every call runs this: each shape, dtype and device is read once — a read costs ~0.1 µs.)"""
    layout = "(B, H, L, D)"
    q = tensor("q", q, 4, layout, empty_ok)
    k = tensor("k", k, 4, layout, empty_ok)
    dtype, device = q.dtype, q.device
    if k.dtype != dtype or k.device != device:
        same_kind("k", k, "q", q)  # raises, naming which differs
    B, Hq, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if not holds(Bk == B):
        raise ArgumentError(f"k: batch {Bk} does not match q's {B}")
    if not holds(Dk == D):
        raise ArgumentError(f"k: head dim {Dk} does not match q's {D}")
    groups(Hq, Hkv, "k: expected a number of key/value heads that divides q's {Hq} heads, got {Hkv}")
    if v is not None:
        v = tensor("v", v, 4, layout, empty_ok)
        if v.dtype != dtype or v.device != device:
            same_kind("v", v, "q", q)
        Bv, Hv, Lv, _ = v.shape
        if not holds(Bv == B):
            raise ArgumentError(f"v: batch {Bv} does not match q's {B}")
        if not holds(Hv == Hkv):
            raise ArgumentError(f"v: {Hv} heads do not match k's {Hkv}")
        if not holds(Lv == Lk):
            raise ArgumentError(f"v: length {Lv} does not match k's {Lk}")
    return B, Hq, Hkv, Lq, Lk


def groups(Hq: int, Hkv: int, message: str) -> None:
    """``Hkv`` key/value heads serve ``Hq`` query heads in equal groups: ``Hq % Hkv == 0``. No
    key/value heads serve only no query heads (``Hq = Hkv = 0``). ``message`` is formatted with
    Hq and Hkv."""
    ok = holds(Hq == 0) if is_zero(Hkv) else holds(Hq % Hkv == 0)
    if not ok:
        raise ArgumentError(message.format(Hq=Hq, Hkv=Hkv))


def broadcastable(shape: tuple[Any, ...], full: tuple[Any, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``full`` (each of its dims, aligned from the right, is 1 or
    the full size, and it has no more dims)."""
    if len(shape) > len(full):
        return False
    return all(holds(_either(s == f, s == 1)) for s, f in zip(reversed(shape), reversed(full)))


def _either(a: Any, b: Any) -> Any:
    """``a or b`` for conditions that may be symbolic, without deciding either first."""
    if isinstance(a, bool) and isinstance(b, bool):
        return a or b
    return b | a if isinstance(a, bool) else a | b


def _broadcastable(name: str, shape: tuple[Any, ...], full: tuple[Any, Any, Any, Any]) -> None:
    if not broadcastable(shape, full):
        raise ArgumentError(f"{name}: shape {tuple(shape)} is not broadcastable to (B, Hq, Lq, Lk) = {full}")


def mask(x: Any, full: tuple[int, int, int, int], device: torch.device) -> Tensor | Mask | None:
    """A keep-mask (True / non-zero = may attend): a tensor of any dtype or an ``az.masks.Mask``,
    broadcastable to ``full``. Tensors come back as 4-D bool."""
    if x is None:
        return None
    if isinstance(x, Mask):
        _broadcastable("mask", x.shape, full)
        return x
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"mask: expected a torch.Tensor or an attnzero Mask, got {type(x).__name__}")
    _broadcastable("mask", tuple(x.shape), full)
    if x.device != device:
        raise ArgumentError(f"mask: device {x.device} does not match q's {device}")
    keep = x if x.dtype == torch.bool else x != 0
    return keep.reshape((1,) * (4 - x.ndim) + tuple(x.shape))  # (B|1, H|1, Lq|1, Lk|1)


def bias(x: Any, full: tuple[int, int, int, int], device: torch.device) -> Tensor | None:
    """A float additive term broadcastable to ``full``; comes back 4-D."""
    if x is None:
        return None
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"bias: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ArgumentTypeError(f"bias: expected a floating dtype (a keep-mask goes to mask=), got {x.dtype}")
    _broadcastable("bias", tuple(x.shape), full)
    if x.device != device:
        raise ArgumentError(f"bias: device {x.device} does not match q's {device}")
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))  # (B|1, H|1, Lq|1, Lk|1)


def flag(name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        raise ArgumentTypeError(f"{name}: expected a bool, got {x!r}")
    return x


# Window sides at or above this are unbounded whatever the lengths: no tensor has 2⁶² positions,
# and every side then fits the int64 arithmetic of the backends.
_HUGE = 2**62


def window(x: Any, q_len: int | None = None, kv_len: int | None = None) -> tuple[int | None, int | None] | None:
    """None, an int ``w`` (= (w, 0)), or (left, right) with each None or an int >= 0.

    A side that reaches past every key is unbounded, and comes back as None: with the lengths
    given, a side >= ``q_len + kv_len`` (query ``i`` sits at ``p = i + Lk - Lq`` in ``[Lk - Lq,
    Lk - 1]``, so ``left >= Lk - 1`` and ``right >= Lq - 1`` already keep every key); any side >= 2⁶²
    in any case. The result is the same, and no backend meets an integer too large for int64."""
    if x is None:
        return None
    pair = (x, 0) if isinstance(x, int) and not isinstance(x, bool) else x
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise ArgumentTypeError(f"window: expected None, an int or a (left, right) pair, got {x!r}")
    sides: list[int | None] = []
    for side, w in zip(("left", "right"), pair):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise ArgumentTypeError(f"window: expected {side} to be None or an int, got {w!r}")
        if w is not None and w < 0:
            raise ArgumentError(f"window: expected {side} >= 0 (or None), got {w}")
        reaches_all = w is not None and (
            w >= _HUGE or (q_len is not None and kv_len is not None and surely(w >= q_len + kv_len))
        )
        sides.append(None if reaches_all else w)
    return (sides[0], sides[1])


def scale(x: Any, head_dim: int) -> float:
    """``None`` → 1/sqrt(D) (1 for D = 0, where every score is 0 whatever the scale); otherwise a
    finite real number."""
    if x is None:
        return 1.0 if is_zero(head_dim) else 1.0 / math.sqrt(head_dim)
    if not _real(x):
        raise ArgumentTypeError(f"scale: expected None or a real number, got {x!r}")
    try:
        value = float(x)
    except OverflowError:  # an int beyond float's range
        raise ArgumentError(f"scale: expected a finite float, got an integer of {int(x).bit_length()} bits") from None
    if torch.compiler.is_compiling():  # dynamo sees a size-derived scale as a float it cannot test
        return value
    if not math.isfinite(value):
        raise ArgumentError(f"scale: expected a finite number, got {x}")
    return value


def _real(x: Any) -> bool:
    """A real number that is not a bool: Python's, or a numpy scalar (``np.float32(0.1)``, which torch
    takes as a float)."""
    if isinstance(x, int | float):
        return not isinstance(x, bool)
    return type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0 and x.dtype.kind in "iuf"


def dropout_p(x: Any, name: str = "dropout_p", *, one_ok: bool = False) -> float:
    """A dropout rate in [0, 1) — or [0, 1] with ``one_ok``: a module's rate, which torch's modules take
    as 1 (every weight dropped in training)."""
    span = "[0, 1]" if one_ok else "[0, 1)"
    if not _real(x):
        raise ArgumentTypeError(f"{name}: expected a float in {span}, got {x!r}")
    if not (0.0 <= x <= 1.0 if one_ok else 0.0 <= x < 1.0):
        raise ArgumentError(f"{name}: expected a float in {span}, got {x}")
    return float(x)


def choice(name: str, x: Any, options: tuple[str, ...]) -> str:
    if not isinstance(x, str) or x not in options:
        raise ArgumentError(f"{name}: expected one of {', '.join(map(repr, options))}, got {x!r}")
    return x


def softcap(x: Any) -> float | None:
    """None, or a finite real number > 0 (the cap of ``softcap · tanh(s / softcap)``)."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise ArgumentTypeError(f"softcap: expected None or a float > 0, got {x!r}")
    try:
        value = float(x)
    except OverflowError:
        bits = int(x).bit_length()
        raise ArgumentError(f"softcap: expected a finite float > 0, got an integer of {bits} bits") from None
    if not 0.0 < value < math.inf:  # (comparisons, not math.isfinite: traced, a cap passed in is a symbolic float)
        raise ArgumentError(f"softcap: expected a finite float > 0 (or None), got {x}")
    if not _F32_TINY <= value <= _F32_MAX:  # float32 makes a cap beyond these inf or 0: NaN, or no cap
        raise ArgumentError(
            f"softcap: expected a float in float32's normal range [{_F32_TINY:.4g}, {_F32_MAX:.4g}] (the "
            f"scores are float32), got {x}"
        )
    return value


_F32_TINY, _F32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def sinks(x: Any, B: int, Hq: int, Lq: int, device: torch.device) -> Tensor | None:
    """None, or float logits of shape (Hq,) (one per head) or (B, Hq, Lq) (one per query), on q's
    device."""
    if x is None:
        return None
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"sinks: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ArgumentTypeError(f"sinks: expected a floating dtype, got {x.dtype}")
    shape = tuple(x.shape)
    per_head = len(shape) == 1 and holds(shape[0] == Hq)
    per_query = len(shape) == 3 and all(holds(a == b) for a, b in zip(shape, (B, Hq, Lq)))
    if not (per_head or per_query):
        raise ArgumentError(f"sinks: expected shape (Hq,) = ({Hq},) or (B, Hq, Lq) = ({B}, {Hq}, {Lq}), got {shape}")
    if x.device != device:
        raise ArgumentError(f"sinks: device {x.device} does not match q's {device}")
    return x
