"""backend="triton" on a CUDA GPU: correctness first, then speed against torch's SDPA backends.

    python benchmarks/gpu.py [--budget S] [--tests S]  # the full run on a CUDA machine (< 6 minutes on an H200)
    python benchmarks/gpu.py --dry-run            # no GPU: the same steps on tiny shapes under Triton's
                                                  #   CPU interpreter (checks the script, not the speed)
    python benchmarks/gpu.py --compile-check      # no GPU: compile every kernel variant for sm_90

What it does, in order (nothing is built besides the Triton kernels):

1. Ceilings: the card's measured bf16 matmul TFLOP/s (8192³) and copy GB/s (4 GiB), printed first.
2. Correctness: bfloat16 and float16 runs of ``az.attention(..., backend="triton")`` — forward,
   lse, gradients, the split-KV decode path — against a float32 golden (the reference backend in
   float32 with IEEE products), by DESIGN.md's rule: error ≤ 2× (outputs) / 3× (gradients) the
   error of the reference backend in the same dtype, plus a floor of one rounding.
3. Training shapes: B·L = 16k tokens, H = 16, D ∈ {64, 128}, L ∈ {1k, 2k, 4k, 8k, 16k}, causal and
   not, forward and forward+backward, bf16. Medians of ``triton.testing.do_bench`` for ours and for
   every SDPA backend that runs here (flash, efficient, cuDNN). FLOPs: forward 4·B·H·L²·D (×0.5
   causal), forward+backward 3.5× the forward.
4. Decode: one query per sequence, B ∈ {1, 16, 64}, Lk ∈ {4k, 32k, 128k}, 32 query / 8 key-value
   heads, D = 128, bf16, in GB/s of K/V read (B·Hkv·Lk·2·D·2 bytes), timed in CUDA graphs so that
   Python overhead is not counted (for ours and SDPA alike).
0. With ``--tests S``: the Triton test files first, on the GPU (at most S seconds).
5. Against ``torch.compile(flex_attention)``: forward, inference, B=4 H=16 L=4096 D=128 bf16, causal,
   softcap, ALiBi as a score_mod and documents as a BlockMask (both through ``attnzero.flex``), a
   sliding window.
6. The tables, last; everything also goes to JSON (``--out``, default out/gpu.json). Each step that
   raises is reported and counted as a failure, and the next one runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
if "--compile-check" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
import triton.testing

import attnzero as az
from attnzero.testing import Kind, verdict

TIME_BUDGET_S = 330.0  # stop timing new grid points after this (the whole run must stay < 6 min); --budget


# ---------------------------------------------------------------------------------------------
# Timing


def bench(fn: Callable[[], Any], *, graph: bool = False, reset: list[torch.Tensor] | None = None) -> float:
    """Median milliseconds of ``fn()``: triton's do_bench on CUDA (in a CUDA graph when ``graph``),
    perf_counter medians on CPU (dry runs)."""
    if torch.cuda.is_available():
        if graph:
            try:
                return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
            except Exception as e:  # a path that cannot be captured is timed plainly
                print(f"    (CUDA graph capture failed: {type(e).__name__}; timing without a graph)")
        return float(triton.testing.do_bench(fn, warmup=10, rep=60, grad_to_none=reset, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def ceilings(dev: torch.device, dry: bool) -> dict[str, float]:
    """Measured bf16 matmul TFLOP/s and copy GB/s of the device."""
    n = 256 if dry else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    tflops = 2 * n**3 / (ms * 1e-3) / 1e12
    nbytes = (1 << 20) if dry else (4 << 30)
    src = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms_copy = bench(lambda: dst.copy_(src))
    gbs = 2 * nbytes / (ms_copy * 1e-3) / 1e9  # read + write
    return {"matmul_bf16_tflops": tflops, "copy_gbs": gbs}


# ---------------------------------------------------------------------------------------------
# Correctness (DESIGN.md's rule, float32 golden)


def _run(backend: str, dtype: torch.dtype, xs: dict[str, torch.Tensor], dout: torch.Tensor | None,
         kw: dict[str, Any]) -> dict[str, torch.Tensor]:
    t = {n: x.detach().to(dtype).requires_grad_(dout is not None) for n, x in xs.items()}
    out, lse = az.attention(t["q"], t["k"], t["v"], bias=t.get("bias"), backend=backend, return_lse=True, **kw)
    res = {"out": out.detach(), "lse": lse.detach()}
    if dout is not None:
        grads = torch.autograd.grad(out, list(t.values()), dout.to(dtype))
        res.update({f"d{n}": g for n, g in zip(t, grads)})
    return res


def check(name: str, dtype: torch.dtype, shape: tuple[int, ...], grads: bool = True, **kw: Any) -> list[str]:
    """Ours (triton) in ``dtype`` vs the float32 reference; returns the failures."""
    B, Hq, Hkv, Lq, Lk, D, *rest = shape
    Dv = rest[0] if rest else D
    dev = DEVICE
    g = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode()))

    def rnd(*s: int) -> torch.Tensor:  # rounded to dtype, kept in float32: the golden sees the same inputs
        return torch.randn(*s, generator=g).to(dtype).float().to(dev)

    xs = {"q": rnd(B, Hq, Lq, D), "k": rnd(B, Hkv, Lk, D), "v": rnd(B, Hkv, Lk, Dv)}
    if kw.pop("bias", False):
        xs["bias"] = rnd(1, Hq, Lq, Lk)
    dout = rnd(B, Hq, Lq, Dv) if grads else None
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        gold = _run("reference", torch.float32, xs, dout, kw)
        ref = _run("reference", dtype, xs, dout, kw)
        ours = _run("triton", dtype, xs, dout, kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    failures = []
    for key, gv in gold.items():
        # The floor is one rounding in the input dtype for every tensor, the lse (float32) too: the
        # golden here is float32, not float64, so float32's own floor would judge the lse against
        # a golden that is itself only float32-accurate.
        kind: Kind = "grad" if key.startswith("d") else "lse" if key == "lse" else "out"
        v = verdict(ours[key], ref[key], gv, kind=kind, name=key, floor_dtype=dtype)
        if not v.ok:
            failures.append(f"{name} {dtype} {v.message}")
    print(f"  {'ok  ' if not failures else 'FAIL'} {name:34s} {dtype!s:15s} {len(gold)} tensors")
    return failures


def correctness(dry: bool) -> list[str]:
    L = 24 if dry else 1000
    Lk_dec = 260 if dry else 5000
    cases: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
        ("causal gqa", (2, 8, 2, L, L, 128 if not dry else 32) if not dry else (1, 4, 2, L, L, 32), {"causal": True}),
        ("full lq<lk d=64", (1, 4, 4, L // 3, L + 101, 64 if not dry else 16), {}),
        ("window+bias d=96", (1, 4, 1, L // 2, L // 2, 96 if not dry else 24), {"window": (L // 8, 0), "bias": True}),
        # head dims whose 16-bit rows are not 16-byte aligned (wrong on the H200 before aligned_rows)
        ("odd dims d=59 dv=24", (1, 4, 2, L // 3, L // 2, 59, 24), {}),
        ("odd dims d=111 dv=8 causal", (1, 2, 1, L // 4, L // 4, 111, 8), {"causal": True}),
        ("decode lq=1 gqa", (4, 32, 8, 1, Lk_dec, 128) if not dry else (1, 8, 2, 1, Lk_dec, 16), {"grads": False}),
        ("decode lq=4 causal", (2, 8, 8, 4, Lk_dec, 64 if not dry else 16), {"grads": False, "causal": True}),
    ]
    failures: list[str] = []
    for dtype in (torch.bfloat16,) if dry else (torch.bfloat16, torch.float16):
        for name, shape, kw in cases:
            kw = dict(kw)
            grads = kw.pop("grads", True)
            failures += check(name, dtype, shape, grads=grads, **kw)
    return failures


# ---------------------------------------------------------------------------------------------
# Speed


def sdpa_backends() -> dict[str, Any]:
    """SDPA backends by name (those torch knows; each grid point says whether it ran)."""
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    if not torch.cuda.is_available():
        names = {"math": "MATH"}  # dry run: the CPU has only the math backend
    return {n: getattr(SDPBackend, attr) for n, attr in names.items() if hasattr(SDPBackend, attr)}


def time_sdpa(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bwd: bool,
              graph: bool = False) -> float | None:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}

    def fwd() -> torch.Tensor:
        with sdpa_kernel([backend]):
            return sdpa(q, k, v, is_causal=causal, **gqa)

    try:
        out = fwd()
        if bwd:
            dout = torch.randn_like(out)
            return bench(lambda: fwd().backward(dout), reset=[q, k, v])
        return bench(fwd, graph=graph)
    except RuntimeError as e:  # this backend does not take these inputs here
        print(f"    sdpa {backend.name}: n/a ({str(e).splitlines()[0][:80]})")
        return None


def time_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bwd: bool, graph: bool = False) -> float:
    def fwd() -> torch.Tensor:
        out = az.attention(q, k, v, causal=causal, backend="triton")
        assert isinstance(out, torch.Tensor)
        return out

    if bwd:
        dout = torch.randn_like(fwd())
        return bench(lambda: fwd().backward(dout), reset=[q, k, v])
    return bench(fwd, graph=graph)


def training_grid(dry: bool, deadline: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    tokens, H = (64, 2) if dry else (16384, 16)
    lengths = [32] if dry else [1024, 2048, 4096, 8192, 16384]
    dims = [16] if dry else [128, 64]  # D = 128 first: the shapes the targets name
    backends = sdpa_backends()
    for D in dims:
        for L in lengths:
            B = max(1, tokens // L)
            for causal in (False, True):
                for bwd in (False, True):
                    if time.perf_counter() > deadline:
                        print(f"  time budget spent: skipping D={D} L={L} causal={causal} bwd={bwd}")
                        continue
                    q, k, v = (torch.randn(B, H, L, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=bwd)
                               for _ in range(3))
                    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0) * (3.5 if bwd else 1.0)
                    row: dict[str, Any] = {"D": D, "L": L, "B": B, "H": H, "causal": causal,
                                           "pass": "fwd+bwd" if bwd else "fwd"}
                    try:
                        ms = time_ours(q, k, v, causal, bwd)
                    except Exception as e:  # one failing point is reported, the grid goes on
                        print(f"  D={D} L={L} causal={causal} bwd={bwd}: ours FAILED: {type(e).__name__}: {e}")
                        continue
                    row["ours_tflops"] = flops / (ms * 1e-3) / 1e12
                    for name, be in backends.items():
                        ms_s = time_sdpa(be, q, k, v, causal, bwd)
                        row[f"{name}_tflops"] = None if ms_s is None else flops / (ms_s * 1e-3) / 1e12
                    best = max((x for n, x in row.items() if n.endswith("_tflops") and n != "ours_tflops" and x),
                               default=None)
                    row["best_sdpa_tflops"] = best
                    row["ratio"] = None if not best else row["ours_tflops"] / best
                    rows.append(row)
                    print(f"  D={D:3d} L={L:5d} B={B:2d} {'causal' if causal else 'full  '} {row['pass']:7s} "
                          f"ours {row['ours_tflops']:7.1f} TFLOP/s  best sdpa {best or float('nan'):7.1f}", flush=True)
                    del q, k, v
    return rows


def decode_grid(dry: bool, deadline: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    Hq, Hkv, D = (8, 2, 32) if dry else (32, 8, 128)
    batches = [2] if dry else [1, 16, 64]
    lengths = [300] if dry else [4096, 32768, 131072]
    backends = sdpa_backends()
    for B in batches:
        for Lk in lengths:
            if time.perf_counter() > deadline:
                print(f"  time budget spent: skipping decode B={B} Lk={Lk}")
                continue
            q = torch.randn(B, Hq, 1, D, device=DEVICE, dtype=torch.bfloat16)
            k = torch.randn(B, Hkv, Lk, D, device=DEVICE, dtype=torch.bfloat16)
            v = torch.randn(B, Hkv, Lk, D, device=DEVICE, dtype=torch.bfloat16)
            nbytes = B * Hkv * Lk * 2 * D * 2
            row: dict[str, Any] = {"B": B, "Lk": Lk, "Hq": Hq, "Hkv": Hkv, "D": D}
            with torch.no_grad():
                try:
                    row["ours_gbs"] = nbytes / (time_ours(q, k, v, False, False, graph=True) * 1e-3) / 1e9
                except Exception as e:  # one failing point is reported, the grid goes on
                    print(f"  decode B={B} Lk={Lk}: ours FAILED: {type(e).__name__}: {e}")
                    continue
                for name, be in backends.items():
                    ms_s = time_sdpa(be, q, k, v, False, False, graph=True)
                    row[f"{name}_gbs"] = None if ms_s is None else nbytes / (ms_s * 1e-3) / 1e9
            rows.append(row)
            print(f"  decode B={B:2d} Lk={Lk:6d} ours {row['ours_gbs']:8.1f} GB/s", flush=True)
            del q, k, v
    return rows


def flex_grid(dry: bool, deadline: float) -> list[dict[str, Any]]:
    """Forward, inference, bf16: attnzero on Triton (its built-ins, and attnzero.flex with the same
    score_mod / BlockMask) against ``torch.compile(flex_attention)``, ms and attnzero's time ÷ Flex's."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from attnzero import flex as az_flex

    B, H, L, D = (1, 2, 64, 16) if dry else (4, 16, 4096, 128)
    cap, docs, window = 30.0, 8, L // 16
    compiled = torch_flex if dry else torch.compile(torch_flex)
    q, k, v = (torch.randn(B, H, L, D, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    slopes = az.masks.alibi_slopes(H).to(DEVICE)
    ids = torch.arange(L, device=DEVICE) // (L // docs)

    def causal(b: Any, h: Any, i: Any, j: Any) -> Any:
        return j <= i

    def documents(b: Any, h: Any, i: Any, j: Any) -> Any:
        return (ids[i] == ids[j]) & (j <= i)

    def sliding(b: Any, h: Any, i: Any, j: Any) -> Any:
        return (j <= i) & (i - j <= window)

    def softcap(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return cap * torch.tanh(s / cap)

    def alibi(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s + slopes[h] * (j - i)

    def block(mod: Any) -> Any:
        return create_block_mask(mod, None, None, L, L, device=str(DEVICE))

    def ours(**kw: Any) -> Callable[[], Any]:
        return lambda: az.attention(q, k, v, backend="triton", **kw)

    def ours_flex(**kw: Any) -> Callable[[], Any]:
        return lambda: az_flex.flex_attention(q, k, v, **kw)

    def theirs(**kw: Any) -> Callable[[], Any]:
        return lambda: compiled(q, k, v, **kw)

    cases: list[tuple[str, Callable[[], Callable[[], Any]], Callable[[], Callable[[], Any]]]] = [
        ("causal", lambda: ours(causal=True), lambda: theirs(block_mask=block(causal))),
        (f"softcap {cap:g}, causal", lambda: ours(causal=True, softcap=cap),
         lambda: theirs(score_mod=softcap, block_mask=block(causal))),
        ("ALiBi score_mod, causal (attnzero.flex)", lambda: ours_flex(score_mod=alibi, block_mask=block(causal)),
         lambda: theirs(score_mod=alibi, block_mask=block(causal))),
        (f"{docs} documents, causal (attnzero.flex)", lambda: ours_flex(block_mask=block(documents)),
         lambda: theirs(block_mask=block(documents))),
        (f"sliding window {window}", lambda: ours(window=(window, 0)), lambda: theirs(block_mask=block(sliding))),
    ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for name, make_ours, make_theirs in cases:
            if time.perf_counter() > deadline:
                print(f"  time budget spent: skipping flex row {name}")
                continue
            try:
                a, f = make_ours(), make_theirs()
                err = float((a().float() - f().float()).abs().max())
                ms_a, ms_f = bench(a), bench(f)
            except Exception as e:  # one failing row is reported, the others go on
                print(f"  {name}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                continue
            rows.append({"case": name, "B": B, "H": H, "L": L, "D": D, "ours_ms": ms_a, "flex_ms": ms_f,
                         "ratio": ms_a / ms_f, "max_diff": err})
            print(f"  {name:42s} ours {ms_a:8.3f} ms  flex {ms_f:8.3f} ms  ratio {ms_a / ms_f:5.2f}  "
                  f"max |diff| {err:.3g}", flush=True)
    return rows


def gpu_tests(seconds: float) -> str:
    """tests/test_triton*.py and test_ladder_triton.py with CUDA tensors (no interpreter: the kernels
    as the GPU compiles them, at the tile sizes it runs), their summary line; failures are printed."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    files = [str(p) for p in sorted((root / "tests").glob("test_*triton*.py"))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("ATTNZERO_NO_BUILD", "1")  # (the CPU kernel is not what is tested here)
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "8", "-p", "no:cacheprovider", "-rf", "--tb=line",
           "-k", "not sm90", *files]
    try:
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=seconds)
        text = done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\n(stopped after {seconds:.0f} s)"
    lines = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR", "E ")) or " passed" in line
             or " failed" in line or "stopped after" in line]
    for line in lines:
        print("  " + line[:300])
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line), "no summary")
    if " failed" in summary or "error" in summary:
        raise RuntimeError(f"Triton tests on the GPU: {summary}")
    return summary


def fmt(x: float | None, spec: str = "7.1f") -> str:
    return "n/a".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def tables(result: dict[str, Any]) -> str:
    c = result["ceilings"]
    lines = [
        f"## {result['gpu']} — {result['date']} — torch {result['torch']}, triton {result['triton']}",
        f"Ceilings: bf16 matmul {c['matmul_bf16_tflops']:.0f} TFLOP/s, copy {c['copy_gbs']:.0f} GB/s. "
        f"Correctness: {'all passed' if not result['failures'] else str(len(result['failures'])) + ' FAILED'}."
        + (f" Triton tests on this GPU: {result['tests']}." if result.get("tests") else ""),
        "",
    ]
    names = list(sdpa_backends())
    head = "| D | L | B | mask | pass | ours | " + " | ".join(names) + " | ours / best SDPA |"
    lines += ["Training shapes, bf16, TFLOP/s:", "", head, "|" + "---|" * (6 + len(names) + 1)]
    for r in result["training"]:
        cells = [str(r["D"]), str(r["L"]), str(r["B"]), "causal" if r["causal"] else "full", r["pass"],
                 fmt(r["ours_tflops"])] + [fmt(r.get(f"{n}_tflops")) for n in names]
        cells.append(fmt(r["ratio"], "5.2f"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Decode (1 query, {result['decode'][0]['Hq'] if result['decode'] else '?'} query / "
              f"{result['decode'][0]['Hkv'] if result['decode'] else '?'} kv heads), GB/s of K/V read:", "",
              "| B | Lk | ours | " + " | ".join(names) + " | ours / copy |", "|" + "---|" * (3 + len(names) + 1)]
    for r in result["decode"]:
        cells = [str(r["B"]), str(r["Lk"]), fmt(r["ours_gbs"], "8.0f")]
        cells += [fmt(r.get(f"{n}_gbs"), "8.0f") for n in names]
        cells.append(fmt(r["ours_gbs"] / c["copy_gbs"], "5.2f"))
        lines.append("| " + " | ".join(cells) + " |")
    flex = result.get("flex", [])
    if flex:
        f0 = flex[0]
        lines += ["", f"vs torch.compile(flex_attention), forward, inference, bf16, B={f0['B']} H={f0['H']} "
                  f"L={f0['L']} D={f0['D']}, attnzero's time ÷ Flex's (below 1: faster):", "",
                  "| case | ours ms | flex ms | ratio | max abs diff |", "|---|---|---|---|---|"]
        for r in flex:
            lines.append(f"| {r['case']} | {r['ours_ms']:.3f} | {r['flex_ms']:.3f} | {r['ratio']:.2f} "
                         f"| {r['max_diff']:.2g} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Compile check (no GPU needed): every kernel variant compiled for sm_90, with its resource use


SM90_SHARED_MAX = 232448  # bytes of shared memory one block may use on compute capability 9.0 (227 KiB)

# Feature sets for the compile check: the kernels' constexpr switches. "plain" is non-causal attention
# without extras (the deterministic dQ kernel); "causal" a causal band; "all" everything at once.
FEATURE_SETS: dict[str, dict[str, bool]] = {
    "plain": {"HAS_LEFT": False, "HAS_RIGHT": False, "HAS_MASK": False, "HAS_BIAS": False, "HAS_DROPOUT": False,
              "STORE_F32": False, "BIAS_GRAD": False, "ATOMIC_DQ": False, "HAS_SEGMENTS": False, "HAS_RANGES": False,
              "HAS_SOFTCAP": False},
    "causal": {"HAS_LEFT": False, "HAS_RIGHT": True, "HAS_MASK": False, "HAS_BIAS": False, "HAS_DROPOUT": False,
               "STORE_F32": True, "BIAS_GRAD": False, "ATOMIC_DQ": True, "HAS_SEGMENTS": False, "HAS_RANGES": False,
               "HAS_SOFTCAP": False},
    "all": {"HAS_LEFT": True, "HAS_RIGHT": True, "HAS_MASK": True, "HAS_BIAS": True, "HAS_DROPOUT": True,
            "STORE_F32": True, "BIAS_GRAD": True, "ATOMIC_DQ": True, "HAS_SEGMENTS": True, "HAS_RANGES": True,
            "HAS_SOFTCAP": True, "HAS_MOD": True, "HAS_MASK_MOD": True},
}


def _generated_mods() -> tuple[Any, Any]:
    """A score_mod (ALiBi slopes and a relative-position table, both with gradients) and a mask_mod
    (documents from captured ids) as codegen generates them: the "all" feature set compiles the
    kernels with these (the other sets with the identities of kernels/forward.py)."""
    from attnzero.kernels import codegen

    slopes = torch.rand(8, requires_grad=True)
    rel = torch.randn(8, 255, requires_grad=True)
    doc = torch.zeros(128, dtype=torch.int64)

    def score_mod(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s - slopes[h] * (i - j).abs() + rel[h, i - j + 127]

    def mask_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
        return (doc[i] == doc[j]) & ((j < 4) | (j <= i))

    cpu = torch.device("cpu")  # (tracing needs no GPU; the generated source does not depend on the device)
    return codegen.score_mod(score_mod, cpu, grads=True), codegen.mask_mod(mask_mod, cpu)


def compile_for_sm90(
    fn: Any, ptrs: dict[str, str], consts: dict[str, Any], warps: int, stages: int
) -> tuple[bool, str]:
    """Compile one @triton.jit kernel for compute capability 9.0 without a device (through ptxas):
    (True, its shared memory) when it compiled and fits sm_90's shared memory, else (False, why
    not). ``ptrs``: the pointer arguments' types; the others are int64 (seeds, threshold), fp32
    (scales) or int32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    i64 = {"seed_lo", "seed_hi", "threshold"}
    floats = {"qk_scale", "keep_scale", "scale", "cap_in", "cap_out"}
    sig = {n: "constexpr" if n in consts else ptrs.get(n) or ("fp32" if n in floats else "i64" if n in i64 else "i32")
           for n in fn.arg_names}
    try:
        k = triton.compile(ASTSource(fn, sig, {n: consts[n] for n in fn.arg_names if n in consts}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except Exception as e:  # the caller reports every failing variant
        lines = [line for line in str(e).splitlines() if line.strip()] or [""]
        return False, f"{type(e).__name__} {lines[0]} {lines[-1][:200]}"  # where (source line:column), what
    shared = k.metadata.shared
    if shared > SM90_SHARED_MAX:
        return False, f"needs {shared} B of shared memory, sm_90 has {SM90_SHARED_MAX}"
    return True, f"shared={shared}B"


def compile_check(dims: list[int], quick: bool = False) -> int:
    """Compile every kernel (forward, decode split and merge, backward Δ, dK/dV and dQ) for compute
    capability 9.0 without a device, in each feature set of FEATURE_SETS, and print one line per
    variant ("  ok   " or "  FAIL "); returns the number of variants that failed. ``quick``:
    bfloat16 only, the "plain" and "all" feature sets."""
    from attnzero.kernels import backward as bwd_k
    from attnzero.kernels import decode as dec_k
    from attnzero.kernels import forward as fwd_k
    from attnzero.kernels import triton_backend as tb

    failures = 0

    def one(fn: Any, ptrs: dict[str, str], consts: dict[str, Any], warps: int, stages: int, label: str = "") -> None:
        nonlocal failures
        used = {n: consts[n] for n in fn.arg_names if n in consts}
        label = label or " ".join(f"{k}={v}" for k, v in used.items())
        ok, note = compile_for_sm90(fn, ptrs, used, warps, stages)
        failures += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {fn.__name__} {label}  {note}", flush=True)

    cuda = torch.device("cuda")
    score_gen, mask_gen = _generated_mods()
    dtypes = ((torch.bfloat16, "*bf16"),) if quick else ((torch.bfloat16, "*bf16"), (torch.float32, "*fp32"))
    sets = ("plain", "all") if quick else tuple(FEATURE_SETS)
    for dtype, ty in dtypes:
        for D in dims:
            for name in sets:
                flags = {**FEATURE_SETS[name], "PRECISION": tb._precision(dtype), "TRACE": False}
                with_mods = flags.pop("HAS_MOD", False)
                flags["HAS_MOD"] = flags["HAS_MASK_MOD"] = with_mods
                flags["SCORE_MOD"] = score_gen.fwd if with_mods else fwd_k.no_score_mod
                flags["SCORE_MOD_BWD"] = score_gen.bwd if with_mods else fwd_k.no_score_mod_bwd
                flags["MASK_MOD"] = mask_gen.fwd if with_mods else fwd_k.no_mask_mod
                label = f"{str(dtype)[6:]} D={D} {name}"

                def blocks(kind: str, D: int = D, dtype: torch.dtype = dtype) -> tuple[dict[str, int], int, int]:
                    cfg = tb._blocks(kind, D, D, dtype, cuda)
                    return {k: v for k, v in cfg.items() if k.startswith("BLOCK")}, cfg["num_warps"], cfg["num_stages"]

                common = {"Mask": "*u8", "Bias": ty, "Lse": "*fp32", "QIds": "*i32", "KIds": "*i32", "Ranges": "*i32",
                          "Trace": "*i32", "CAP": ("*fp32", "*fp32") if with_mods else (ty,),
                          "MCAP": ("*i64",) if with_mods else (ty,),
                          "CAP_GRAD": ("*fp32", "*fp32") if with_mods else (ty,)}
                b, w, s = blocks("fwd")
                ptrs = {"Q": ty, "K": ty, "V": ty, "Out": ty, "Out32": "*fp32", **common}
                one(fwd_k.fwd_kernel, ptrs, {**flags, **b}, w, s, label)
                b, w, s = blocks("decode")
                ptrs = {"Q": ty, "K": ty, "V": ty, "Opart": "*fp32", "Lpart": "*fp32", **common}
                rows = 16 if name == "all" else tb.DECODE_MAX_ROWS // 2  # G·Lq query rows, padded
                one(dec_k.split_kernel, ptrs, {**flags, **b, "BLOCK_M": rows}, w, s, f"{label} rows={rows}")
                b, w, s = blocks("dkdv")
                ptrs = {"Q": ty, "K": ty, "V": ty, "dO": ty, "dK": ty, "dV": ty, "Delta": "*fp32", "dQacc": "*fp32",
                        "dBias": "*fp32", **common}
                one(bwd_k.dkdv_kernel, ptrs, {**flags, **b}, w, s, label)
                b, w, s = blocks("dq")
                ptrs = {"Q": ty, "K": ty, "V": ty, "dO": ty, "dQ": ty, "Delta": "*fp32", **common}
                one(bwd_k.dq_kernel, ptrs, {**flags, **b}, w, s, label)
        one(dec_k.merge_kernel, {"Opart": "*fp32", "Lpart": "*fp32", "Out": ty, "Lse": "*fp32"},
            {"BLOCK_S": 64, "BLOCK_DV": 128}, 4, 1, str(dtype)[6:])
        one(bwd_k.delta_kernel, {"O": ty, "dO": ty, "Delta": "*fp32"}, {"BLOCK_M": 64, "BLOCK_DV": 128}, 4, 1,
            str(dtype)[6:])
    return failures


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--compile-check", action="store_true", help="compile the kernels for sm_90 (no GPU needed)")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256], help="head dims for --compile-check")
    parser.add_argument("--quick", action="store_true", help="--compile-check: bf16, plain and all features")
    parser.add_argument("--out", type=Path, default=Path("out/gpu.json"), help="JSON results")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds after which no new grid point is timed")
    parser.add_argument("--tests", type=float, default=0.0, metavar="SECONDS",
                        help="first run the Triton test files on the GPU (pytest -n 8) for at most this long")
    args = parser.parse_args()
    if args.compile_check:
        print(f"compiling for sm_90 with triton {triton.__version__}")
        sys.exit(1 if compile_check(args.dims, args.quick) else 0)

    global DEVICE, TIME_BUDGET_S
    TIME_BUDGET_S = args.budget
    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (or --dry-run / --compile-check without one)")
    DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    gpu = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else f"CPU ({platform.machine()}, dry run)"
    result: dict[str, Any] = {
        "gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(), "dry_run": args.dry_run,
    }
    print(f"{gpu}: torch {torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}")

    if args.dry_run:  # let the tiny decode shapes take the split-KV path
        from attnzero.kernels import triton_backend

        triton_backend.DECODE_MIN_LK = 256
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result.update(ceilings={"matmul_bf16_tflops": float("nan"), "copy_gbs": float("nan")}, failures=[],
                  training=[], decode=[], flex=[])

    def section(key: str, title: str, fn: Callable[[], Any]) -> None:
        """Run one step; a step that raises is reported (and counted as a failure) and the next runs.
        The JSON is rewritten after each step, so a run cut short keeps what it measured."""
        print(title, flush=True)
        try:
            result[key] = fn()
        except Exception as e:
            traceback.print_exc()
            result["failures"].append(f"{key}: {type(e).__name__}: {e}")
        result["seconds"] = time.perf_counter() - t0
        args.out.write_text(json.dumps(result, indent=1))

    if args.tests > 0:
        section("tests", "the Triton test files on this device:", lambda: gpu_tests(args.tests))
    section("ceilings", "ceilings:", lambda: ceilings(DEVICE, args.dry_run))
    c = result["ceilings"]
    print(f"  bf16 matmul {c['matmul_bf16_tflops']:.1f} TFLOP/s, copy {c['copy_gbs']:.1f} GB/s", flush=True)
    section("failures", "correctness (bf16/fp16 vs a float32 golden, DESIGN.md's rule):",
            lambda: result["failures"] + correctness(args.dry_run))
    for f in result["failures"]:
        print("  FAILED:", f)
    # the timing steps share the budget: training until 60 % of it, decode until 75 %, Flex the rest
    section("training", "training shapes:", lambda: training_grid(args.dry_run, t0 + 0.60 * TIME_BUDGET_S))
    section("decode", "decode:", lambda: decode_grid(args.dry_run, t0 + 0.75 * TIME_BUDGET_S))
    section("flex", "vs compiled FlexAttention:", lambda: flex_grid(args.dry_run, t0 + TIME_BUDGET_S))
    print(f"\nwrote {args.out} ({result['seconds']:.0f} s)\n")
    print(tables(result))
    if result["failures"]:
        sys.exit(1)


DEVICE = torch.device("cpu")

if __name__ == "__main__":
    main()
