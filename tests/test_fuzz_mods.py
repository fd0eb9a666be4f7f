"""Fuzz of programmable attention: random score_mods and mask_mods on every backend that runs them,
against a float64 golden of this file's own.

Each case is drawn from one integer seed (``draw(seed, run)``) and written as Python *source*, so
that a failing case prints as a reproducer: a ``score_mod(score, b, h, q_idx, kv_idx)`` built from
random expressions over the score and the indices (arithmetic, ``//`` and ``%``, ``torch.where``,
comparisons and logical ops, exp / log / tanh / sigmoid / sqrt / powers / rounding / clamps, float64
round trips), reading captured tables: float tables with and without ``requires_grad`` (float32 or
float64), int tables (int8 to int64, uint8; document ids, sorted or not) and bool tables, always
indexed in range (``% n``, ``clamp``, or a negative index ``% n - n``); sometimes -inf for some
pairs. Maybe a ``mask_mod(b, h, q_idx, kv_idx)`` of the same kind (``az.masks.from_mod``, at several
block sizes), and GQA, Lq != Lk, Dv != D, causal, a bias, softcap, sinks (with their gradient), a
scale, and a loss that includes the lse. No float16 / bfloat16 round trips: a discontinuous mod
of a 16-bit rounding flips between tilings (not a bug), and the rounding of gradients through one
is tested in tests/test_triton_mods.py and tests/test_cpu_mods.py.

The golden calls the mod once on broadcast int32 index tensors and the dense (B, Hq, Lq, Lk) float64
scores, then softcap, bias, mask, causal (bottom-right), softmax with the sink as one more logit,
and float64 autograd for every gradient (q, k, v, bias, sinks and the captured float tables). Each
result is judged by ``attnzero.testing``'s rule against the float32 reference backend:

    err(backend in float32) <= 2 × err(reference in float32) + floor      (3× for gradients)

NaN never passing. A draw the rule cannot judge — the golden has NaN, a kept score beyond 1e4, or
the float32 reference itself off by more than its sanity bound (a mod that amplifies roundings) —
is replaced by the next draw of the same seed (``attempt``); that is rare, and a case needing more
than ``MAX_ATTEMPTS`` fails.

Three runs: ``kernel`` (backend="flash" on CPU with the compiled kernel: the mod as generated C++,
``cpu_mods.py``; skipped under ``ATTNZERO_NO_BUILD=1``, which ``flash_py`` covers), ``flash_py``
(``cpu_mods.attention`` refused: flash.py's tiles) and ``triton`` (under Triton's interpreter on CPU:
few, small cases, drawn again while the mod cannot be generated for Triton). ``test_kernel_ran_
generated_code`` checks that most ``kernel`` cases did run generated code, so that run cannot pass
by always falling back to flash.py.

A failing case prints the mod, its tables, shapes and options, and a reproducer::

    PYTHONPATH=src:tests python -c "import test_fuzz_mods as f; f.replay(SEED, 'kernel')"

Environment: ``ATTNZERO_FUZZ_MODS`` multiplies the number of cases of each run (default 1: 80
kernel, 250 flash_py, 10 triton cases), ``ATTNZERO_FUZZ_SEED`` offsets the seeds, e.g.
``ATTNZERO_FUZZ_MODS=20 pytest tests/test_fuzz_mods.py -q -x``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import absent, kernel_built, need_kernel

import attnzero as az
from attnzero import cpu_mods
from attnzero.testing import Kind, magnitude, reference_verdict, verdict

SCALE = float(os.environ.get("ATTNZERO_FUZZ_MODS", "1"))
BASE_SEED = int(os.environ.get("ATTNZERO_FUZZ_SEED", "0"))
COUNTS = {"kernel": round(80 * SCALE), "flash_py": round(250 * SCALE), "triton": round(10 * SCALE)}
FIRST_SEED = {"kernel": 0, "flash_py": 1_000_000, "triton": 2_000_000}  # each run draws its own cases
MAX_ATTEMPTS = 6
MIN_GENERATED = 0.7  # the fraction of kernel cases that must run generated C++

F32, F64 = torch.float32, torch.float64
VARIABLE = re.compile(r"\b(?:score|b|h|q_idx|kv_idx|T\d+)\b")


def seeds(run: str) -> list[int]:
    return [FIRST_SEED[run] + BASE_SEED + i for i in range(COUNTS[run])]


# ---------------------------------------------------------------------------------------------
# Drawing a case: a score_mod and a mask_mod as source


def is_const(expr: str) -> bool:
    """Whether ``expr`` reads no variable (a Python number, not a tensor)."""
    return VARIABLE.search(expr) is None


@dataclass
class Table:
    kind: str  # "f" (float), "i" (int), "b" (bool)
    shape: tuple[int, ...]
    dtype: str
    grad: bool = False
    scale: float = 1.0


class Gen:
    """Random expressions over ``score``, ``b``, ``h``, ``q_idx``, ``kv_idx`` and captured tables
    (``self.tables``, shared by a score_mod and its mask_mod). ``score_ok``: whether ``score`` may
    appear (False for a mask_mod)."""

    def __init__(self, rng: random.Random, tables: dict[str, Table], score_ok: bool = True) -> None:
        self.r = rng
        self.tables = tables
        self.score_ok = score_ok

    def table(self, kind: str) -> str:
        """A captured table of ``kind``: an existing one at times, else a new one."""
        r = self.r
        same = [n for n, t in self.tables.items() if t.kind == kind]
        if same and r.random() < 0.3:
            return r.choice(same)
        name = f"T{len(self.tables)}"
        shape = tuple(r.choice([1, 2, 3, 5, 7, 16, 33, 67]) for _ in range(r.choice([1, 1, 2, 2, 3])))
        if kind == "f":
            spec = Table("f", shape, r.choice(["float32", "float32", "float32", "float64"]), r.random() < 0.6,
                         r.choice([0.1, 1.0, 3.0]))  # fmt: skip
        elif kind == "i":
            spec = Table("i", shape, r.choice(["int32", "int64", "int64", "int8", "uint8", "int16"]))
        else:
            spec = Table("b", shape, "bool")
        self.tables[name] = spec
        return name

    def index(self, name: str, depth: int, narrow: bool = False) -> str:
        """``name[...]`` with one in-range index per dimension (``narrow``: each made int64)."""
        idx = []
        for n in self.tables[name].shape:
            e = self.it(depth - 1, small=True)
            way = self.r.random()
            if way < 0.5:
                s = f"({e}) % {n}"
            elif way < 0.75:
                s = f"torch.clamp({e}, 0, {n - 1})"
            else:
                s = f"({e}) % {n} - {n}"  # negative, in range: counts from the end as in torch
            idx.append(f"({s}).long()" if narrow else s)
        return f"{name}[{', '.join(idx)}]"

    def tensor(self, make: Callable[[], str], tries: int, fallback: Callable[[], str]) -> str:
        """An expression from ``make`` that is a tensor, not a bare Python number (else ``fallback``)."""
        for _ in range(tries):
            e = make()
            if not is_const(e):
                return e
        return fallback()

    def it(self, depth: int, small: bool = False) -> str:
        """An int expression that is a tensor."""
        return self.tensor(lambda: self.iexpr(depth, small), 6, lambda: self.r.choice(["q_idx", "kv_idx", "h"]))

    def iexpr(self, depth: int, small: bool = False) -> str:
        """An int expression (``small``: without table reads, for an index)."""
        r = self.r
        if depth <= 0 or r.random() < 0.3:
            return r.choice(["b", "h", "q_idx", "kv_idx", "q_idx", "kv_idx", str(r.randint(-4, 20))])
        c = r.random()
        d = depth - 1
        if c < 0.2:
            return f"({self.iexpr(d, small)} {r.choice(['+', '-'])} {self.iexpr(d, small)})"
        if c < 0.27:
            return f"({self.iexpr(d, small)} * {r.randint(-3, 5)})"
        if c < 0.36:
            return f"({self.iexpr(d, small)} {r.choice(['//', '%'])} {r.choice([1, 2, 3, 4, 7, -2, -3])})"
        if c < 0.40:
            return f"torch.{r.choice(['remainder', 'fmod'])}({self.it(d, small)}, {r.choice([2, 3, 5, -3])})"
        if c < 0.44:
            mode = r.choice(["floor", "trunc"])
            return f"torch.div({self.it(d, small)}, ({self.iexpr(d, small)}) % 5 + 1, rounding_mode='{mode}')"
        if c < 0.49:
            return f"torch.abs({self.it(d, small)})"
        if c < 0.55:
            return f"torch.{r.choice(['minimum', 'maximum'])}({self.it(d, small)}, {self.it(d, small)})"
        if c < 0.59:
            lo = r.randint(-3, 5)
            return f"torch.clamp({self.it(d, small)}, {lo}, {lo + r.randint(0, 30)})"
        if c < 0.66:
            return f"torch.where({self.bt(d, ints_only=True)}, {self.iexpr(d, small)}, {self.iexpr(d, small)})"
        if c < 0.72:
            return f"({self.iexpr(d, small)} {r.choice(['&', '|', '^'])} {r.randint(0, 15)})"
        if c < 0.74:
            return f"torch.sign({self.it(d, small)})"
        if c < 0.88 and not small:
            t = self.table("i")
            e = self.index(t, d)
            if self.tables[t].dtype in ("int8", "uint8", "int16"):
                return f"{e}.long()" if r.random() < 0.6 else f"({e} + {r.randint(0, 9)})"
            return e
        if c < 0.94 and not self.score_ok:
            return f"(({self.iexpr(d, small)}) & 31)"
        return f"({self.iexpr(d, small)} + {self.iexpr(d, small)})"

    def bt(self, depth: int, ints_only: bool = False) -> str:
        """A bool expression that is a tensor."""
        return self.tensor(lambda: self.bexpr(depth, ints_only), 6, lambda: "(q_idx >= kv_idx)")

    def bexpr(self, depth: int, ints_only: bool = False) -> str:
        """A bool expression (``ints_only``: not reading float values)."""
        r = self.r
        c = r.random()
        d = depth - 1
        if depth <= 0 or c < 0.35:
            return f"({self.it(d)} {r.choice(['<', '<=', '>', '>=', '==', '!='])} {self.iexpr(d)})"
        if c < 0.45 and not ints_only and self.score_ok:
            return f"({self.ft(d)} {r.choice(['<', '>', '>=', '<='])} {r.choice(['0.0', '0.5', '-1.0', '2'])})"
        if c < 0.6:
            return f"({self.bexpr(d, ints_only)} {r.choice(['&', '|', '^'])} {self.bexpr(d, ints_only)})"
        if c < 0.67:
            op = r.choice(["and", "or", "xor"])
            return f"torch.logical_{op}({self.bt(d, ints_only)}, {self.bt(d, ints_only)})"
        if c < 0.74:
            return f"(~{self.bt(d, ints_only)})"
        if c < 0.78:
            return f"torch.logical_not({self.bt(d, ints_only)})"
        if c < 0.86:
            return self.index(self.table("b"), d)
        if c < 0.93:  # document ids: the same id at the query and at the key
            t = self.table("i")
            e = self.index(t, 1, narrow=self.tables[t].dtype in ("int8", "uint8", "int16"))
            swapped = e.replace("q_idx", "KV__").replace("kv_idx", "q_idx").replace("KV__", "kv_idx")
            return f"({e} == {swapped})"
        return f"(({self.iexpr(d)} % {r.choice([2, 3, 4])}) == 0)"

    def ft(self, depth: int) -> str:
        """A float expression that is a tensor."""
        return self.tensor(lambda: self.fexpr(depth), 5, lambda: "score" if self.score_ok else "(q_idx).float()")

    FUNCTIONS = (
        "torch.exp(torch.clamp({x}, -20.0, 8.0))", "torch.exp2(torch.clamp({x}, -20.0, 8.0))",
        "torch.log(torch.abs({x}) + 0.5)", "torch.log2(torch.abs({x}) + 1)", "torch.tanh({x})",
        "torch.sigmoid({x})", "torch.sqrt(torch.abs({x}) + 0.25)", "torch.rsqrt(torch.abs({x}) + 1.0)",
        "torch.sin({x})", "torch.cos({x})", "torch.abs({x})", "torch.sign({x})", "torch.floor({x})",
        "torch.ceil({x})", "({x}) ** 2", "({x}) ** 3", "torch.square({x})",
        "torch.reciprocal(torch.abs({x}) + 0.5)", "(torch.abs({x}) + 0.1) ** 0.5",
        "(torch.abs({x}) + 0.1) ** 1.5", "2.0 ** torch.clamp({x}, -10.0, 5.0)",
        "torch.clamp({x}, min=-1.5)", "torch.clamp({x}, max=2.5)", "torch.clamp({x}, -3.0, 3.0)",
        "torch.clamp_min({x}, 0.0)",
    )  # fmt: skip

    def fexpr(self, depth: int) -> str:
        """A float expression."""
        r = self.r
        if depth <= 0 or r.random() < 0.25:
            c = r.random()
            if c < 0.45 and self.score_ok:
                return "score"
            if c < 0.6:
                return r.choice(["0.5", "-1.25", "2.0", "0.1", "3", "1e-3", "0.7071067811865476"])
            if c < 0.85:
                return self.index(self.table("f"), depth - 1)
            return f"({self.it(1)}).float()"
        c = r.random()
        d = depth - 1
        if c < 0.15:  # (each function once in about 150 nodes)
            return r.choice(self.FUNCTIONS).format(x=self.ft(d))
        c = r.random()
        if c < 0.18:
            return f"({self.fexpr(d)} {r.choice(['+', '-', '*'])} {self.fexpr(d)})"
        if c < 0.24:
            return f"({self.fexpr(d)} {r.choice(['+', '-', '*'])} {self.iexpr(d)})"
        if c < 0.28:
            return f"({self.fexpr(d)} / {r.choice(['3.0', '-7', '0.25'])})"
        if c < 0.31:
            return f"({self.fexpr(d)} / (torch.abs({self.ft(d)}) + 1.0))"
        if c < 0.33:
            return f"(-{self.ft(d)})"
        if c < 0.45:
            return r.choice(self.FUNCTIONS).format(x=self.ft(d))
        if c < 0.5:
            return f"torch.{r.choice(['minimum', 'maximum'])}({self.ft(d)}, {self.ft(d)})"
        if c < 0.6:
            return f"torch.where({self.bt(d)}, {self.fexpr(d)}, {self.fexpr(d)})"
        if c < 0.64:
            den, mode = r.choice(["2.0", "3", "-1.5"]), r.choice(["floor", "trunc"])
            return f"torch.div({self.ft(d)}, {den}, rounding_mode='{mode}')"
        if c < 0.67:
            return f"torch.{r.choice(['remainder', 'fmod'])}({self.ft(d)}, {r.choice(['2.0', '3', '-1.5'])})"
        if c < 0.70:
            return f"torch.div({self.fexpr(d)}, {r.choice(['2.0', '0.75'])}, rounding_mode='floor')"
        if c < 0.75:  # a float64 round trip (no 16-bit ones: see the module's docstring)
            return f"({self.ft(d)}).double()"
        if c < 0.78:
            value, dtype = r.choice(["0.1", "1.7", "-0.3"]), r.choice(["float64", "float32"])
            return f"torch.tensor({value}, dtype=torch.{dtype}).float() * {self.fexpr(d)}"
        if c < 0.82:
            return f"({self.ft(d)} * {self.bt(d)})"
        if c < 0.86:
            return f"({self.it(d)}).float() * {self.fexpr(d)}"
        if c < 0.9:
            return self.index(self.table("f"), d)
        return f"({self.fexpr(d)} + {self.fexpr(d)})"


@dataclass
class Case:
    seed: int
    attempt: int
    shapes: dict[str, int]
    score_src: str
    mask_src: str | None
    causal: bool
    bias: bool
    block: int | tuple[int, int] | None
    scale: float | None
    softcap: float | None
    sinks: bool
    lse_loss: bool
    specs: dict[str, Table]
    tables: dict[str, torch.Tensor] = field(repr=False)
    data_seed: int = 0  # of q, k, v, dout, bias, sinks, dlse

    def describe(self) -> str:
        lines = [f"case seed={self.seed} (attempt {self.attempt}): {self.shapes} causal={self.causal} "
                 f"bias={self.bias} scale={self.scale} softcap={self.softcap} sinks={self.sinks} "
                 f"lse_loss={self.lse_loss} mask block={self.block}"]  # fmt: skip
        for n, sp in self.specs.items():
            lines.append(f"  {n}: {sp.dtype}{list(sp.shape)} requires_grad={sp.grad}: {self.tables[n].tolist()}")
        lines.append(self.score_src.rstrip())
        if self.mask_src:
            lines.append(self.mask_src.rstrip())
        return "\n".join(lines)


def draw(seed: int, run: str, attempt: int = 0) -> Case:
    """The case of ``seed`` (its ``attempt``-th draw) for ``run`` (triton: small shapes)."""
    r = random.Random(seed * 7919 + 17 + 1_000_003 * attempt)
    small = run == "triton"
    sizes = [1, 2, 3, 5, 8, 17, 33] if small else [1, 2, 5, 16, 17, 33, 67, 130]
    B = r.choice([1, 1, 2] if small else [1, 1, 2, 3])
    Hkv = r.choice([1, 1, 2] if small else [1, 1, 2, 3])
    Hq = Hkv * r.choice([1, 1, 2] if small else [1, 1, 2, 3])
    Lq, Lk = r.choice(sizes), r.choice(sizes)
    if r.random() < 0.3:
        Lk = Lq
    D = r.choice([1, 4, 8, 16, 24] if small else [1, 4, 8, 17, 32, 64])
    Dv = D if r.random() < 0.7 else r.choice([2, 8, 16])
    specs: dict[str, Table] = {}
    g = Gen(r, specs)
    body = g.fexpr(r.choice([1, 2, 3, 3, 4]))
    if is_const(body) or ("score" not in body and r.random() < 0.8):
        body = f"(score {r.choice(['+', '*', '-'])} {body})"
    if r.random() < 0.2:  # some pairs blocked by -inf
        body = f"torch.where({g.bt(2)}, {body}, float('-inf'))"
    score_src = f"def score_mod(score, b, h, q_idx, kv_idx):\n    return ({body}).to(score.dtype)\n"
    mask_src = None
    if r.random() < 0.4:
        mask_src = f"def mask_mod(b, h, q_idx, kv_idx):\n    return {Gen(r, specs, False).bt(r.choice([1, 2, 3]))}\n"
    causal = r.random() < 0.3
    bias = r.random() < 0.15
    block = r.choice([None, 8, 16, (4, 8), 32])
    softcap = r.choice([None, None, None, None, 5.0, 30.0])
    sinks = r.random() < 0.15
    lse_loss = r.random() < 0.3
    gen = torch.Generator().manual_seed(seed * 8 + attempt)
    tables: dict[str, torch.Tensor] = {}
    for n, t in specs.items():
        dtype = getattr(torch, t.dtype)
        if t.kind == "f":
            x = (torch.randn(t.shape, generator=gen, dtype=F64) * t.scale).to(dtype)
        elif t.kind == "i":
            lo, hi = (0, 60) if t.dtype == "uint8" else (-20, 40)
            x = torch.randint(lo, hi, t.shape, generator=gen).to(dtype)
            if r.random() < 0.3:  # document ids, sorted
                x = x.flatten().sort().values.reshape(t.shape)
        else:
            x = torch.rand(t.shape, generator=gen) < r.choice([0.2, 0.5, 0.8])
        tables[n] = x
    shapes = dict(B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, Dv=Dv)
    return Case(seed, attempt, shapes, score_src, mask_src, causal, bias, block, r.choice([None, None, 0.3, 1.0]),
                softcap, sinks, lse_loss, specs, tables, seed * 8 + attempt + 1)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Running a case


@dataclass
class Run:
    out: torch.Tensor
    lse: torch.Tensor
    grads: dict[str, torch.Tensor]


def make_mods(case: Case, dtype: torch.dtype | None) -> tuple[Callable[..., Any], Callable[..., Any] | None,
                                                            dict[str, torch.Tensor]]:  # fmt: skip
    """(score_mod, mask_mod or None, {name: float table with requires_grad}) with the float tables in
    ``dtype`` (None: as drawn)."""
    ns: dict[str, Any] = {"torch": torch, "math": math}
    leaves: dict[str, torch.Tensor] = {}
    for n, t in case.tables.items():
        x = t.clone()
        if x.is_floating_point():
            x = x if dtype is None else x.to(dtype)
            if case.specs[n].grad:
                leaves[n] = x.requires_grad_(True)
        ns[n] = x
    # The case is its source (what a failure prints, to rerun by hand): exec defines the functions.
    exec(case.score_src, ns)
    if case.mask_src:
        exec(case.mask_src, ns)
    return ns["score_mod"], ns.get("mask_mod"), leaves


def inputs(case: Case, dtype: torch.dtype = F32) -> dict[str, torch.Tensor]:
    """q, k, v, dout, and bias, sinks, dlse where the case has them, in ``dtype``."""
    s = case.shapes
    g = torch.Generator().manual_seed(case.data_seed)
    xs = {
        "q": torch.randn(s["B"], s["Hq"], s["Lq"], s["D"], generator=g),
        "k": torch.randn(s["B"], s["Hkv"], s["Lk"], s["D"], generator=g),
        "v": torch.randn(s["B"], s["Hkv"], s["Lk"], s["Dv"], generator=g),
        "dout": torch.randn(s["B"], s["Hq"], s["Lq"], s["Dv"], generator=g),
    }
    if case.bias:
        xs["bias"] = torch.randn(1, s["Hq"], s["Lq"], s["Lk"], generator=g)
    if case.sinks:
        xs["sinks"] = torch.randn(s["Hq"], generator=g) * 2
    if case.lse_loss:
        xs["dlse"] = torch.randn(s["B"], s["Hq"], s["Lq"], generator=g)
    return {n: x.to(dtype) for n, x in xs.items()}


def loss_grads(case: Case, out: torch.Tensor, lse: torch.Tensor, xs: dict[str, torch.Tensor],
               leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # fmt: skip
    """Gradients of <out, dout> (+ <lse, dlse> over finite lse) w.r.t. q, k, v, bias, sinks and the
    captured float tables with requires_grad."""
    ts = {n: xs[n] for n in ("q", "k", "v", "bias", "sinks") if n in xs} | leaves
    outs, cotangents = [out], [xs["dout"]]
    if "dlse" in xs and lse.requires_grad:  # (not when the scores read nothing with a gradient)
        fin = torch.isfinite(lse.detach())
        outs.append(torch.where(fin, lse, 0.0))
        cotangents.append(torch.where(fin, xs["dlse"], 0.0))
    gs = torch.autograd.grad(outs, list(ts.values()), cotangents, allow_unused=True)
    return {n: (torch.zeros_like(t) if g is None else g).detach() for (n, t), g in zip(ts.items(), gs)}


def run_backend(case: Case, backend: str) -> Run:
    """az.attention on the case in float32 (the tables as drawn): out, lse, gradients."""
    s = case.shapes
    xs = inputs(case)
    for n in ("q", "k", "v", "bias", "sinks"):
        if n in xs:
            xs[n].requires_grad_(True)
    score_mod, mask_mod, leaves = make_mods(case, None)
    mask = None
    if mask_mod is not None:
        mask = az.masks.from_mod(mask_mod, s["B"], s["Hq"], s["Lq"], s["Lk"], block_size=case.block)
    out, lse = az.attention(xs["q"], xs["k"], xs["v"], score_mod=score_mod, mask=mask, bias=xs.get("bias"),
                            causal=case.causal, scale=case.scale, softcap=case.softcap, sinks=xs.get("sinks"),
                            backend=backend, return_lse=True)  # fmt: skip
    return Run(out.detach(), lse.detach(), loss_grads(case, out, lse, xs, leaves))


@dataclass
class Golden:
    run: Run
    smax: float  # the largest |score| of a kept pair
    p: torch.Tensor  # the weights (B, Hq, Lq, Lk)
    slope: float  # the largest |d score_mod / d score| of a kept pair: what dq's and dk's terms carry
    table_terms: dict[str, float]  # per captured table: the size of the terms its gradient sums


def golden(case: Case) -> Golden:
    """Independent float64 evaluation: dense scores, the mod called once on broadcast index tensors."""
    s = case.shapes
    xs = inputs(case, F64)
    for n in ("q", "k", "v", "bias", "sinks"):
        if n in xs:
            xs[n].requires_grad_(True)
    score_mod, mask_mod, leaves = make_mods(case, F64)
    rep = s["Hq"] // s["Hkv"]
    kk, vv = xs["k"].repeat_interleave(rep, 1), xs["v"].repeat_interleave(rep, 1)
    scale = case.scale if case.scale is not None else s["D"] ** -0.5
    S = scale * xs["q"] @ kk.transpose(-1, -2)
    full = S.shape

    def index(n: int, dim: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int32).view([-1 if i == dim else 1 for i in range(4)])

    b, h, qi, ki = index(s["B"], 0), index(s["Hq"], 1), index(s["Lq"], 2), index(s["Lk"], 3)
    Y = torch.broadcast_to(score_mod(S, b, h, qi, ki), full).to(F64)
    if case.softcap:
        Y = case.softcap * torch.tanh(Y / case.softcap)
    if "bias" in xs:
        Y = Y + xs["bias"]
    keep = torch.ones(full, dtype=torch.bool)
    if mask_mod is not None:
        keep = keep & torch.broadcast_to(mask_mod(b, h, qi, ki), full).to(torch.bool)
    if case.causal:
        keep = keep & (ki <= qi + s["Lk"] - s["Lq"])
    Y = torch.where(keep, Y, -math.inf)
    valid = torch.isfinite(Y.amax(-1, keepdim=True))
    Ys = torch.where(valid, Y, 0.0)
    if "sinks" not in xs:
        lse = torch.logsumexp(Ys, -1)
        P = torch.exp(Ys - lse[..., None]) * valid
        lse = torch.where(valid[..., 0], lse, -math.inf)
    else:  # the sink: one more logit in each row
        sink = xs["sinks"].view(1, -1, 1, 1).expand(full[0], -1, full[2], 1)
        lse = torch.logsumexp(torch.cat([Y, sink], -1), -1)  # (finite: a row of -inf scores has lse = sink)
        P = torch.exp(Y - lse[..., None])
    out = P @ vv
    grads = loss_grads(case, out, lse, xs, leaves)
    # The size of the terms each captured table's gradient sums: (dL/dy) × Σ over kept pairs of |dy/dT|.
    ds = float(xs["dout"].abs().max()) * float(xs["v"].detach().abs().max())
    ds += float(xs["dlse"].abs().max()) if "dlse" in xs else 0.0
    terms: dict[str, float] = {}
    for n, t in leaves.items():
        terms[n] = ds * table_terms(score_mod, S.detach(), (b, h, qi, ki), t, keep)
    kept = Y.detach()[torch.isfinite(Y.detach())]
    smax = float(kept.abs().max()) if kept.numel() else 0.0
    return Golden(Run(out.detach(), lse.detach(), grads), smax, P.detach(), score_slope(score_mod, S, (b, h, qi, ki),
                  keep & torch.isfinite(Y.detach())), terms)  # fmt: skip


def score_slope(score_mod: Callable[..., Any], S: torch.Tensor, idx: tuple[torch.Tensor, ...],
                kept: torch.Tensor) -> float:  # fmt: skip
    """max over kept pairs of |dy/ds| (the mod is elementwise in the score)."""
    x = S.detach().requires_grad_(True)
    y = torch.broadcast_to(score_mod(x, *idx), S.shape).to(F64)
    if not y.requires_grad:
        return 0.0
    (d,) = torch.autograd.grad(y.sum(), x, allow_unused=True)
    return 0.0 if d is None or not kept.any() else float(d.abs()[kept].max())


def table_terms(score_mod: Callable[..., Any], S: torch.Tensor, idx: tuple[torch.Tensor, ...], t: torch.Tensor,
                keep: torch.Tensor) -> float:  # fmt: skip
    """max over the entries of ``t`` of Σ over kept pairs of |dy/dt| (y the mod's value), from the
    signs of each pair's summed derivative: J_p = Σ_i dy_p/dt_i (by a double backward), then
    |Σ_p sign(J_p) dy_p/dt_i|."""
    y = torch.broadcast_to(score_mod(S, *idx), S.shape).to(F64)
    if not y.requires_grad:  # the tables are read in comparisons only
        return 0.0
    u = torch.zeros(S.shape, dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad(y, t, u, create_graph=True, allow_unused=True)
    if g is None:
        return 0.0
    if not g.requires_grad:  # dy/dt does not depend on the cotangent: a mod with no derivative in t
        return 0.0
    (J,) = torch.autograd.grad(g, u, torch.ones_like(t), allow_unused=True)
    if J is None:
        return 0.0
    (G,) = torch.autograd.grad(y, t, (torch.sign(J) * keep).detach(), allow_unused=True)
    return 0.0 if G is None else float(G.abs().max())


def judge(case: Case, gold: Golden, got: Run, ref: Run | None) -> list[str]:
    """Every result of ``got`` failing the tolerance rule against the golden, with ``ref`` (the float32
    reference) as the baseline; ``ref`` None: ``got`` is the reference, held to its sanity bound."""
    s = case.shapes
    xs = inputs(case, F64)
    ds = float(xs["dout"].abs().max()) * float(xs["v"].abs().max())
    ds += float(xs["dlse"].abs().max()) if "dlse" in xs else 0.0
    colsum = float(gold.p.sum(2).max()) if gold.p.numel() else 0.0
    sc = abs(case.scale) if case.scale is not None else s["D"] ** -0.5
    # the size of the terms each gradient sums (as tests/conftest.py's grad_units)
    dy = ds * max(1.0, gold.slope)  # dq's and dk's terms: dL/dy · dy/ds
    units = {"q": sc * float(xs["k"].abs().max()) * dy, "k": sc * float(xs["q"].abs().max()) * dy * colsum,
             "v": float(xs["dout"].abs().max()) * colsum, "bias": ds, "sinks": ds * s["Lq"] * s["B"]}  # fmt: skip
    items: list[tuple[str, Kind, torch.Tensor, torch.Tensor | None, torch.Tensor, float | None]] = [
        ("out", "out", got.out, None if ref is None else ref.out, gold.run.out, None),
        ("lse", "lse", got.lse, None if ref is None else ref.lse, gold.run.lse, None),
    ]
    for n, g in gold.run.grads.items():
        size = magnitude(g, ds, units.get(n, 0.0), gold.table_terms.get(n, 0.0))
        items.append((f"d{n}", "grad", got.grads[n], None if ref is None else ref.grads[n], g, size))
    fails = []
    for name, kind, x, rx, gx, size in items:
        # (the inputs are float32: a float64 table's gradient carries float32 roundings too)
        if rx is None:
            v = reference_verdict(x, gx, kind=kind, name=name, size=size, scores=gold.smax, bound_dtype=F32)
        else:
            v = verdict(x, rx, gx, kind=kind, name=name, size=size, scores=gold.smax, floor_dtype=F32)
        if not v.ok:
            fails.append(v.message)
    return fails


def usable(case: Case) -> tuple[Golden, Run] | str:
    """(golden, float32 reference) of a case the rule can judge, else why not."""
    gold = golden(case)
    if any(torch.isnan(t).any() for t in (gold.run.out, gold.run.lse, *gold.run.grads.values())):
        return "the golden has NaN"
    if gold.smax > 1e4:
        return f"a kept score of {gold.smax:.3g}"
    ref = run_backend(case, "reference")
    ill = judge(case, gold, ref, None)
    if ill:
        return "the float32 reference is off (an ill-conditioned mod): " + ill[0]
    return gold, ref


def prepare(seed: int, run: str) -> tuple[Case, Golden, Run]:
    """The first usable draw of ``seed``: the case, its golden and its float32 reference."""
    why: list[str] = []
    for attempt in range(MAX_ATTEMPTS):
        case = draw(seed, run, attempt)
        if run == "triton" and not triton_generates(case):
            why.append(f"attempt {attempt}: not generable for Triton")
            continue
        got = usable(case)
        if not isinstance(got, str):
            return case, *got
        why.append(f"attempt {attempt}: {got}")
    pytest.fail(f"seed {seed}: no usable draw in {MAX_ATTEMPTS} attempts:\n" + "\n".join(why), pytrace=False)


def triton_generates(case: Case) -> bool:
    """Whether the case's mod can be generated as Triton code (backend="triton" refuses the others by
    name, tested in tests/test_triton_mods.py)."""
    from attnzero.kernels import codegen

    score_mod, _, _ = make_mods(case, None)
    try:
        codegen.score_mod(score_mod, torch.device("cpu"), grads=True)
    except codegen.NotGenerable:
        return False
    return True


def route(mp: pytest.MonkeyPatch, run: str, ran: list[bool]) -> None:
    """``run``'s setting of cpu_mods.attention for the rest of the test: refused for flash_py (flash.py's
    tiles run the mod); for kernel, a spy appending to ``ran`` whether each call ran generated code."""
    real = cpu_mods.attention

    def refuse(*args: Any, **kwargs: Any) -> None:
        return None

    def spy(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)
        ran.append(got is not None)
        return got

    if run == "flash_py":
        mp.setattr(cpu_mods, "attention", refuse)
    elif run == "kernel":
        mp.setattr(cpu_mods, "attention", spy)


BACKEND = {"kernel": "flash", "flash_py": "flash", "triton": "triton"}
GENERATED: dict[int, bool] = {}  # kernel seed -> whether its case ran generated C++ (this process)


def check(seed: int, run: str, mp: pytest.MonkeyPatch) -> list[str]:
    """Every failure of ``seed``'s case on ``run``, and its description last ([] when it passes)."""
    case, gold, ref = prepare(seed, run)
    ran: list[bool] = []
    route(mp, run, ran)
    try:
        got = run_backend(case, BACKEND[run])
        fails = judge(case, gold, got, ref)
    except Exception as e:  # reported with the case, as any other failure
        fails = [f"{run}: raised {type(e).__name__}: {e}"]
    if run == "kernel":
        GENERATED[seed] = any(ran)
        path = "generated C++" if any(ran) else "flash.py (the mod was not generated)"
        fails = [f"{f} [{path}]" for f in fails]
    if fails:
        fails.append(case.describe())
    return fails


def replay(seed: int, run: str = "kernel") -> None:
    """Rerun one case by hand and print it and what fails."""
    with pytest.MonkeyPatch.context() as mp:
        fails = check(seed, run, mp)
    print("\n".join(fails) if fails else f"seed {seed} passes on {run}")


def fail_with(fails: list[str], seed: int, run: str) -> None:
    if fails:
        how = f'  reproduce: PYTHONPATH=src:tests python -c "import test_fuzz_mods as f; f.replay({seed}, {run!r})"'
        pytest.fail("\n".join([*fails, how]), pytrace=False)


def need_triton() -> None:
    """Skip without triton on a user's machine; under CI (which installs it) its absence fails."""
    if importlib.util.find_spec("triton") is None:
        absent("backend='triton' needs `pip install triton`")


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("seed", seeds("kernel"))
def test_mod_kernel(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """backend="flash" on CPU with the compiled kernel: the mod as generated C++ where it can be."""
    need_kernel()
    fail_with(check(seed, "kernel", monkeypatch), seed, "kernel")


@pytest.mark.parametrize("seed", seeds("flash_py"))
def test_mod_flash_py(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """backend="flash" on flash.py's tiles (the generated C++ refused)."""
    fail_with(check(seed, "flash_py", monkeypatch), seed, "flash_py")


@pytest.mark.parametrize("seed", seeds("triton"))
def test_mod_triton(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """backend="triton" (the interpreter on CPU): the mod as generated Triton code."""
    need_triton()
    fail_with(check(seed, "triton", monkeypatch), seed, "triton")


def test_kernel_ran_generated_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most kernel cases ran generated C++ (not flash.py): from the cases this process ran, and the
    forward of the others (run elsewhere by pytest-xdist, or deselected)."""
    need_kernel()
    assert kernel_built()
    for seed in seeds("kernel"):
        if seed not in GENERATED:
            case = prepare(seed, "kernel")[0]
            ran: list[bool] = []
            route(monkeypatch, "kernel", ran)
            run_backend(case, "flash")
            monkeypatch.undo()
            GENERATED[seed] = any(ran)
    n = sum(GENERATED[s] for s in seeds("kernel"))
    assert n >= MIN_GENERATED * COUNTS["kernel"], f"only {n} of {COUNTS['kernel']} kernel cases ran generated C++"
