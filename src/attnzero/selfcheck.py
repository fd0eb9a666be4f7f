"""``attnzero check``: every backend that can run on this machine, against the reference.

For each backend, device and dtype X, a few awkward cases (GQA, Lq ≠ Lk, a single decoding query,
padding masks, causal, a window, a bias, rows that keep no key) run forward and backward, and are
compared with the golden — the reference backend in float64 — by DESIGN.md's rule
(``attnzero.testing``): the backend's error in X may be at most 2× (outputs) / 3× (gradients) the
error of the reference backend in X, plus a floor of about one rounding in X.
The reference backend itself is checked the same way against torch's own
``scaled_dot_product_attention`` (float64 golden, torch in X as the baseline). NaN never passes.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import masks
from .functional import BACKENDS, attention
from .testing import Verdict, max_error, verdict


@dataclass(frozen=True)
class Case:
    """One input configuration: q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D)."""

    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    causal: bool = False
    padding: bool = False
    window: tuple[int | None, int | None] | None = None
    bias: bool = False

    def __str__(self) -> str:
        extra = [n for n in ("causal", "padding", "bias") if getattr(self, n)]
        extra += [f"window={self.window}"] if self.window else []
        shape = f"B{self.B} H{self.Hq}/{self.Hkv} L{self.Lq}x{self.Lk} D{self.D}"
        return shape + (f" {'+'.join(extra)}" if extra else "")


CASES = (
    Case(2, 4, 4, 37, 37, 64, causal=True),
    Case(2, 4, 2, 17, 113, 40, padding=True, bias=True),
    Case(1, 8, 1, 1, 65, 96, causal=True),  # MQA, one decoding query against a cache of 65 keys
    Case(1, 2, 2, 50, 50, 8, window=(7, 3)),
    Case(1, 4, 2, 40, 24, 16, causal=True),  # bottom-right: queries 0..15 keep no key (0, never NaN)
)


@dataclass
class Row:
    """One line of the table."""

    backend: str
    device: str
    dtype: str
    out_err: float
    grad_err: float
    verdict: str  # "ok", "FAIL" or "unavailable"
    note: str = ""


def availability(backend: str, device: torch.device) -> str | None:
    """None when ``backend`` can run on ``device`` here, else the reason it cannot."""
    if backend in ("reference", "flash"):  # plain PyTorch: they run wherever attnzero imports
        return None
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (it comes with torch's CUDA wheels)"
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "triton runs on CUDA, or on the CPU only under TRITON_INTERPRET=1"
        try:
            importlib.import_module("attnzero.kernels.triton_backend")
        except ImportError as e:
            return f"attnzero.kernels.triton_backend cannot be imported ({e})"
        return None
    return f"unknown backend {backend!r}"


def _inputs(case: Case, device: torch.device, gen: torch.Generator) -> dict[str, Tensor | None]:
    """float64 inputs for ``case``; the mask (B, 1, 1, Lk) and bias (1, Hq, Lq, Lk) when it asks."""
    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)

    keep = None
    if case.padding:
        lengths = torch.randint(1, case.Lk + 1, (case.B,), generator=gen)
        lengths[0] = case.Lk
        keep = (torch.arange(case.Lk)[None, :] < lengths[:, None])[:, None, None, :].to(device)  # (B, 1, 1, Lk)
    return {
        "q": rand(case.B, case.Hq, case.Lq, case.D),
        "k": rand(case.B, case.Hkv, case.Lk, case.D),
        "v": rand(case.B, case.Hkv, case.Lk, case.D),
        "dout": rand(case.B, case.Hq, case.Lq, case.D),
        "mask": keep,
        "bias": rand(1, case.Hq, case.Lq, case.Lk) if case.bias else None,
    }


Runner = Callable[[Tensor, Tensor, Tensor, Case, Tensor | None, Tensor | None], Tensor]


def _attnzero(backend: str) -> Runner:
    def run(q: Tensor, k: Tensor, v: Tensor, case: Case, keep: Tensor | None, bias: Tensor | None) -> Tensor:
        out = attention(q, k, v, mask=keep, bias=bias, causal=case.causal, window=case.window,
                        backend=backend)  # type: ignore[arg-type]
        assert isinstance(out, Tensor)
        return out
    return run


def _torch_sdpa(q: Tensor, k: Tensor, v: Tensor, case: Case, keep: Tensor | None, bias: Tensor | None) -> Tensor:
    """The same attention written with torch's SDPA: one float mask holding causal, window, padding, bias."""
    full = torch.ones(1, 1, case.Lq, case.Lk, dtype=torch.bool, device=q.device)
    if case.causal:
        full = full & masks.causal(case.Lq, case.Lk).to_tensor(q.device)
    if case.window is not None:
        full = full & masks.window(case.Lq, case.Lk, *case.window).to_tensor(q.device)
    if keep is not None:
        full = full & keep
    # a row that keeps no key gives 0 (torch's softmax of a row of -inf is NaN): it reads key 0 here,
    # and its output is then set to 0, which also gives it no share of any gradient
    empty = ~full.any(-1, keepdim=True)  # (B|1, 1, Lq, 1)
    safe = full | (empty & (torch.arange(case.Lk, device=q.device) == 0))
    add = torch.zeros(safe.shape, dtype=q.dtype, device=q.device) if bias is None else bias.to(q.dtype)
    add = add.masked_fill(~safe, float("-inf"))  # (B|1, H|1, Lq, Lk)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=add, enable_gqa=case.Hq != case.Hkv)
    return out.masked_fill(empty, 0.0)


@dataclass
class Errors:
    """One case in one dtype: the worst errors of the run (NaN where it gave NaN) and the rule's
    verdict on each of out, dq, dk, dv."""

    out: float
    grad: float
    verdicts: list[Verdict]


def _errors(run: Runner, golden: Runner, base: Runner, case: Case, dtype: torch.dtype, device: torch.device,
            seed: int) -> Errors:
    """``run`` in dtype against ``golden`` in float64, with ``base`` in dtype as the baseline."""
    gen = torch.Generator().manual_seed(seed)
    x = _inputs(case, device, gen)

    def forward_backward(fn: Runner, dt: torch.dtype) -> list[Tensor]:
        # fresh leaves each time: (B, H, L, D) copies in dtype dt
        q, k, v = (x[n].detach().to(dt).clone().requires_grad_(True) for n in ("q", "k", "v"))  # type: ignore[union-attr]
        bias = x["bias"].to(dt) if x["bias"] is not None else None
        out = fn(q, k, v, case, x["mask"], bias)
        out.backward(x["dout"].to(dt))  # type: ignore[union-attr]
        return [out.detach(), *(t.grad for t in (q, k, v))]  # type: ignore[list-item]

    gold = forward_backward(golden, torch.float64)
    got = forward_backward(run, dtype)
    ref = forward_backward(base, dtype)
    names = ("out", "dq", "dk", "dv")
    verdicts = [verdict(a, r, g, kind="out" if n == "out" else "grad", name=n)
                for n, a, r, g in zip(names, got, ref, gold)]  # fmt: skip

    def shown(a: Tensor, g: Tensor) -> float:
        return math.nan if torch.isnan(a).any() else max_error(a, g)

    return Errors(shown(got[0], gold[0]), max(shown(a, g) for a, g in zip(got[1:], gold[1:])), verdicts)


def devices() -> list[torch.device]:
    found = [torch.device("cpu")]
    if torch.cuda.is_available():
        found.append(torch.device("cuda"))
    return found


def dtypes(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":
        return [torch.float32, torch.float16, torch.bfloat16]
    return [torch.float64, torch.float32, torch.bfloat16]


def steps(quick: bool = False, backends: tuple[str, ...] | None = None) -> int:
    """How many (backend, device, dtype, case) runs :func:`run` will report to ``on_step``."""
    names = backends if backends is not None else tuple(b for b in BACKENDS if b != "auto")
    return len(names) * sum(len(dtypes(d)) for d in devices()) * (1 if quick else len(CASES))


def run(
    quick: bool = False,
    backends: tuple[str, ...] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> list[Row]:
    """Check every backend (default: all but "auto") on every device here; one Row per combination.
    ``on_step(description)`` is called once per (backend, device, dtype, case), for a progress bar."""
    names = backends if backends is not None else tuple(b for b in BACKENDS if b != "auto")
    cases = CASES[:1] if quick else CASES

    def step(text: str, n: int = 1) -> None:
        if on_step is not None:
            for _ in range(n):
                on_step(text)

    rows: list[Row] = []
    for device in devices():
        for name in names:
            reason = availability(name, device)
            if reason is not None:
                rows.append(Row(name, device.type, "-", float("nan"), float("nan"), "unavailable", reason))
                step(f"{name} unavailable", len(dtypes(device)) * len(cases))
                continue
            golden: Runner = _torch_sdpa if name == "reference" else _attnzero("reference")
            base: Runner = _torch_sdpa if name == "reference" else _attnzero("reference")
            for dtype in dtypes(device):
                worst_out = worst_grad = 0.0
                ok = True
                note = ""
                done = 0
                try:
                    for i, case in enumerate(cases):
                        errs = _errors(_attnzero(name), golden, base, case, dtype, device, i)
                        done += 1
                        step(f"{name} {device.type} {str(dtype).removeprefix('torch.')}")
                        worst_out, worst_grad = max(worst_out, errs.out), max(worst_grad, errs.grad)
                        if not all(errs.verdicts) and ok:
                            ok, note = False, f"first failure: {case}"
                        if math.isnan(errs.out) or math.isnan(errs.grad):
                            worst_out = worst_grad = float("nan")
                except Exception as e:  # a crash is a failure, reported in the table
                    ok, note = False, f"{type(e).__name__}: {e}"
                    step("", len(cases) - done)
                if ok:
                    note = "vs torch SDPA" if name == "reference" else ""
                rows.append(Row(name, device.type, str(dtype).removeprefix("torch."), worst_out, worst_grad,
                                "ok" if ok else "FAIL", note))
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a plain-text table."""
    head = ("backend", "device", "dtype", "max err out", "max err grad", "verdict", "")
    body = [
        (r.backend, r.device, r.dtype,
         "-" if r.verdict == "unavailable" else f"{r.out_err:.1e}",
         "-" if r.verdict == "unavailable" else f"{r.grad_err:.1e}", r.verdict, r.note)
        for r in rows
    ]
    widths = [max(len(str(x[i])) for x in (head, *body)) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths[:-1]))
    return "\n".join(lines)


def main(quick: bool = False) -> int:
    """The ``attnzero check`` command: run, with a progress bar on stderr (rich's when installed, else
    a dot per step), then print the table and a summary. Exit status 1 when a check failed or none
    could run, else 0."""
    total = steps(quick=quick)
    if importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("[bold]{task.description:<24}"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
        # the bar goes to stderr: stdout keeps only the table
        with Progress(*columns, TimeElapsedColumn(), transient=True, console=Console(stderr=True)) as progress:
            task = progress.add_task("checking", total=total)
            rows = run(quick=quick, on_step=lambda d: progress.update(task, advance=1, description=d))
    else:  # without the hf extra: a dot per step
        rows = run(quick=quick, on_step=lambda d: print(".", end="", flush=True, file=sys.stderr))
        print(file=sys.stderr)
    print(format_table(rows))
    failed = [r for r in rows if r.verdict == "FAIL"]
    ran = [r for r in rows if r.verdict in ("ok", "FAIL")]
    print(f"\n{len(ran)} checks run, {len(failed)} failed, "
          f"{sum(r.verdict == 'unavailable' for r in rows)} unavailable here")
    return 1 if failed or not ran else 0
