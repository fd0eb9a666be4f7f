"""A ``score_mod`` in the compiled CPU kernel: C++ generated from the user's Python function, built
into a small library of its own, and called by ``csrc/attention.cpp`` on each row of scores.

Why: flash.py runs any score_mod, but as PyTorch ops per block (vmap, autograd) — 7 to 13 times
the kernel's plain call. The kernel runs no Python; it takes the mod as two C functions.

How:

* ``kernels/codegen.py`` traces the mod for one pair (``make_fx``) and translates each node of the
  graph into one line, here spelled in C++ (``_Cpp``): one pair per value, inside a loop over one
  row's keys that the compiler vectorises (``#pragma omp simd``). ``b``, ``h`` and ``q_idx`` are one
  per call; ``score`` and ``kv_idx`` vary along the row.
* ``az_mod_fwd(s, n, b, h, i, j0, CAP)`` rewrites ``s_j = score_mod(s_j, b, h, i, j0 + j)`` in place;
  ``az_mod_bwd(x, g, n, b, h, i, j0, CAP, GRAD, TMP)`` turns ``g_j`` (dL/d score_mod's output) into
  dL/d its input at ``x_j``, and adds each captured tensor's share ``g_j · ∂y/∂θ`` into ``GRAD``, the
  calling thread's own flat float64 copy (summed after the call): a read whose offset is the same
  along the row (``slopes[h]``) is summed in a register first; one that varies (``rel[h, q - kv]``)
  is written to ``TMP`` and added after the loop.
* A read of a captured tensor out of range gives 0 and sets the row's flag, which ``az_mod_fwd``
  returns: the kernel raises IndexError after the call, as torch's indexing (and so flash.py, where
  the kernel is not built) would.
* exp, exp2, log, log2, tanh and sigmoid are ``csrc/fast_math.h``'s (shared with the kernel's
  softcap): branch-free float32 code the compiler vectorises (libm's are one call per element). Their
  error is a few float32 ulp — within the tolerance rule, not bitwise torch's.
* The source is compiled with the system's C++ compiler (``$CXX``, else ``c++``; no torch headers:
  about 0.3 s) into ``$ATTNZERO_CACHE/cpu_mods/mod_<hash>.so`` and loaded with ctypes; a mod met
  again in the same process is neither traced nor compiled again (``_CACHE``, keyed by the mod's
  code and everything it reads, ``mods.fingerprint``).

What runs elsewhere: a mod that cannot be generated (``codegen.NotGenerable``: an op outside
``codegen.OPS``, a captured tensor of 16-bit floats or of 2³¹ elements or more, an
``autograd.Function`` when gradients are wanted) and any build failure (no compiler, a cache that
cannot be written — one warning) give None, and ``functional.py`` runs the mod on flash.py: the
same results within the tolerance rule, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from . import cpu_kernel, flash, geometry, mods, reference, sinks
from .kernels import codegen
from .locks import ForkSafeLock
from .masks import Mask, unchanged, version_of

F32 = torch.float32
_INT_MAX = 2**31 - 1


class _Cpp(codegen._Lang):
    """C++ spelling of the translated graph (see ``codegen._Lang``): one pair per value."""

    name = "C++"
    varying: ClassVar[frozenset[str]] = frozenset({"score", "kv_idx"})
    fns: ClassVar[dict[str, str]] = {
        "floor": "std::floor", "ceil": "std::ceil", "abs": "_abs", "exp": "azm::exp", "exp2": "azm::exp2",
        "log": "azm::log", "log2": "azm::log2", "sqrt": "std::sqrt", "rsqrt": "azm::rsqrt", "tanh": "azm::tanh",
        "sigmoid": "azm::sigmoid", "sin": "std::sin", "cos": "std::cos",
    }  # fmt: skip
    types: ClassVar[dict[torch.dtype, str]] = {
        torch.float32: "float", torch.float64: "double", torch.int8: "int8_t", torch.int16: "int16_t",
        torch.int32: "int32_t", torch.int64: "int64_t", torch.uint8: "uint8_t", torch.bool: "bool",
    }  # fmt: skip

    def literal(self, value: float | int | bool, dtype: torch.dtype) -> str:
        if dtype == torch.bool:
            return "true" if value else "false"
        if dtype.is_floating_point:
            text = codegen._literal(value, dtype)  # NAN, INF, (-INF), or repr(x) (with a '.' or an 'e')
            if "INF" in text or "NAN" in text or dtype != F32:
                return text
            return text[:-1] + "f)" if text.endswith(")") else text + "f"
        n = codegen.wrap_int(int(value), dtype)
        if dtype == torch.int64:
            return f"INT64_C({n})"
        if dtype != torch.int32:  # a bare literal is an int: int8_t / int16_t / uint8_t spelled out
            return f"{self.type(dtype)}({n})"
        return str(n) if n >= 0 else f"({n})"

    def type(self, dtype: torch.dtype) -> str:
        if dtype not in self.types:
            raise codegen.NotGenerable(f"score_mod: the CPU kernel's C++ computes no {dtype} values")
        return self.types[dtype]

    def to(self, expr: str, dtype: torch.dtype) -> str:
        return f"static_cast<{self.type(dtype)}>({expr})"

    def computes(self, dtype: torch.dtype) -> bool:
        return True  # each value in a C++ type of its own (`type` refuses a dtype C++ has none of here)

    def where(self, c: str, a: str, b: str) -> str:
        return f"({c} ? {a} : {b})"

    def load(self, slot: int, offset: str, ok: str | None, dtype: torch.dtype) -> str:
        expr = f"CAP{slot}[{offset}]" if ok is None else f"_read(CAP{slot}, {offset}, {ok}, BAD)"
        return f"({expr} != 0)" if dtype == torch.bool else expr

    def assign(self, var: str, expr: str, dtype: torch.dtype) -> str:
        if dtype == F32:  # float32 arithmetic: 1.0 → 1.0f (a bare literal is a double in C++)
            expr = _DOUBLE.sub(r"\1f", expr)
        return f"const {self.type(dtype)} {var} = {expr};"


_DOUBLE = re.compile(r"(?<![\w.])(\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)(?![\w.])")
CPP = _Cpp()


class _CppBackward(codegen._Backward):
    """The backward's gradient reads for C++: a uniform read's share summed into ``u<k>`` (a
    reduction of the row's loop, added once after it), a varying one's written to ``TMP`` with its
    offset (added after the loop). ``base``: each gradient slot's start in the flat ``GRAD``."""

    def __init__(self, em: codegen._Emitter, base: dict[int, int]) -> None:
        super().__init__(em)
        self.base = base
        self.uniform: list[tuple[codegen.Load, str]] = []  # (the read, its accumulator)
        self.varying: list[codegen.Load] = []

    def atomic(self, load: codegen.Load, g: str) -> str:
        keep = "nz" if load.ok is None else f"(nz & ({load.ok}))"
        share = f"({keep} ? static_cast<float>({g}) : 0.0f)"
        if not load.varies:
            acc = f"u{len(self.uniform)}"
            self.uniform.append((load, acc))
            return f"{acc} += {share};"
        k = len(self.varying)
        self.varying.append(load)
        at = f"static_cast<int32_t>({load.offset})" + ("" if load.ok is None else f" * static_cast<int32_t>({load.ok})")
        return f"TMP[{k} * n + j] = {share}; TOFF[{k} * n + j] = {at};"


_PRELUDE = r"""// Generated by attnzero.cpu_mods from a score_mod (do not edit: regenerated on use).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "fast_math.h"  // azm::exp, log, tanh, ... (attnzero/csrc)

namespace {
using azm::INF;

// A captured tensor's element at `off`; where an index was out of range (ok false) 0, and `bad`
// set: az_mod_fwd returns it, and the kernel raises IndexError, as torch's indexing does. The load
// is made at offset 0 then, so that the loop stays a plain gather the compiler vectorises.
template <class T, class I> inline T _read(const T* p, I off, bool ok, int32_t& bad) {
  bad |= static_cast<int32_t>(!ok);
  const T x = p[off * static_cast<I>(ok)];
  return ok ? x : T(0);
}
inline bool _and(bool a, bool b) { return a & b; }
inline bool _or(bool a, bool b) { return a | b; }
inline bool _xor(bool a, bool b) { return a ^ b; }
template <class T> inline T _abs(T x) { return x < T(0) ? T(0) - x : x; }
inline float _abs(float x) { return std::fabs(x); }
inline double _abs(double x) { return std::fabs(x); }
template <class T> inline T _trunc(T x) { return std::trunc(x); }
template <class T> inline T _sign(T x) { return static_cast<T>((x > T(0)) - (x < T(0))); }
// Integer division and remainder as C++ (toward 0), safe where torch would raise (a divisor of 0
// gives 0) or overflow (the lowest value by −1 wraps, as torch's).
template <class T> inline bool _minus_one(T b) { return std::is_signed<T>::value && b == T(-1); }  // (not uint8's 255)
template <class T> inline T _truncdiv(T a, T b) { return b == T(0) ? T(0) : (_minus_one(b) ? T(0) - a : a / b); }
template <class T> inline T _truncmod(T a, T b) { return (b == T(0) || _minus_one(b)) ? T(0) : a % b; }
template <class T> inline T _floordiv(T a, T b) {  // torch rounds toward −inf
  const T q = _truncdiv(a, b);
  return q - static_cast<T>((q * b != a) & ((a < T(0)) != (b < T(0))));
}
template <class T> inline T _remainder(T a, T b) {  // the sign of b, as torch's
  const T r = _truncmod(a, b);
  return ((r != T(0)) & ((r < T(0)) != (b < T(0)))) ? r + b : r;
}
// Floats as torch computes them: fmod exact, the sign of a; remainder the sign of b; floor division
// as c10's div_floor_floating ((a − fmod(a, b)) / b, one less where the remainder's sign is not b's,
// rounded to the nearest whole number; b = 0 gives a / b).
template <class T> inline T _ffmod(T a, T b) { return std::fmod(a, b); }
template <class T> inline T _fremainder(T a, T b) {
  const T m = std::fmod(a, b);
  return (m != T(0) && ((b < T(0)) != (m < T(0)))) ? m + b : m;
}
template <class T> inline T _ffloordiv(T a, T b) {
  if (b == T(0)) return a / b;
  const T m = std::fmod(a, b);
  T d = (a - m) / b;
  if (m != T(0) && ((b < T(0)) != (m < T(0)))) d -= T(1);
  if (d == T(0)) return std::copysign(T(0), a / b);
  T f = std::floor(d);
  if (d - f > T(0.5)) f += T(1);
  return f;
}
template <class T> inline T _maxf(T a, T b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }  // NaN wins
template <class T> inline T _minf(T a, T b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
template <class T> inline T _maxi(T a, T b) { return a > b ? a : b; }
template <class T> inline T _mini(T a, T b) { return a < b ? a : b; }

}  // namespace
"""


@dataclass(frozen=True)
class _Source:
    """A mod as C++: ``text``; ``slots[i]`` where ``CAP<i>`` comes from — its index in the tensors
    of ``mods.fingerprint(fn)`` (read afresh at every call), or the tensor itself when the mod made
    it (a constant of the trace); ``grads``: ``(slot, index in mods.captured_tensors(fn), start in
    GRAD)`` for each tensor that gets a gradient; ``total`` GRAD's doubles; ``tmp`` the backward's
    scratch floats per key."""

    text: str
    slots: tuple[int | Tensor, ...]
    grads: tuple[tuple[int, int, int], ...]
    total: int
    tmp: int


def _indent(lines: list[str], n: int = 8) -> str:
    return "".join(" " * n + line.replace("\n", "\n" + " " * n) + "\n" for line in lines)


def _translate(fn: mods.ScoreMod, grads: bool, reached: list[Tensor]) -> _Source:
    """The mod as C++ (see the module docstring); ``reached``: the tensors of ``mods.fingerprint``.
    Raises ``codegen.NotGenerable`` naming what cannot be generated, ``mods.ModError`` for a mod that
    returns another dtype than the score's."""
    em, out, out_node = codegen.translate(fn, torch.device("cpu"), grads=grads, lang=CPP)
    captured = em.captured
    slots: list[int | Tensor] = []
    decls: list[str] = []
    for i, t in enumerate(em.tensors):
        if t.device.type != "cpu":
            raise codegen.NotGenerable(f"score_mod: reads a tensor on {t.device}; the inputs are on the CPU")
        if t.numel() > _INT_MAX:
            raise codegen.NotGenerable(f"score_mod: reads a tensor of {t.numel()} elements (2^31 or more)")
        arg = torch.uint8 if t.dtype == torch.bool else t.dtype
        if arg in (torch.float16, torch.bfloat16):
            raise codegen.NotGenerable(f"score_mod: reads a {t.dtype} tensor (cast it to float32 for the CPU kernel)")
        ty = CPP.type(arg)
        decls.append(f"const {ty}* __restrict CAP{i} = static_cast<const {ty}*>(CAP[{i}]);")
        slots.append(next((j for j, c in enumerate(reached) if c is t), t))
    fwd_lines = list(em.lines)
    head = (
        "    const int32_t b = static_cast<int32_t>(b_), h = static_cast<int32_t>(h_), "
        "q_idx = static_cast<int32_t>(i_);\n    (void)b, (void)h, (void)q_idx;\n" + _indent(decls, 4)
    )
    text = _PRELUDE + (
        '\nextern "C" int32_t az_mod_fwd(float* __restrict S, int64_t n, int64_t b_, int64_t h_, int64_t i_, '
        "int64_t j0_, const void* const* CAP) {\n" + head + "    int32_t BAD = 0;  // an index out of range\n"
        "#pragma omp simd reduction(| : BAD)\n"
        "    for (int64_t j = 0; j < n; ++j) {\n"
        "        const int32_t kv_idx = static_cast<int32_t>(j0_ + j);\n        const float score = S[j];\n"
        "        (void)kv_idx, (void)score;\n"
        + _indent(fwd_lines)
        + f"        S[j] = {em.cast(out, F32)};\n    }}\n    return BAD;\n}}\n"
    )
    grad_slots: list[tuple[int, int, int]] = []
    total = tmp = 0
    if grads:
        base: dict[int, int] = {}
        for i, t in enumerate(em.tensors):
            j = next((j for j, c in enumerate(captured) if c is t), None)
            if j is not None and t.requires_grad and t.dtype.is_floating_point:
                base[i] = total
                grad_slots.append((i, j, total))
                total += t.numel()
        bwd = _CppBackward(em, base)
        dx, lines = bwd.run(out_node) if out_node is not None else ("0.0f", [])
        uniform = [acc for _, acc in bwd.uniform]
        sums = f" reduction(+ : {', '.join(uniform)})" if uniform else ""
        reduction = f"#pragma omp simd{sums} reduction(| : BAD)\n"  # (BAD: the forward reported it)
        tail = [f"GRAD[{bwd.base[ld.slot]} + {ld.offset} * static_cast<int32_t>({ld.ok or 'true'})] += {acc};"
                for ld, acc in bwd.uniform]  # fmt: skip
        scatter = "".join(
            f"    for (int64_t j = 0; j < n; ++j) GRAD[{bwd.base[ld.slot]} + TOFF[{k} * n + j]] += TMP[{k} * n + j];\n"
            for k, ld in enumerate(bwd.varying)
        )
        tmp = 2 * len(bwd.varying)
        text += (
            '\nextern "C" void az_mod_bwd(const float* __restrict X, float* __restrict DY, int64_t n, int64_t b_, '
            "int64_t h_, int64_t i_, int64_t j0_, const void* const* CAP, double* __restrict GRAD, "
            "float* __restrict TMP) {\n" + head
            + f"    int32_t* __restrict TOFF = reinterpret_cast<int32_t*>(TMP + {len(bwd.varying)} * n);\n"
            + "    (void)GRAD, (void)TOFF;\n    int32_t BAD = 0;\n"
            + "".join(f"    float {acc} = 0.0f;\n" for acc in uniform)
            + reduction + "    for (int64_t j = 0; j < n; ++j) {\n"
            "        const int32_t kv_idx = static_cast<int32_t>(j0_ + j);\n"
            "        const float score = X[j], dy = DY[j];\n        const bool nz = dy != 0.0f;\n"
            "        (void)kv_idx, (void)score, (void)nz;\n"
            + _indent(fwd_lines + lines)
            + f"        DY[j] = nz ? static_cast<float>({dx}) : 0.0f;\n    }}\n"
            + scatter
            + (
                "    if (n > 0) {  // the uniform reads' offsets, from the row's first pair\n"
                "        const int64_t j = 0;\n        const int32_t kv_idx = static_cast<int32_t>(j0_);\n"
                "        const float score = X[0];\n        (void)j, (void)kv_idx, (void)score;\n"
                + _indent(fwd_lines + tail) + "    }\n"
                if uniform else ""
            )
            + "}\n"
        )  # fmt: skip
    return _Source(text, tuple(slots), tuple(grad_slots), total, tmp)


# ---------------------------------------------------------------------------------------------
# Building and loading


def _flags() -> list[str]:
    """The compiler's flags: optimised, the CPU's vector width (the kernel's, ``cpu_kernel._cpu_flags``),
    ``#pragma omp simd`` honoured, integer overflow wrapping as torch's, each operation rounded as
    torch's are (no fused multiply-add made from ``a * b + c``: a floor division or a remainder near
    a multiple of b turns one rounding into a whole step)."""
    isa = [f for f in cpu_kernel._cpu_flags() if f.startswith("-m")]
    return ["-O3", "-fno-math-errno", "-fwrapv", "-ffp-contract=off", "-fopenmp-simd", "-fPIC", "-shared", *isa,
            f"-I{cpu_kernel.HEADER.parent}"]  # fmt: skip


_lock = ForkSafeLock()
_warned: set[str] = set()


def _build(text: str) -> ctypes.CDLL | None:
    """The library of ``text`` (built unless already in the cache directory), or None after one
    warning that says why (no compiler, a cache that cannot be written, a failing build)."""
    cxx = os.environ.get("CXX") or "c++"
    flags = _flags()
    key = hashlib.sha256("\0".join([text, cpu_kernel.HEADER.read_text(), cxx, *flags]).encode()).hexdigest()[:24]
    folder = Path(cpu_kernel.cache_dir()) / "cpu_mods"
    path = folder / f"mod_{key}.so"
    why = None
    if not path.exists():
        if shutil.which(cxx.split()[0]) is None:
            why = f"no C++ compiler: {cxx!r} not found (install g++, or point $CXX at one)"
        else:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                src = folder / f".mod_{key}.{os.getpid()}.{threading.get_ident()}.cpp"
                tmp = src.with_suffix(".so")
                src.write_text(text)
                try:
                    cmd = [*cxx.split(), *flags, str(src), "-o", str(tmp)]
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
                    if done.returncode != 0:
                        lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines()
                        why = f"the build failed: {(lines[0] if lines else 'no output')[:300]}"
                    else:
                        os.replace(tmp, path)  # whole or absent: processes building the same mod race safely
                finally:
                    for f in (src, tmp):
                        f.unlink(missing_ok=True)
            except OSError as e:
                why = f"cannot write the cache directory {folder}: {e} (set $ATTNZERO_CACHE to a writable directory)"
    if why is None:
        try:
            return ctypes.CDLL(str(path))
        except OSError as e:
            why = f"cannot load {path}: {e}"
    if why not in _warned:
        _warned.add(why)
        warnings.warn(
            f"attnzero: a score_mod cannot run in the CPU kernel — {why}. It runs on flash.py's tiles instead "
            "(the same results, slower).",
            RuntimeWarning,
            stacklevel=4,
        )
    return None


@dataclass(frozen=True)
class _Built:
    source: _Source
    lib: ctypes.CDLL
    fwd: int  # the functions' addresses
    bwd: int


# Mods met in this process, keyed by ``mods.fingerprint`` (the mod's code and everything it reads):
# tracing costs milliseconds, compiling a third of a second. None: the mod cannot be generated or built.
_CACHE: dict[tuple[Any, ...], _Built | None] = {}
_CACHE_MAX = 512


def _get(fn: mods.ScoreMod, grads: bool) -> tuple[_Built | None, list[Tensor]]:
    """The mod built (None: it cannot be generated or built) and the tensors it reads now."""
    fp, reached = mods.fingerprint(fn)  # (None: nothing may be kept by it)
    key = (fp, grads)
    if fp is not None and key in _CACHE:
        return _CACHE[key], reached
    with _lock:
        if fp is not None and key in _CACHE:
            return _CACHE[key], reached
        built: _Built | None = None
        with codegen.reads_of_values() as reads:  # a trace that read a tensor's value holds it
            try:
                source = _translate(fn, grads, reached)
            except codegen.NotGenerable:
                source = None
        if source is not None:
            lib = _build(source.text)
            if lib is not None:
                fwd = ctypes.cast(lib.az_mod_fwd, ctypes.c_void_p).value or 0
                bwd = (ctypes.cast(lib.az_mod_bwd, ctypes.c_void_p).value or 0) if grads else 0
                built = _Built(source, lib, fwd, bwd)
        if fp is not None and not reads:
            if len(_CACHE) >= _CACHE_MAX:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[key] = built
        return built, reached


@dataclass
class Bound:
    """A built mod with this call's tensors: what ``cpu_kernel.forward`` / ``backward`` pass on."""

    built: _Built
    tensors: list[Tensor]  # CAP<i>, as the C++ reads them (contiguous; bool as uint8), kept alive
    caps: Tensor  # their data pointers, int64

    def forward_args(self) -> tuple[int, Tensor]:
        return self.built.fwd, self.caps

    def backward_args(self, grad: Tensor | None) -> tuple[int, int, Tensor, Tensor | None, int]:
        return self.built.fwd, self.built.bwd, self.caps, grad, self.built.source.tmp


def _bind(built: _Built, reached: list[Tensor]) -> Bound:
    tensors = [codegen._as_kernel_arg(reached[s] if isinstance(s, int) else s) for s in built.source.slots]
    caps = torch.tensor([t.data_ptr() for t in tensors] or [0], dtype=torch.int64)
    return Bound(built, tensors, caps)


# ---------------------------------------------------------------------------------------------
# The backend entry


class _ModKernel(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sink: Tensor | None, options: dict[str, Any],
        *captured: Tensor,
    ) -> tuple[Tensor, Tensor]:
        out, lse = cpu_kernel.forward(q, k, v, bias=bias, **options["kernel"], mod=options["mod"], out_f32=True)
        if sink is not None:  # the sink joins each row's softmax (sinks.py); the backward takes (O₂, lse₂)
            out, lse = sinks.fold(out, lse, sink)
        # the captured tensors: inputs so that they get gradients, saved so that one changed in place
        # before the backward is refused by autograd (the kernel reads options["mod"]'s pointers)
        ctx.save_for_backward(q, k, v, bias, sink, out, lse, *captured)
        ctx.options, ctx.mask_seen = options, version_of(options["kernel"]["mask"])
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # lse is returned as non-differentiable
        q, k, v, bias, sink, out, lse, *_ = ctx.saved_tensors  # (unpacked: autograd's check of the captured)
        unchanged(ctx.mask_seen)  # (the same check for the mask)
        options, needs = ctx.options, ctx.needs_input_grad  # (q, k, v, bias, sink, options, *captured)
        bound, captured = options["mod"], options["captured"]
        dsink = sinks.grad(dout, out, lse, sink) if sink is not None and needs[4] else None
        if reference.needs_graph(dout):  # create_graph=True, or a batched dout: autograd through the formula
            return reference.function_backward_with_graph(
                dout, q, k, v, bias, sink, needs, options["reference"], captured
            )
        bias_grad = bias is not None and needs[3]
        if flash.row_shift(lse, bias, options["reference"]["score_mod"]) is not None:
            # rows whose lse needs a shift (a huge score on every key they keep): flash.py's backward
            flash_grads: list[Tensor | None] = []
            dq, dk, dv, dbias = flash.backward(
                dout, q, k, v, out, lse, bias=bias, bias_grad=bias_grad, **options["reference"],
                captured_grads=flash_grads,
            )  # fmt: skip
            return dq, dk, dv, dbias, dsink, None, *(g if needs[6 + j] else None for j, g in enumerate(flash_grads))
        src = bound.built.source
        grad = torch.zeros(torch.get_num_threads(), src.total, dtype=torch.float64) if src.total else None
        dq, dk, dv, dbias = cpu_kernel.backward(
            dout, q, k, v, out, lse, bias=bias, bias_grad=bias_grad, **options["kernel"], mod=bound, mod_grad=grad
        )
        grads: list[Tensor | None] = [None] * len(captured)
        if grad is not None:
            summed = grad.sum(0)
            for _slot, j, start in src.grads:
                if needs[6 + j]:
                    t = captured[j]
                    grads[j] = summed[start : start + t.numel()].view(t.shape).to(t.dtype)
        return dq, dk, dv, (dbias if bias_grad else None), dsink, None, *grads


def attention(
    q: Tensor, k: Tensor, v: Tensor, *, score_mod: mods.ScoreMod, mask: Tensor | Mask | None = None,
    bias: Tensor | None = None, causal: bool = False, window: geometry.Window = None, scale: float,
    softcap: float | None = None, dropout_p: float = 0.0, dropout_seed: int = 0, sink: Tensor | None = None,
) -> tuple[Tensor, Tensor] | None:
    """The compiled kernel with ``score_mod`` as generated C++: ``(out, lse)``, differentiable in q,
    k, v, bias, ``sink`` (attention sinks, folded into the result: ``sinks.py``) and the tensors the
    mod captures — or None when the mod cannot be generated or built (the caller then runs it on
    flash.py). The caller has checked that the kernel takes the inputs (``functional._takes_kernel``)."""
    captured = mods.captured_tensors(score_mod)
    inputs = (q, k, v, bias, sink, *captured)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    built, reached = _get(score_mod, needs_grad)
    if built is None:
        return None
    bound = _bind(built, reached)
    kernel: dict[str, Any] = {
        "mask": mask, "causal": causal, "window": window, "scale": scale, "softcap": softcap, "dropout_p": dropout_p,
        "dropout_seed": dropout_seed,
    }  # fmt: skip
    if not needs_grad:
        if sink is None:
            return cpu_kernel.forward(q, k, v, bias=bias, **kernel, mod=bound)
        out, lse = sinks.fold(*cpu_kernel.forward(q, k, v, bias=bias, **kernel, mod=bound, out_f32=True), sink)
        return out.to(q.dtype), lse  # (rounded once, after the fold: as with a gradient)
    ref = {**kernel, "score_mod": score_mod}
    options = {"kernel": kernel, "mod": bound, "captured": captured, "reference": ref}
    out, lse = _ModKernel.apply(q, k, v, bias, sink, options, *captured)
    return out, lse


__all__ = ["CPP", "attention"]
