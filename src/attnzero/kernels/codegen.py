"""Triton code generated from the user's ``score_mod`` / ``mask_mod`` (the same Python function every
other backend calls).

How: the mod is traced once for one pair with ``make_fx`` (0-d float32 ``score``, 0-d int32 ``b``,
``h``, ``q_idx``, ``kv_idx``; indexing by tensors goes to ``aten.index`` as in ``mods.py``) into an
aten graph, and each node of the graph becomes one line of a ``@triton.jit`` function that computes
the same thing for a whole block of pairs (Triton broadcasts the block's ``q_idx`` column against its
``kv_idx`` row). The kernels take that function as a ``tl.constexpr`` argument (``SCORE_MOD``,
``MASK_MOD``), so each kernel stays one kernel, compiled once per mod; without a mod they get the
identity of ``forward.py`` behind ``HAS_MOD=False`` and compile as before.

* Tensors the mod captures (closures, globals, Parameters, a table made inside it) are passed to the
  kernels as one tuple of pointers (``CAP``: Triton takes tuples of tensors, so any number of them
  and no fixed maximum); ``table[h, q_idx - kv_idx + L - 1]`` becomes ``tl.load(CAP[i] + offset)``
  with the offset from the tensor's (contiguous) strides, a negative index wrapped as torch wraps
  it, and a masked load (other 0) where an index is out of range — torch raises there; a Triton
  kernel cannot, and the pairs of a block past Lq / Lk, whose scores are thrown away, do index out
  of range (the CPU kernel's C++, which runs only real pairs, reports it and raises IndexError).
  Shapes and strides are written into the source: a new table shape is a new function.
* The backward (``SCORE_MOD_BWD``) is the graph differentiated here, node by node, in reverse
  (``_Backward``; the derivative rules are torch's, ``derivatives.yaml``): it returns
  ``d score_mod / d score · dy`` and, for each load of a captured tensor that requires grad, adds its
  share ``∂y/∂value · dy`` into a float32 gradient buffer of the tensor's shape at the offset the load
  read (``tl.atomic_add``; summed over the block first when the offset is the same for every pair of
  the block, as for ``slopes[h]``). Only the dK/dV kernel accumulates (``ACCUMULATE``), so the
  separate dQ kernel of the deterministic backward does not count them twice.
* A ``mask_mod`` becomes a predicate ``MASK_MOD(b, h, q_idx, kv_idx, CAP) -> bool`` (no backward),
  which the kernels apply per element (``forward.mod_scores``): ``triton_backend.generate_mask``
  passes it for a ``Mask`` from ``masks.from_mod`` (and a BlockMask, gated by its block table)
  instead of materialising the mask; one that cannot be generated is materialised as before.

What is generated (``OPS``): elementwise arithmetic (add, sub, rsub, mul, div with every rounding
mode, neg, abs, pow with a scalar, square, reciprocal, exp, exp2, log, log2, sqrt, rsqrt, tanh,
sigmoid, sin, cos, floor, ceil, sign), integer ``//`` and ``%`` with torch's (floor) semantics for
negative operands, minimum / maximum / clamp (NaN propagating as in torch), where, comparisons,
logical and bitwise and / or / xor / not, dtype casts, 0-d constants (``full``, ``scalar_tensor``,
``new_zeros``, ``torch.tensor(2.0)``, ...), ``detach`` / ``clone``, and reading captured tensors by
``select`` and by index tensors. Anything else — a reduction or ``torch.dot`` over a captured tensor,
``cumsum``, an op on a whole captured tensor, data-dependent control flow, ``.item()`` — raises
``NotGenerable`` naming the op, and ``backend="triton"`` passes that on (``functional.py``), while
"auto" runs such a mod on flash.py. A mod that calls an ``autograd.Function`` is refused for the
backward (its forward is traced, but its own backward would be replaced by the derivative of that
forward). Precision: the generated code computes in the dtypes torch's type promotion gives each
node (float32 for a float32 score), with Triton's float32 ``exp`` / ``log`` / ``tanh``
(``forward.tanh``) — within the tolerance rule, not bitwise torch's. A float16 / bfloat16 value is
read, cast and promoted only (held as the float32 it is exactly: ``_Lang.computes``, ``round16``);
an op that would compute a 16-bit result is refused.

The source goes to a file in ``$ATTNZERO_CACHE/triton_mods`` (``cpu_kernel.cache_dir()``), named by
its hash, and is imported from there: Triton reads a jit function's source with ``inspect``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .. import mods

F32 = torch.float32


class NotGenerable(ValueError):
    """No Triton code can be generated from this mod: the message names the operation (or the
    reason) and says which backends run it."""


@dataclass(frozen=True)
class Generated:
    """A mod as Triton code: ``fwd`` the jit function (score mods: ``fwd(score, b, h, q_idx, kv_idx,
    CAP)``; mask mods: ``fwd(b, h, q_idx, kv_idx, CAP)``), ``bwd`` the score mod's backward
    ``bwd(score, b, h, q_idx, kv_idx, dy, CAP, CAP_GRAD, ACCUMULATE)`` (None for a mask mod or when
    not asked for), ``tensors`` what ``CAP`` holds (contiguous), ``grad_of[i]`` the index in
    ``mods.captured_tensors(fn)`` of the tensor ``tensors[i]`` is (None: not one of them, or no
    gradient wanted), ``source`` the generated module's text; ``table`` the block table of the Mask a
    mask_mod's predicate came from (``triton_backend.generate_mask`` sets it), or None."""

    fwd: Any
    bwd: Any
    tensors: tuple[Tensor, ...]
    grad_of: tuple[int | None, ...]
    source: str
    table: Any = None


# ---------------------------------------------------------------------------------------------
# Values while the graph is translated


@dataclass
class Scalar:
    """One value per pair: a Triton expression (a variable name; ``value`` set for a Python number,
    written out in the dtype each use needs), its torch dtype, and whether it can differ between the
    pairs of one block (it depends on q_idx, kv_idx or the score) — b and h are one per block in the
    backward kernels. ``load``: the captured-tensor read that made it (for its gradient). ``number``:
    a Python number (``value``), whose dtype yields to a tensor's in torch's promotion — a constant
    tensor made inside the mod has ``value`` too, and its dtype counts."""

    expr: str
    dtype: torch.dtype
    varies: bool
    value: float | int | bool | None = None
    load: Load | None = None
    number: bool = False


@dataclass
class Load:
    slot: int
    offset: str
    ok: str | None
    varies: bool
    grad: bool  # the tensor wants a gradient and this read is not detached


@dataclass
class View:
    """Part of a captured tensor not yet read: ``CAP[slot]`` at element ``offset`` (an expression),
    with ``shape`` / ``strides`` (elements) left; ``ok`` the in-range condition of the indices so
    far; ``cast`` a dtype to convert to when read; ``detached`` when no gradient may flow back."""

    slot: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: str
    ok: str | None
    varies: bool
    dtype: torch.dtype
    cast: torch.dtype | None = None
    detached: bool = False


_TL = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
    torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}  # fmt: skip


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def _literal(value: float | int | bool, dtype: torch.dtype) -> str:
    """A Python number as Triton source in ``dtype``'s kind (float, int or bool)."""
    if dtype == torch.bool:
        return "True" if value else "False"
    if _is_float(dtype):
        x = float(value)
        if math.isnan(x):
            return "NAN"
        if math.isinf(x):
            return "INF" if x > 0 else "(-INF)"
        return repr(x) if x >= 0 else f"({x!r})"
    n = wrap_int(int(value), dtype)
    return str(n) if n >= 0 else f"({n})"


def wrap_int(n: int, dtype: torch.dtype) -> int:
    """A Python int as ``dtype`` holds it: torch casts a number beyond an integer dtype's range with
    wraparound (``i < 2**40`` on int32 indices compares with 0), and so does the generated code."""
    info = torch.iinfo(dtype)
    span = 1 << info.bits
    return (n - info.min) % span + info.min


class _Lang:
    """How the translated graph is spelled: Triton (this class; the GPU kernels, a block of pairs per
    value) or C++ (``_Cpp``; the CPU kernel, one pair per value inside a loop over a row's keys).
    ``varying``: the arguments that differ between the pairs one generated call computes."""

    name = "Triton"
    varying: ClassVar[frozenset[str]] = frozenset({"score", "q_idx", "kv_idx"})
    fns: ClassVar[dict[str, str]] = {
        "floor": "tl.floor", "ceil": "tl.ceil", "abs": "tl.abs", "exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log",
        "log2": "tl.log2", "sqrt": "_sqrt", "rsqrt": "tl.rsqrt", "tanh": "_tanh", "sigmoid": "tl.sigmoid",
        "sin": "tl.sin", "cos": "tl.cos",
    }  # fmt: skip

    def literal(self, value: float | int | bool, dtype: torch.dtype) -> str:
        return _literal(value, dtype)

    def type(self, dtype: torch.dtype) -> str:
        return _TL[dtype]

    def computes(self, dtype: torch.dtype) -> bool:
        """Whether ops compute values of ``dtype`` here. Not float16 / bfloat16: torch rounds each
        16-bit op's result (and, op by op, some Python numbers) to the dtype, Triton's math takes
        float32 or float64 only, and its CPU interpreter multiplies bfloat16 as raw bits. A 16-bit
        value is held as the float32 it converts to exactly (read from a tensor, or rounded by a
        cast: ``round16``), which casts, tests and float32 arithmetic take as torch does."""
        return dtype in _TL and dtype not in (torch.float16, torch.bfloat16)

    def round16(self, expr: str, dtype: torch.dtype) -> str:
        """``expr`` rounded to float16 / bfloat16, as float32: through float32 first (a float64 is
        rounded twice, as torch does on CPU); bfloat16 by ``_bf16`` — the interpreter's own conversion
        truncates."""
        x = f"({expr}).to(tl.float32)"
        return f"{x}.to(tl.float16).to(tl.float32)" if dtype == torch.float16 else f"_bf16({x})"

    def to(self, expr: str, dtype: torch.dtype) -> str:
        return f"{expr}.to({self.type(dtype)})"

    def where(self, c: str, a: str, b: str) -> str:
        return f"tl.where({c}, {a}, {b})"

    def fn(self, name: str, *args: str) -> str:
        return f"{self.fns[name]}({', '.join(args)})"

    def load(self, slot: int, offset: str, ok: str | None, dtype: torch.dtype) -> str:
        mask = f", mask={ok}, other=0" if ok else ""
        expr = f"tl.load(CAP[{slot}] + {offset}{mask})"
        return f"({expr} != 0)" if dtype == torch.bool else expr

    def assign(self, var: str, expr: str, dtype: torch.dtype) -> str:
        return f"{var} = {expr}"


TRITON = _Lang()


def _meta(x: Any) -> Any:
    """What ``torch.result_type`` takes for a value: a 0-d tensor of its dtype, or the number."""
    if isinstance(x, Scalar):
        return x.value if x.number else torch.empty((), dtype=x.dtype)
    return x


def _op_name(target: Any) -> str:
    """``aten.add.Tensor`` for an OpOverload, else the callable's name."""
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._overloadpacket.__name__}.{target._overloadname}"
    return getattr(target, "__name__", repr(target))


# The graph's ops this module writes as Triton (by overload packet); see the module docstring.
_BINARY = {"add": "+", "sub": "-", "mul": "*"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_BITWISE = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^", "__and__": "&", "__or__": "|",
            "__xor__": "^"}  # fmt: skip
_LOGICAL = {"logical_and": "_and", "logical_or": "_or", "logical_xor": "_xor"}
_BOOL_FN = {"&": "_and", "|": "_or", "^": "_xor"}
_UNARY = {"exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "floor", "ceil"}
_INLINE = {"neg": "(-{})", "reciprocal": "(1.0 / {})", "square": "({0} * {0})"}  # fmt: skip
_WHY_16 = "— the generated code computes none: keep the tensors it reads in float32, or read them with .float()"
_FLOAT_ONLY = {"exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "reciprocal"}
_IDENTITY = {
    "alias",
    "clone",
    "lift_fresh_copy",
    "contiguous",
    "lift_fresh",
    "view",
    "reshape",
    "expand",
    "_unsafe_view",
    "squeeze",
    "unsqueeze",
}  # fmt: skip  (on 0-d values only)
_CONSTANTS = {"full", "scalar_tensor", "zeros", "ones", "new_zeros", "new_ones", "new_full", "full_like",
              "zeros_like", "ones_like", "empty_like"}  # fmt: skip
OPS = sorted({*_BINARY, *_COMPARE, *_BITWISE, *_LOGICAL, *_UNARY, *_INLINE, *_IDENTITY, *_CONSTANTS, "rsub", "div",
              "abs", "sign", "sgn", "pow", "floor_divide", "remainder", "fmod", "minimum", "maximum", "clamp",
              "clamp_min", "clamp_max", "where", "logical_not", "bitwise_not", "_to_copy", "detach", "index",
              "select"})  # fmt: skip


@dataclass
class _Emitter:
    """Translates a traced graph into the lines of one Triton function (see the module docstring)."""

    name: str  # "score_mod" or "mask_mod"
    gm: torch.fx.GraphModule
    captured: list[Tensor]  # mods.captured_tensors(fn): who may get gradients
    want_grads: bool
    lang: _Lang = TRITON
    lines: list[str] = field(default_factory=list)
    vals: dict[torch.fx.Node, Any] = field(default_factory=dict)
    tensors: list[Tensor] = field(default_factory=list)
    slot_of: dict[int, int] = field(default_factory=dict)
    count: int = 0

    # -- helpers

    def refuse(self, node: torch.fx.Node, why: str = "") -> NotGenerable:
        op = _op_name(node.target)
        extra = f" ({why})" if why else ""
        return NotGenerable(f"{self.name}: cannot generate {self.lang.name} code for {op}{extra}")

    def new(self, expr: str, dtype: torch.dtype, varies: bool, load: Load | None = None) -> Scalar:
        self.count += 1
        var = f"v{self.count}"
        self.lines.append(self.lang.assign(var, expr, dtype))
        return Scalar(var, dtype, varies, load=load)

    def cast(self, x: Scalar, dtype: torch.dtype) -> str:
        """``x`` as an expression of ``dtype`` (torch's conversion: to bool is ``!= 0``)."""
        if x.value is not None:
            return self.lang.literal(x.value, dtype)
        if x.dtype == dtype:
            return x.expr
        if dtype == torch.bool:
            return f"({x.expr} != 0)"
        return self.lang.to(x.expr, dtype)

    def scalar(self, node: torch.fx.Node, a: Any) -> Scalar:
        """An argument as a per-pair value: a graph value (a 0-d captured tensor is read here) or a
        Python number."""
        if isinstance(a, torch.fx.Node):
            v = self.vals[a]
            if isinstance(v, View):
                raise self.refuse(node, f"on a whole captured tensor of shape {v.shape}; index it to one element")
            assert isinstance(v, Scalar)
            return v
        if isinstance(a, (bool, int, float)):
            kind = torch.bool if isinstance(a, bool) else torch.int64 if isinstance(a, int) else torch.float64
            return Scalar(self.lang.literal(a, kind), kind, False, value=a, number=True)
        raise self.refuse(node, f"an argument of type {type(a).__name__}")

    def slot(self, t: Tensor) -> int:
        if id(t) not in self.slot_of:
            self.slot_of[id(t)] = len(self.tensors)
            self.tensors.append(t)
        return self.slot_of[id(t)]

    def read(self, v: View) -> Scalar:
        """Load a View of no dims left: one element per pair."""
        t = self.tensors[v.slot]
        grad = (
            self.want_grads and not v.detached and t.requires_grad and _is_float(t.dtype)
            and any(c is t for c in self.captured)
        )  # fmt: skip
        expr = self.lang.load(v.slot, v.offset, v.ok, v.dtype)
        load = Load(v.slot, v.offset, v.ok, v.varies, grad)
        target = v.dtype if v.cast is None else v.cast
        if not self.lang.computes(v.dtype):  # a 16-bit element: as the float32 it converts to exactly
            expr = self.lang.to(expr, F32)
        if target == v.dtype:
            return self.new(expr, v.dtype, v.varies, load)
        if not self.lang.computes(target):  # read as float16 / bfloat16 (d(cast)/d(read) = 1)
            return self.new(self.lang.round16(expr, target), target, v.varies, load)
        got = self.new(expr, v.dtype, v.varies)
        return self.new(self.cast(got, target), target, v.varies, load)  # d(cast)/d(read) = 1

    # -- the graph

    def run(self, arg_names: list[str]) -> Scalar:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node, name in zip(placeholders, arg_names):
            dtype = F32 if name == "score" else mods.INDEX_DTYPE
            self.vals[node] = Scalar(name, dtype, name in self.lang.varying)
        out: Scalar | None = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "get_attr":
                t = getattr(self.gm, node.target)
                assert isinstance(t, Tensor)
                if t.ndim == 0 and not any(c is t for c in self.captured):  # a constant made inside the mod
                    value = t.item()
                    self.vals[node] = Scalar(self.lang.literal(value, t.dtype), t.dtype, False, value=value)
                    continue
                strides = _contiguous_strides(tuple(t.shape))
                v = View(self.slot(t), tuple(t.shape), strides, "0", None, False, t.dtype)
                self.vals[node] = self.read(v) if t.ndim == 0 else v
            elif node.op == "call_function":
                self.vals[node] = self.call(node)
            elif node.op == "output":
                res = node.args[0]
                if isinstance(res, (list, tuple)):
                    if len(res) != 1:
                        raise NotGenerable(f"{self.name}: returns {len(res)} values; expected one 0-d tensor")
                    res = res[0]
                out = self.scalar(node, res)
            else:
                raise self.refuse(node, f"graph node kind {node.op}")
        assert out is not None
        return out

    def call(self, node: torch.fx.Node) -> Any:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            raise self.refuse(node)
        op = target._overloadpacket.__name__
        val = node.meta.get("val")
        args: list[Any] = list(node.args)
        kw: dict[str, Any] = dict(node.kwargs)
        if (
            op in ("index", "select", "_to_copy", "detach", *_IDENTITY)
            and args
            and isinstance(self.vals.get(args[0]) if isinstance(args[0], torch.fx.Node) else None, View)
        ):
            return self.view_op(node, op, args, kw)
        if not isinstance(val, Tensor) or val.ndim != 0:
            shape = tuple(val.shape) if isinstance(val, Tensor) else type(val).__name__
            raise self.refuse(node, f"it makes a value of shape {shape}, not one per pair")
        dt = val.dtype
        if dt not in _TL:
            raise self.refuse(node, f"dtype {dt}")
        if not self.lang.computes(dt) and op not in ("_to_copy", "detach", *_IDENTITY):  # (those keep the value)
            raise self.refuse(node, f"a {dt} value {_WHY_16}")
        if op in _CONSTANTS:
            value = {"full": 1, "scalar_tensor": 0, "new_full": 2, "full_like": 1}.get(op)
            number = args[value] if value is not None else (1 if "ones" in op else 0)
            if isinstance(number, torch.fx.Node):
                raise self.refuse(node, "a value that is not a Python number")
            return Scalar(self.lang.literal(number, dt), dt, False, value=number)
        if op in _IDENTITY:
            return self.scalar(node, args[0])
        if op == "detach":
            x = self.scalar(node, args[0])
            return self.new(x.expr, x.dtype, x.varies) if x.value is None else x
        xs: list[Any] = [self.scalar(node, a) if isinstance(a, (torch.fx.Node, bool, int, float)) else a for a in args]
        varies = any(isinstance(x, Scalar) and x.varies for x in xs)
        if op == "_to_copy":
            if not self.lang.computes(dt):  # rounded to float16 / bfloat16, held as float32
                x = xs[0]
                if x.value is not None:
                    raise self.refuse(node, f"a {dt} constant {_WHY_16}")
                return self.new(self.lang.round16(x.expr, dt), dt, varies)
            return self.new(self.cast(xs[0], dt), dt, varies)
        if op in _BINARY or op == "rsub":
            a, b = xs[0], xs[1]
            alpha = kw.get("alpha", xs[2] if len(xs) > 2 else 1)
            if isinstance(alpha, Scalar):
                raise self.refuse(node, "a tensor alpha")
            sb = self.cast(b, dt) if alpha == 1 else f"({self.cast(b, dt)} * {self.lang.literal(alpha, dt)})"
            if op == "rsub":  # other - alpha·self
                sa = self.cast(a, dt) if alpha == 1 else f"({self.cast(a, dt)} * {self.lang.literal(alpha, dt)})"
                return self.new(f"{self.cast(b, dt)} - {sa}", dt, varies)
            return self.new(f"{self.cast(a, dt)} {_BINARY[op]} {sb}", dt, varies)
        if op == "div":
            mode = kw.get("rounding_mode", xs[2] if len(xs) > 2 else None)
            a, b = xs[0], xs[1]
            if mode is None:
                return self.new(f"{self.cast(a, dt)} / {self.cast(b, dt)}", dt, varies)
            if _is_float(dt):  # torch's: floor as c10's div_floor_floating (_ffloordiv), trunc of the quotient
                if mode == "floor":
                    return self.new(f"_ffloordiv({self.cast(a, dt)}, {self.cast(b, dt)})", dt, varies)
                return self.new(f"_trunc({self.cast(a, dt)} / {self.cast(b, dt)})", dt, varies)
            fn = "_floordiv" if mode == "floor" else "_truncdiv"
            return self.new(f"{fn}({self.cast(a, dt)}, {self.cast(b, dt)})", dt, varies)
        if op in ("floor_divide", "remainder", "fmod"):
            a, b = self.cast(xs[0], dt), self.cast(xs[1], dt)
            if op == "floor_divide":
                expr = f"_ffloordiv({a}, {b})" if _is_float(dt) else f"_floordiv({a}, {b})"
            elif op == "remainder":
                expr = f"_fremainder({a}, {b})" if _is_float(dt) else f"_remainder({a}, {b})"
            else:
                expr = f"_ffmod({a}, {b})" if _is_float(dt) else f"_truncmod({a}, {b})"
            return self.new(expr, dt, varies)
        if op in _COMPARE:
            ct = torch.result_type(_meta(xs[0]), _meta(xs[1]))
            if not self.lang.computes(ct):  # (torch rounds a Python number to the 16-bit dtype first)
                raise self.refuse(node, f"a comparison of {ct} values {_WHY_16}")
            return self.new(f"{self.cast(xs[0], ct)} {_COMPARE[op]} {self.cast(xs[1], ct)}", dt, varies)
        if op in _LOGICAL:
            return self.new(f"{_LOGICAL[op]}({self.cast(xs[0], torch.bool)}, {self.cast(xs[1], torch.bool)})",
                            dt, varies)  # fmt: skip
        if op == "logical_not":
            return self.new(f"({self.cast(xs[0], torch.bool)} == 0)", dt, varies)
        if op in _BITWISE and dt == torch.bool:
            return self.new(f"{_BOOL_FN[_BITWISE[op]]}({self.cast(xs[0], dt)}, {self.cast(xs[1], dt)})", dt, varies)
        if op in _BITWISE:
            return self.new(f"({self.cast(xs[0], dt)} {_BITWISE[op]} {self.cast(xs[1], dt)})", dt, varies)
        if op == "bitwise_not":
            inv = self.cast(xs[0], dt)
            return self.new(f"({inv} == 0)" if dt == torch.bool else f"(~{inv})", dt, varies)
        if op in ("floor", "ceil") and not _is_float(dt):
            return self.scalar(node, args[0])  # an integer is whole already (torch returns it as it is)
        if op in _UNARY:
            if op in _FLOAT_ONLY and not _is_float(dt):
                raise self.refuse(node, f"dtype {dt}")
            return self.new(self.lang.fn(op, self.cast(xs[0], dt)), dt, varies)
        if op in _INLINE:
            return self.new(_INLINE[op].format(self.cast(xs[0], dt)), dt, varies)
        if op == "abs":
            return self.new(self.lang.fn("abs", self.cast(xs[0], dt)), dt, varies)
        if op in ("sign", "sgn"):
            return self.new(f"_sign({self.cast(xs[0], dt)})", dt, varies)
        if op == "pow":
            return self.pow(node, xs, dt, varies)
        if op in ("minimum", "maximum"):
            fn = "_min" if op == "minimum" else "_max"
            suffix = "f" if _is_float(dt) else "i"
            return self.new(f"{fn}{suffix}({self.cast(xs[0], dt)}, {self.cast(xs[1], dt)})", dt, varies)
        if op in ("clamp", "clamp_min", "clamp_max"):
            lo, hi = _clamp_bounds(op, xs, kw)
            suffix = "f" if _is_float(dt) else "i"
            expr = self.cast(xs[0], dt)
            if lo is not None:
                lo_s = lo if isinstance(lo, Scalar) else self.scalar(node, lo)
                expr = f"_max{suffix}({expr}, {self.cast(lo_s, dt)})"
            if hi is not None:
                hi_s = hi if isinstance(hi, Scalar) else self.scalar(node, hi)
                expr = f"_min{suffix}({expr}, {self.cast(hi_s, dt)})"
            return self.new(expr, dt, varies)
        if op == "where":
            c, a, b = xs[0], xs[1], xs[2]
            return self.new(self.lang.where(self.cast(c, torch.bool), self.cast(a, dt), self.cast(b, dt)), dt, varies)
        raise self.refuse(node)

    def pow(self, node: torch.fx.Node, xs: list[Any], dt: torch.dtype, varies: bool) -> Scalar:
        base, ex = xs[0], xs[1]
        if isinstance(ex, Scalar) and ex.value is not None and base.value is None:  # x ** n
            expr = _pow_expr(self.lang, self.cast(base, dt), ex.value, dt)
            if expr is None:
                raise self.refuse(node, "an integer to a negative power or one above 16")
            return self.new(expr, dt, varies)
        if base.value is not None and float(base.value) > 0 and _is_float(dt):  # c ** x
            power = f"{self.cast(ex, dt)} * {self.lang.literal(math.log2(base.value), dt)}"
            return self.new(self.lang.fn("exp2", power), dt, varies)
        raise self.refuse(node, "only a tensor to a Python number's power, or a positive number to a tensor's")

    def view_op(self, node: torch.fx.Node, op: str, args: list[Any], kw: dict[str, Any]) -> Any:
        """An op on a captured tensor (``self.vals[args[0]]`` is a View): indexing, select, a cast,
        detach; the result is read once no dim is left."""
        v = self.vals[args[0]]
        assert isinstance(v, View)
        if op == "_to_copy":
            to = kw.get("dtype", v.cast)
            if v.cast is not None and v.cast != v.dtype and to != v.cast:  # (one cast is kept per read)
                raise self.refuse(node, f"a second cast ({v.cast}, then {to}) of a whole captured tensor; index first")
            res = View(**{**v.__dict__, "cast": to})
        elif op == "detach":
            res = View(**{**v.__dict__, "detached": True})
        elif op in _IDENTITY:
            val = node.meta.get("val")
            if (
                not isinstance(val, Tensor)
                or tuple(val.shape) != v.shape
                or op not in ("alias", "clone", "lift_fresh_copy", "contiguous")
            ):
                raise self.refuse(node, f"on a whole captured tensor of shape {v.shape}")
            res = v
        elif op == "select":
            dim, index = int(args[1]), args[2]
            if isinstance(index, torch.fx.Node):
                raise self.refuse(node, "a tensor index")
            dim = dim % len(v.shape)
            size = v.shape[dim]
            i = int(index) + size if int(index) < 0 else int(index)
            res = View(v.slot, v.shape[:dim] + v.shape[dim + 1 :], v.strides[:dim] + v.strides[dim + 1 :],
                       f"({v.offset} + {i * v.strides[dim]})", v.ok, v.varies, v.dtype, v.cast, v.detached)  # fmt: skip
        else:  # index.Tensor: 0-d index tensors (None keeps a dim)
            indices = list(args[1])
            if len(indices) > len(v.shape):
                raise self.refuse(node, "more indices than dims")
            shape, strides, offset, ok, varies = [], [], v.offset, v.ok, v.varies
            for d, ix in enumerate(indices + [None] * (len(v.shape) - len(indices))):
                if ix is None:
                    shape.append(v.shape[d])
                    strides.append(v.strides[d])
                    continue
                s = self.scalar(node, ix)
                if s.dtype == torch.bool or _is_float(s.dtype):
                    raise self.refuse(node, f"an index of dtype {s.dtype}")
                size = v.shape[d]
                raw = self.new(self.cast(s, s.dtype), s.dtype, s.varies)
                w = self.new(self.lang.where(f"{raw.expr} < 0", f"{raw.expr} + {size}", raw.expr), s.dtype, s.varies)
                cond = f"_and({w.expr} >= 0, {w.expr} < {size})"
                ok = cond if ok is None else f"_and({ok}, {cond})"
                offset = f"({offset} + {w.expr} * {v.strides[d]})"
                varies = varies or s.varies
            res = View(v.slot, tuple(shape), tuple(strides), offset, ok, varies, v.dtype, v.cast, v.detached)
        return self.read(res) if not res.shape else res


def _clamp_bounds(op: str, xs: list[Any], kw: dict[str, Any]) -> tuple[Any, Any]:
    """(min, max) of clamp(x, min=None, max=None), clamp_min(x, min), clamp_max(x, max)."""
    rest = xs[1:]
    if op == "clamp_min":
        return rest[0], None
    if op == "clamp_max":
        return None, rest[0]
    lo = rest[0] if rest else None
    hi = rest[1] if len(rest) > 1 else None
    return kw.get("min", lo), kw.get("max", hi)


def _pow_expr(lang: _Lang, x: str, n: float | int, dt: torch.dtype) -> str | None:
    """``x ** n`` for a Python number n as an expression, or None (an integer to a negative power or
    one above 16)."""
    whole = float(n).is_integer()
    if whole and abs(n) <= 16:
        k = int(abs(n))
        if k == 0:
            return lang.literal(1, dt)
        prod = "(" + " * ".join([x] * k) + ")"
        if n < 0:
            return f"(1.0 / {prod})" if _is_float(dt) else None
        return prod
    if not _is_float(dt):
        return None
    if n == 0.5:
        return lang.fn("sqrt", x)
    if whole:  # |x|ⁿ, negative for a negative x and an odd n (as torch: not NaN)
        mag = lang.fn("exp2", f"{lang.literal(n, dt)} * {lang.fn('log2', lang.fn('abs', x))}")
        return lang.where(f"{x} < 0", f"(-{mag})", mag) if int(n) % 2 else mag
    return lang.fn("exp2", f"{lang.literal(n, dt)} * {lang.fn('log2', x)}")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    acc = 1
    for n in reversed(shape):
        out.insert(0, acc)
        acc *= max(n, 1)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# The backward: reverse mode over the translated graph


class _Backward:
    """Adjoint lines for a score mod's graph: ``d(out)/d(node) · dy`` for every float node that
    depends on the score or on a captured read that wants a gradient, in reverse order."""

    def __init__(self, em: _Emitter) -> None:
        self.em = em
        self.adj: dict[torch.fx.Node, str] = {}
        self.lines: list[str] = []
        self.count = 0
        self.needs: dict[torch.fx.Node, bool] = {}

    def var(self, expr: str, dtype: torch.dtype) -> str:
        self.count += 1
        name = f"g{self.count}"
        self.lines.append(self.em.lang.assign(name, expr, dtype))
        return name

    def add(self, node: Any, expr: str, dtype: torch.dtype) -> None:
        """Add ``expr`` (of ``dtype``) to the adjoint of ``node`` (ignored for numbers and for nodes
        that need no gradient)."""
        if not isinstance(node, torch.fx.Node) or not self.needs.get(node, False):
            return
        v = self.em.vals[node]
        assert isinstance(v, Scalar)
        lang = self.em.lang
        held = v.dtype if lang.computes(v.dtype) else F32  # (a 16-bit value's adjoint: float32 ...)
        # ... rounded to the value's dtype, as torch's autograd holds it: each share and their sum; not
        # a read of a captured tensor, whose shares go to the tensor's float32 gradient (``atomic``), as
        # torch sums a broadcast read's gradient before its one cast
        wide = held != v.dtype and v.load is None
        if held != dtype:
            expr = lang.to(f"({expr})", held)
        if wide:
            expr = lang.round16(expr, v.dtype)
        before = self.adj.get(node)
        total = expr if before is None else f"{before} + {expr}"
        self.adj[node] = self.var(lang.round16(total, v.dtype) if wide and before is not None else total, held)

    def mark(self) -> None:
        """Which nodes need a gradient: the score, reads that want one, and float nodes computed
        from them by a differentiable op."""
        for node in self.em.gm.graph.nodes:
            v = self.em.vals.get(node)
            if not isinstance(v, Scalar) or not _is_float(v.dtype) or v.value is not None:
                self.needs[node] = False
            elif node.op == "placeholder":
                self.needs[node] = v.expr == "score"
            elif v.load is not None:
                self.needs[node] = v.load.grad
            elif node.op == "call_function" and node.target._overloadpacket.__name__ == "detach":  # type: ignore[union-attr]
                self.needs[node] = False
            else:
                self.needs[node] = any(self.needs.get(a, False) for a in node.all_input_nodes)

    def run(self, out_node: torch.fx.Node) -> tuple[str, list[str]]:
        """(the score's adjoint expression, the lines), dy flowing in at ``out_node``."""
        self.mark()
        self.adj[out_node] = "dy"
        atomics: list[str] = []
        for node in reversed(list(self.em.gm.graph.nodes)):
            g = self.adj.get(node)
            if g is None or not self.needs.get(node, False):
                continue
            v = self.em.vals[node]
            assert isinstance(v, Scalar)
            if v.load is not None and v.load.grad:
                atomics.append(self.atomic(v.load, g))
            if node.op == "call_function":
                self.rule(node, g, v)
        score = next((n for n in self.em.gm.graph.nodes if n.op == "placeholder"), None)
        dx = self.adj.get(score) if score is not None else None
        return (dx if dx is not None else "0.0"), self.lines + atomics

    def atomic(self, load: Load, g: str) -> str:
        """The share of one read's gradient, into ``CAP_GRAD[slot]`` at the offset it read."""
        c = f"tl.where(nz, ({g}).to(tl.float32), 0.0) + zf"  # a block, 0 where dy is 0
        if load.varies:
            mask = "nz" if load.ok is None else f"_and(nz, {load.ok})"
            return (f"if ACCUMULATE:\n        tl.atomic_add(CAP_GRAD[{load.slot}] + ({load.offset} + zi), {c}, "
                    f"mask={mask})")  # fmt: skip
        mask = "" if load.ok is None else f", mask={load.ok}"
        total = f"tl.sum(tl.sum({c}, 1), 0)"  # one atomic per block: the offset is the block's
        return f"if ACCUMULATE:\n        tl.atomic_add(CAP_GRAD[{load.slot}] + {load.offset}, {total}{mask})"

    def rule(self, node: torch.fx.Node, g: str, y: Scalar) -> None:
        em, dt, lang = self.em, y.dtype, self.em.lang
        op = node.target._overloadpacket.__name__  # type: ignore[union-attr]
        zero = lang.literal(0.0, dt)

        def where(c: str, a: str, b: str) -> str:
            return lang.where(c, a, b)

        args: list[Any] = list(node.args)
        kw: dict[str, Any] = dict(node.kwargs)

        def val(i: int) -> str:
            a = args[i]
            s = em.scalar(node, a)
            return em.cast(s, dt)

        a0 = args[0] if args else None
        if op in ("add", "sub", "rsub"):
            alpha = kw.get("alpha", args[2] if len(args) > 2 else 1)
            sign = -1 if op != "add" else 1
            if op == "rsub":  # other - alpha·self
                self.add(a0, f"{g} * {lang.literal(-alpha, dt)}", dt)
                self.add(args[1], g, dt)
                return
            self.add(a0, g, dt)
            self.add(args[1], f"{g} * {lang.literal(sign * alpha, dt)}", dt)
        elif op == "mul":
            self.add(a0, f"{g} * {val(1)}", dt)
            self.add(args[1], f"{g} * {val(0)}", dt)
        elif op == "div":
            if kw.get("rounding_mode", args[2] if len(args) > 2 else None) is not None:
                return
            self.add(a0, f"{g} / {val(1)}", dt)
            self.add(args[1], f"-{g} * {y.expr} / {val(1)}", dt)
        elif op == "neg":
            self.add(a0, f"-{g}", dt)
        elif op == "abs":
            self.add(a0, f"{g} * _sign({val(0)})", dt)
        elif op == "exp":
            self.add(a0, f"{g} * {y.expr}", dt)
        elif op == "exp2":
            self.add(a0, f"{g} * {y.expr} * {math.log(2.0)!r}", dt)
        elif op == "log":
            self.add(a0, f"{g} / {val(0)}", dt)
        elif op == "log2":
            self.add(a0, f"{g} / ({val(0)} * {math.log(2.0)!r})", dt)
        elif op == "tanh":
            self.add(a0, f"{g} * (1.0 - {y.expr} * {y.expr})", dt)
        elif op == "sigmoid":
            self.add(a0, f"{g} * {y.expr} * (1.0 - {y.expr})", dt)
        elif op == "sqrt":
            self.add(a0, f"{g} / (2.0 * {y.expr})", dt)
        elif op == "rsqrt":
            self.add(a0, f"-0.5 * {g} * {y.expr} * {y.expr} * {y.expr}", dt)
        elif op == "sin":
            self.add(a0, f"{g} * {lang.fn('cos', val(0))}", dt)
        elif op == "cos":
            self.add(a0, f"-{g} * {lang.fn('sin', val(0))}", dt)
        elif op == "square":
            self.add(a0, f"2.0 * {g} * {val(0)}", dt)
        elif op == "reciprocal":
            self.add(a0, f"-{g} * {y.expr} * {y.expr}", dt)
        elif op == "pow":
            base, ex = args[0], args[1]
            n = ex if isinstance(ex, (int, float)) else em.scalar(node, ex).value  # a number, or a 0-d constant's
            if n is not None and not isinstance(n, bool):  # x ** n
                if n == 0:
                    return
                p = _pow_expr(lang, val(0), n - 1, dt)
                if p is None:
                    raise NotGenerable(f"{em.name}: no derivative written for an integer to a power")
                self.add(base, f"{g} * {lang.literal(n, dt)} * {p}", dt)
            else:  # c ** x
                c0 = base if isinstance(base, (int, float)) else em.scalar(node, base).value
                if c0 is None:
                    raise NotGenerable(f"{em.name}: no derivative written for a tensor to a tensor's power")
                self.add(ex, f"{g} * {y.expr} * {lang.literal(math.log(float(c0)), dt)}", dt)
        elif op in ("clamp", "clamp_min", "clamp_max"):
            # torch's: y = min(max(x, lo), hi); x gets dy where lo <= x <= hi, lo where x < lo < hi,
            # hi where max(x, lo) > hi (all of it where lo > hi: y is hi there)
            x = val(0)
            lo, hi = _clamp_bounds(op, args, kw)
            lo_e = None if lo is None else em.cast(em.scalar(node, lo), dt)
            hi_e = None if hi is None else em.cast(em.scalar(node, hi), dt)
            keep = []
            if lo_e is not None:
                keep.append(f"({x} >= {lo_e})")
                below = f"({x} < {lo_e})" if hi_e is None else f"_and({x} < {lo_e}, {lo_e} < {hi_e})"
                self.add(lo, where(below, g, zero), dt)
            if hi_e is not None:
                keep.append(f"({x} <= {hi_e})")
                above = f"({x} > {hi_e})" if lo_e is None else f"_or({x} > {hi_e}, {lo_e} > {hi_e})"
                self.add(hi, where(above, g, zero), dt)
            for cond in keep:
                g = where(cond, g, zero)
            self.add(a0, g, dt)
        elif op in ("maximum", "minimum"):
            a, b = val(0), val(1)
            wins = ">" if op == "maximum" else "<"
            half = f"{g} * {lang.literal(0.5, dt)}"
            self.add(a0, where(f"{a} == {b}", half, where(f"{a} {wins} {b}", g, zero)), dt)
            self.add(args[1], where(f"{a} == {b}", half, where(f"{b} {wins} {a}", g, zero)), dt)
        elif op == "where":
            c = em.cast(em.scalar(node, args[0]), torch.bool)
            self.add(args[1], where(c, g, zero), dt)
            self.add(args[2], where(c, zero, g), dt)
        elif op == "remainder" or op == "fmod":
            self.add(a0, g, dt)
            # torch's: d/db of remainder is −(a div b, floor), of fmod −(a div b, trunc)
            rounded = f"_ffloordiv({val(0)}, {val(1)})" if op == "remainder" else f"_trunc({val(0)} / {val(1)})"
            self.add(args[1], f"-{g} * {rounded}", dt)
        elif op in ("_to_copy", *_IDENTITY):
            self.add(a0, g, dt)
        elif op in ("floor", "ceil", "sign", "sgn", "floor_divide", "detach", *_CONSTANTS):
            return  # zero (or no) gradient
        elif op in ("index", "select"):
            return  # a read of a captured tensor: its gradient is its atomic (above)
        else:
            raise NotGenerable(f"{em.name}: no derivative written for {_op_name(node.target)}")


# ---------------------------------------------------------------------------------------------
# Tracing, writing the module, the entry points

_PRELUDE = '''"""Generated by attnzero.kernels.codegen from {what} (do not edit: regenerated on use)."""
import triton
import triton.language as tl

from attnzero.kernels.forward import tanh as _tanh

INF: tl.constexpr = tl.constexpr(float("inf"))
NAN: tl.constexpr = tl.constexpr(float("nan"))


@triton.jit
def _bf16(x):
    # float32 x rounded to bfloat16 (to nearest, ties to even), as float32: in integer arithmetic,
    # as torch rounds (Triton's CPU interpreter truncates in its own conversion)
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _sqrt(x):
    if x.dtype == tl.float64:
        return tl.sqrt(x)  # (tl.sqrt_rn takes float32 only)
    return tl.sqrt_rn(x)  # correctly rounded, as torch's


@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def _truncdiv(a, b):
    return a // b  # integers: Triton (and C) truncate


@triton.jit
def _truncmod(a, b):
    return a % b  # integers: the sign of a, as torch.fmod


@triton.jit
def _floordiv(a, b):
    q = a // b
    return q - ((q * b != a) & ((a < 0) != (b < 0))).to(q.dtype)  # torch rounds toward -inf


@triton.jit
def _remainder(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)  # torch: the sign of b


@triton.jit
def _ffmod(a, b):
    return a % b  # floats: C's fmod, exact, the sign of a (torch.fmod)


@triton.jit
def _fremainder(a, b):
    m = a % b
    return tl.where((m != 0) & ((b < 0) != (m < 0)), m + b, m)  # torch: the sign of b, exact


@triton.jit
def _ffloordiv(a, b):
    # torch's floor division of floats (c10's div_floor_floating): (a − fmod(a, b)) / b, one less where
    # the remainder's sign is not b's, rounded to the nearest whole number; b = 0 gives a / b
    m = a % b
    d = (a - m) / b
    d = tl.where((m != 0) & ((b < 0) != (m < 0)), d - 1.0, d)
    f = tl.floor(d)
    f = tl.where(d - f > 0.5, f + 1.0, f)
    f = tl.where(d == 0, tl.where(a / b < 0, -0.0, 0.0), f)
    return tl.where(b == 0, a / b, f)


@triton.jit
def _sign(x):
    return tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(x.dtype)


@triton.jit
def _and(a, b):
    return tl.where(a, b, False)  # (not a & b: the interpreter cannot broadcast a 0-d bool in &)


@triton.jit
def _or(a, b):
    return tl.where(a, True, b)


@triton.jit
def _xor(a, b):
    return tl.where(a, b == 0, b)


@triton.jit
def _maxf(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _minf(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _maxi(a, b):
    return tl.maximum(a, b)


@triton.jit
def _mini(a, b):
    return tl.minimum(a, b)
'''


class _ValueReads(TorchFunctionMode):
    """Notes a tensor's value taken into Python while a mod is traced (``t.item()``, ``bool(t)``,
    ``float(t)``, ``t.tolist()``, ``np.asarray(t)``, ``complex(t)``, ``f"{t:.2f}"``, ``str(t)``,
    ``torch.equal(t, u)``, ``t.allclose(u)``): the traced graph
    then holds that value as a constant, so it may not be kept for another call (``reads_of_values``)."""

    READS: ClassVar[frozenset[Any]] = frozenset(
        {Tensor.item, Tensor.__bool__, Tensor.__float__, Tensor.__int__, Tensor.__index__, Tensor.__complex__,
         Tensor.tolist, Tensor.numpy, Tensor.__array__, Tensor.__format__, Tensor.__repr__, Tensor.__str__,
         torch.equal, Tensor.equal, torch.allclose, Tensor.allclose, torch.is_nonzero, Tensor.is_nonzero}
    )  # fmt: skip

    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self.READS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


_WATCH = threading.local()  # .reads: the list that _trace adds a trace's value reads to, or None


@contextlib.contextmanager
def reads_of_values() -> Iterator[list[str]]:
    """The tensor values the traces inside the block take into Python (see ``_ValueReads``): a
    cache of generated code keeps nothing whose trace read one."""
    outer = getattr(_WATCH, "reads", None)
    reads: list[str] = []
    _WATCH.reads = reads
    try:
        yield reads
    finally:
        _WATCH.reads = outer
        if outer is not None:
            outer.extend(reads)


def _trace(fn: Callable[..., Any], name: str, device: torch.device) -> torch.fx.GraphModule:
    """The mod for one pair as an aten graph (``make_fx`` on 0-d tensors, real values 0)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with_score = name == "score_mod"
    args = [torch.zeros((), dtype=F32, device=device)] if with_score else []
    args += [torch.zeros((), dtype=mods.INDEX_DTYPE, device=device) for _ in range(4)]

    reads = getattr(_WATCH, "reads", None)

    def one_pair(*a: Tensor) -> Tensor:
        with mods.ModOps(), _ValueReads(reads if reads is not None else []):
            return mods.call_one(name, fn, a)  # (a Python number refused: make_fx would make it a tensor)

    try:
        with torch.no_grad():
            return make_fx(one_pair)(*args)
    except mods.ModError:
        raise
    except Exception as e:  # data-dependent Python (``if score > 0``, ``.item()``), an op make_fx rejects
        raise NotGenerable(f"{name}: cannot trace it to generate code from ({type(e).__name__}: {e})") from e


def _uses_autograd_function(fn: Any) -> str | None:
    """The name of an ``autograd.Function`` subclass the mod refers to (closures, globals, one
    level into the functions it names), or None."""
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> str | None:
        if id(obj) in seen or depth > 4:
            return None
        seen.add(id(obj))
        if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
            return obj.__name__
        if inspect.ismethod(obj):
            return visit(obj.__func__, depth + 1)
        if inspect.isfunction(obj):
            for cell in obj.__closure__ or ():
                try:
                    found = visit(cell.cell_contents, depth + 1)
                except ValueError:
                    continue
                if found:
                    return found
            for n in mods._names(obj.__code__):
                if n in obj.__globals__:
                    found = visit(obj.__globals__[n], depth + 1)
                    if found:
                        return found
        elif callable(obj) and not isinstance(obj, type):
            return visit(getattr(type(obj), "forward", None) or vars(type(obj)).get("__call__"), depth + 1)
        return None

    return visit(fn, 0)


_MODULES: dict[str, Any] = {}


def _load(source: str) -> Any:
    """Write ``source`` to the cache directory (named by its hash) and import it."""
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    if key in _MODULES:
        return _MODULES[key]
    from .. import cpu_kernel

    folder = Path(cpu_kernel.cache_dir()) / "triton_mods"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"mod_{key}.py"
    if not path.exists() or path.read_text() != source:
        tmp = folder / f".mod_{key}.{os.getpid()}.tmp"
        tmp.write_text(source)
        os.replace(tmp, path)
    name = f"attnzero_generated_mod_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _MODULES[key] = module
    return module


def _as_kernel_arg(t: Tensor) -> Tensor:
    """A captured tensor as the kernels read it: contiguous (the strides written into the source),
    bool as uint8 (read back ``!= 0``), its values in memory (torch's negative bit resolved)."""
    t = t.detach().resolve_neg().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _indent(lines: list[str]) -> str:
    return "".join(f"    {line}\n" for line in lines)


def translate(
    fn: mods.ScoreMod, device: torch.device, *, grads: bool, lang: _Lang = TRITON
) -> tuple[_Emitter, Scalar, torch.fx.Node | None]:
    """A score mod traced and translated into ``lang``'s lines (``em.lines``; ``em.tensors`` what they
    read): ``(em, out, out_node)``, ``out`` the result's value, ``out_node`` its graph node (None
    when the mod returns a number). Raises ``NotGenerable`` naming what cannot be generated,
    ``mods.ModError`` for a mod that returns another dtype than the (float32) score's."""
    if grads:
        found = _uses_autograd_function(fn)
        if found:
            raise NotGenerable(
                f"score_mod: calls the autograd.Function {found}; its backward cannot be generated as "
                f"{lang.name} code (only the forward's derivative could)"
            )
    gm = _trace(fn, "score_mod", device)
    em = _Emitter("score_mod", gm, mods.captured_tensors(fn), grads, lang)
    out = em.run(["score", "b", "h", "q_idx", "kv_idx"])
    if out.dtype != F32:
        raise mods.ModError(
            f"score_mod: expected the score's dtype {F32} back, got {out.dtype} (a captured tensor of another "
            f"dtype promotes it: cast it, e.g. table.to(score.dtype))"
        )
    out_node = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out_node = out_node[0] if isinstance(out_node, (list, tuple)) else out_node
    return em, out, (out_node if isinstance(out_node, torch.fx.Node) else None)


# Mods generated in this process, keyed by ``mods.fingerprint`` (the mod's code and everything it
# reads: equal keys trace to the same graph), the device and the wish for a backward: tracing takes
# milliseconds a call (21-27 ms on the H200 machine's host, against a 0.2-0.8 ms kernel). Each entry:
# the Generated, and for each of its tensors the index of the captured tensor it is (this call's is
# read instead), or the tensor itself (a constant the trace made); or the NotGenerable it raised.
_GENERATED: dict[tuple[Any, ...], tuple[Generated, tuple[int | Tensor, ...]] | NotGenerable] = {}
_GENERATED_MAX = 512


def _cached(kind: str, fn: Any, device: torch.device, grads: bool,
            make: Callable[[], tuple[Generated, list[Tensor]]]) -> Generated:
    """``make()`` (the Generated and the tensors its code reads, as the trace found them) once per
    fingerprint; later calls get the same code with their own captured tensors."""
    key, reached = mods.fingerprint(fn)
    full = (kind, key, device, grads)
    hit = _GENERATED.get(full) if key is not None else None
    if hit is None:
        with reads_of_values() as reads:
            try:
                gen, read = make()
            except NotGenerable as e:
                hit = NotGenerable(str(e))  # (not e: its traceback holds the frames that hold the mod and its module)
            else:
                slots = tuple(next((i for i, c in enumerate(reached) if c is t), k) for t, k in zip(read, gen.tensors))
                hit = (replace(gen, tensors=()), slots)  # (this call's tensors are not kept alive by the cache)
        if key is not None and not reads:  # (a trace that read a tensor's value holds it: not kept)
            if len(_GENERATED) >= _GENERATED_MAX:
                _GENERATED.pop(next(iter(_GENERATED)))
            _GENERATED[full] = hit
    if isinstance(hit, NotGenerable):
        raise NotGenerable(str(hit))
    gen, slots = hit
    tensors = tuple(_as_kernel_arg(reached[s]) if isinstance(s, int) else s for s in slots)
    return replace(gen, tensors=tensors)


def score_mod(fn: mods.ScoreMod, device: torch.device, *, grads: bool) -> Generated:
    """``fn`` as Triton code: the forward, and with ``grads`` the backward (see the module
    docstring). Raises ``NotGenerable`` naming what cannot be generated, ``mods.ModError`` for a mod
    that returns another dtype than the (float32) score's. Generated once per ``mods.fingerprint``."""

    def make() -> tuple[Generated, list[Tensor]]:
        em, out, out_node = translate(fn, device, grads=grads)
        captured = em.captured
        fwd_lines = list(em.lines)
        body = f"    return {em.cast(out, F32)} + tl.zeros_like(score)\n"
        source = _PRELUDE.format(what="a score_mod") + (
            "\n\n@triton.jit\ndef score_mod_fwd(score, b, h, q_idx, kv_idx, CAP):\n" + _indent(fwd_lines) + body
        )
        if grads:
            dx, lines = _Backward(em).run(out_node) if out_node is not None else ("0.0", [])
            source += (
                "\n\n@triton.jit\ndef score_mod_bwd(score, b, h, q_idx, kv_idx, dy, CAP, CAP_GRAD, "
                "ACCUMULATE: tl.constexpr):\n"
                "    nz = dy != 0.0\n    zf = tl.zeros_like(score)\n    zi = zf.to(tl.int32)\n"
                + _indent(fwd_lines + lines)
                + f"    return tl.where(nz, ({dx}) + zf, 0.0)\n"
            )
        module = _load(source)
        tensors = tuple(_as_kernel_arg(t) for t in em.tensors)
        grad_of = tuple(
            next((i for i, c in enumerate(captured) if c is t), None) if grads and t.requires_grad else None
            for t in em.tensors
        )
        gen = Generated(module.score_mod_fwd, module.score_mod_bwd if grads else None, tensors, grad_of, source)
        return gen, list(em.tensors)

    return _cached("score_mod", fn, device, grads, make)


def mask_mod(fn: mods.MaskMod, device: torch.device) -> Generated:
    """``fn`` as a Triton predicate ``mask_mod_fwd(b, h, q_idx, kv_idx, CAP) -> bool`` (True = may
    attend; a non-bool result counts non-zero as True). Raises ``NotGenerable`` naming the op.
    Generated once per ``mods.fingerprint``."""

    def make() -> tuple[Generated, list[Tensor]]:
        gm = _trace(fn, "mask_mod", device)
        em = _Emitter("mask_mod", gm, mods.captured_tensors(fn), False)
        out = em.run(["b", "h", "q_idx", "kv_idx"])
        body = f"    return _and(tl.zeros_like(q_idx + kv_idx) == 0, {em.cast(out, torch.bool)})\n"
        source = _PRELUDE.format(what="a mask_mod") + (
            "\n\n@triton.jit\ndef mask_mod_fwd(b, h, q_idx, kv_idx, CAP):\n" + _indent(em.lines) + body
        )
        module = _load(source)
        tensors = tuple(_as_kernel_arg(t) for t in em.tensors)
        return Generated(module.mask_mod_fwd, None, tensors, (None,) * len(tensors), source), list(em.tensors)

    return _cached("mask_mod", fn, device, False, make)


__all__ = ["OPS", "Generated", "NotGenerable", "mask_mod", "score_mod"]
