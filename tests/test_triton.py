"""backend="triton": the Triton kernels against the float64 golden, by DESIGN.md's tolerance rule.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (conftest sets
TRITON_INTERPRET=1 before anything imports them), which is slow: shapes are small but awkward, and
the interpreter uses 16×16 tiles so that every case crosses several query and key blocks, ragged
last blocks, both edges of causal/window bands and whole skipped blocks. On a CUDA machine the same
tests run the compiled kernels with their real tile sizes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import check_against_golden, qkv, random_keep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnzero as az
from attnzero import dropout as az_dropout
from attnzero import masks, ops

if os.environ.get("CI") == "true":
    import triton  # CI installs triton: its absence must fail, not skip
else:
    triton = pytest.importorskip("triton", reason="backend='triton' needs `pip install triton`")

import triton.language as tl

from attnzero.kernels import triton_backend as tb
from attnzero.kernels.forward import dropout_keep

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPE_IDS = {F16: "f16", BF16: "bf16", F32: "f32"}


def _interpreter_ok() -> None:
    """Triton < 3.7's interpreter breaks on numpy >= 2.4 (triton-lang/triton#9171): say so."""
    if DEVICE.type == "cpu":
        import numpy

        tv = tuple(int(x) for x in triton.__version__.split(".")[:2])
        nv = tuple(int(x) for x in numpy.__version__.split(".")[:2])
        assert not (tv < (3, 7) and nv >= (2, 4)), (
            f"triton {triton.__version__}'s CPU interpreter fails with numpy {numpy.__version__}: "
            "install triton>=3.7 or numpy<2.4"
        )


_interpreter_ok()


def to_device(*ts: Any) -> list[Any]:
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]


def golden(dtype: torch.dtype, B: int, Hq: int, Hkv: int, Lq: int, Lk: int, D: int, Dv: int | None = None,
           *, layout: str = "contiguous", **kw: Any) -> None:
    """Forward (out, lse) and backward (dq, dk, dv, dbias) of the triton backend by the rule."""
    q, k, v = to_device(*qkv(B, Hq, Hkv, Lq, Lk, D, Dv, layout=layout))
    check_against_golden("triton", dtype, q, k, v, **kw)


# ---------------------------------------------------------------------------------------------
# Shapes, causal, windows, GQA/MQA, head dims


CASES: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
    ("plain", (2, 2, 2, 17, 17, 40), {}),
    ("lq<lk_gqa_dv", (1, 4, 2, 19, 45, 59, 24), {}),
    ("lq>lk_mqa", (1, 3, 1, 37, 20, 16), {}),
    ("L1", (2, 2, 1, 1, 1, 8), {}),
    ("causal_square", (1, 2, 1, 50, 50, 32), {"causal": True}),
    ("causal_lq<lk", (1, 2, 2, 21, 53, 16), {"causal": True}),
    ("causal_lq>lk_blocked_rows", (1, 2, 1, 40, 23, 16), {"causal": True}),
    ("window", (1, 2, 2, 45, 45, 16), {"window": (5, 3)}),
    ("window_left_causal", (1, 2, 1, 33, 61, 24), {"window": 9, "causal": True}),
    ("window_right_only", (1, 2, 1, 30, 30, 16), {"window": (None, 4)}),
    ("window_left_only_lq>lk", (1, 1, 1, 48, 35, 16), {"window": (6, None)}),
    ("d96", (1, 2, 1, 18, 23, 96), {"causal": True}),
    ("d111_dv8", (1, 1, 1, 17, 20, 111, 8), {}),
]


# Every case in float32; the 16-bit dtypes on a subset (the interpreter is slow).
LOW_PRECISION = ("plain", "lq<lk_gqa_dv", "causal_lq>lk_blocked_rows", "window", "d111_dv8")
GOLDEN_PARAMS = [
    pytest.param(dtype, *case, id=f"{case[0]}-{DTYPE_IDS[dtype]}")
    for case in CASES
    for dtype in (F32, F16, BF16)
    if dtype == F32 or case[0] in LOW_PRECISION
]


@pytest.mark.parametrize("dtype,name,shape,kw", GOLDEN_PARAMS)
def test_against_golden(dtype: torch.dtype, name: str, shape: tuple[int, ...], kw: dict[str, Any]) -> None:
    golden(dtype, *shape, **kw)


def test_head_dim_256() -> None:
    golden(F32, 1, 1, 1, 17, 19, 256, causal=True)


@pytest.mark.parametrize("layout", ["transpose", "strided", "sliced"])
def test_noncontiguous_inputs(layout: str) -> None:
    golden(BF16, 2, 2, 1, 19, 21, 16, layout=layout, causal=True)


@pytest.mark.parametrize(
    "dtype,Lq,Lk,D,causal,deterministic",
    [(BF16, 150, 150, 64, True, True), (BF16, 150, 200, 128, False, True), (BF16, 70, 300, 64, True, False),
     (F16, 200, 130, 128, True, True), (F32, 129, 129, 64, False, True), (F32, 90, 70, 128, True, False),
     (BF16, 40, 75, 256, True, True)],
)  # fmt: skip
def test_the_gpu_tile_table_under_the_interpreter(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, Lq: int, Lk: int, D: int, causal: bool, deterministic: bool
) -> None:
    """The tile sizes of ``TILES`` (what a GPU runs: 64 to 128 rows and keys a block, otherwise never
    run here, where the kernels get 16×16 tiles) on shapes that end inside a block: forward and
    backward against the golden, dQ by its own kernel and by atomics."""
    def gpu_blocks(kind: str, D: int, Dv: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
        BD, BDV = tb.fwd_k.next_pow2(D), tb.fwd_k.next_pow2(Dv)
        bm, bn, _, _ = tb.TILES[(kind, max(64, BD, BDV), dtype == torch.float32)]
        return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": BD, "BLOCK_DV": BDV}

    monkeypatch.setattr(tb, "_blocks", gpu_blocks)
    monkeypatch.setattr(tb, "DETERMINISTIC", deterministic)
    q, k, v = qkv(1, 2, 1, Lq, Lk, D)
    check_against_golden("triton", dtype, *(t.to(DEVICE) for t in (q, k, v)), causal=causal)


@pytest.mark.parametrize("dtype,D", [(BF16, 59), (F16, 111), (F32, 59), (BF16, 64), (F32, 8)])
def test_aligned_rows_copies_rows_off_a_16_byte_boundary(dtype: torch.dtype, D: int) -> None:
    """On CUDA the kernels get rows, heads and batches starting on 16 bytes (16-bit head dims of 59 and
    111 gave wrong outputs on an H200 without): same values, padded strides, no copy when aligned."""
    t = torch.randn(2, 3, 5, D).to(dtype)
    base = torch.empty(t.numel() + 8, dtype=dtype)  # a copy of t whose start is one element off the boundary
    off = base[1 : 1 + t.numel()].view(t.shape)
    off.copy_(t)
    for x in (t, off, t.transpose(1, 2)):
        a = tb.aligned_rows(x)
        assert torch.equal(a, x) and a.stride(-1) == 1 and a.data_ptr() % 16 == 0
        assert all(s * a.element_size() % 16 == 0 for s, n in zip(a.stride()[:-1], a.shape) if n > 1)
        if x is t and D * t.element_size() % 16 == 0:
            assert a is t  # already aligned: no copy


# ---------------------------------------------------------------------------------------------
# Masks and bias (dense, broadcast, Mask objects, fully blocked rows), with gradients


@pytest.mark.parametrize("dtype", [F16, F32], ids=DTYPE_IDS.get)
def test_dense_mask_with_blocked_rows(dtype: torch.dtype) -> None:
    keep = random_keep(2, 1, 33, 40)  # (B, 1, Lq, Lk): broadcast over heads
    keep[0, 0, 3] = False  # a fully blocked row
    keep[1, 0, 20:] = False
    golden(dtype, 2, 2, 1, 33, 40, 16, mask=keep.to(DEVICE), causal=dtype == F32)


def test_strided_mask_and_bias() -> None:
    keep = random_keep(2, 30, 21).transpose(1, 2).unsqueeze(1)  # (B, 1, Lq, Lk), column-major
    keep[:, :, 5] = False
    bias = torch.randn(30, 21, dtype=torch.float64).t().expand(2, 21, 30).unsqueeze(1)  # zero batch stride
    golden(F32, 2, 2, 1, 21, 30, 16, mask=keep.to(DEVICE), bias=bias.to(DEVICE), causal=True)


def test_key_padding_mask_and_window() -> None:
    keep = torch.tensor([[True] * 30 + [False] * 8, [True] * 12 + [False] * 26]).view(2, 1, 1, 38)
    golden(F32, 2, 2, 2, 25, 38, 16, mask=keep.to(DEVICE), window=(7, 2))


def test_mask_object_document_and_causal() -> None:
    ids = [0] * 9 + [1] * 17 + [2] * 10
    golden(F32, 1, 2, 1, 36, 36, 16, mask=masks.document(ids) & masks.causal(36))


@pytest.mark.parametrize("dtype", [BF16, F32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("bshape", [(1, 2, 29, 35), (29, 35), (2, 1, 1, 35)], ids=["per_head", "lq_lk", "per_key"])
def test_bias_and_its_gradient(dtype: torch.dtype, bshape: tuple[int, ...]) -> None:
    bias = torch.randn(*bshape, dtype=torch.float64).to(DEVICE)
    golden(dtype, 2, 2, 1, 29, 35, 16, bias=bias, causal=True)


def test_alibi_bias_with_mask() -> None:
    bias = masks.alibi(2, 25, 31).to(torch.float64).to(DEVICE)
    golden(F32, 1, 2, 2, 25, 31, 16, bias=bias, mask=random_keep(1, 1, 25, 31).to(DEVICE))


def test_fully_blocked_everything_gives_zeros() -> None:
    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE, requires_grad=True) for n in (20, 30, 30))
    keep = torch.zeros(1, 1, 20, 30, dtype=torch.bool, device=DEVICE)
    out, lse = az.attention(q, k, v, mask=keep, backend="triton", return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


# ---------------------------------------------------------------------------------------------
# Dropout: exactly dropout.keep_mask's entries, in forward and backward


def test_dropout_hash_bit_for_bit_with_64bit_counters() -> None:
    """The kernel's hash of (seed, counter) equals dropout.keep_mask, counters beyond 2^32 included."""
    Lk, p = 48, 0.3
    for seed in (7, 2**40 + 3, 2**62 - 11):
        for row0 in (0, 2**32 // Lk - 5, 3 * 2**32 // Lk + 1):
            got = torch.empty(16, 64, dtype=torch.int8, device=DEVICE)
            _, _, threshold, _ = tb._dropout_args(p, seed)
            _hash_kernel[(1,)](got, row0, Lk, seed & 0xFFFFFFFF, seed >> 32, threshold, R=16, C=64)
            # counters (row0 + r)·Lk + c; columns past Lk are just more counters to hash
            want = az_dropout.keep_mask(seed, p, (1, 1, row0 + 16, Lk), rows=(row0, row0 + 16), cols=(0, 64))
            assert torch.equal(got.bool(), want.view(16, 64).to(DEVICE)), (seed, row0)


@triton.jit(do_not_specialize=["row0", "seed_lo", "seed_hi", "threshold"])
def _hash_kernel(Out, row0, Lk, seed_lo, seed_hi, threshold, R: tl.constexpr, C: tl.constexpr):
    rows = row0 + tl.arange(0, R).to(tl.int64)
    cols = tl.arange(0, C)
    keep = dropout_keep(rows[:, None], cols[None, :], Lk, seed_lo, seed_hi, threshold)
    tl.store(Out + tl.arange(0, R)[:, None] * C + cols[None, :], keep.to(tl.int8))


@pytest.mark.parametrize("dtype", [BF16, F32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("p", [0.2, 0.7])
def test_dropout_matches_reference_entries(dtype: torch.dtype, p: float) -> None:
    """Same torch seed → the triton backend drops the entries the reference drops (a different
    mask would miss the golden by O(1)), forward and backward, with GQA and a causal band."""
    golden(dtype, 2, 4, 2, 23, 29, 16, dropout_p=p, seed=1234, causal=True)


# ---------------------------------------------------------------------------------------------
# Deterministic backward, return_lse, float64


def test_deterministic_backward_is_bitwise_reproducible(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = (torch.randn(1, 4, n, 16, device=DEVICE) for n in (33, 47, 47))
    k, v = k[:, :2], v[:, :2]  # GQA: 2 key/value heads

    def grads() -> list[torch.Tensor]:
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = az.attention(*xs, causal=True, backend="triton")
        return list(torch.autograd.grad(out, xs, torch.ones_like(out)))

    atomic = grads()
    monkeypatch.setattr(tb, "DETERMINISTIC", True)
    first, second = grads(), grads()
    for a, b, c in zip(first, second, atomic):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_float64_uses_a_float64_path() -> None:
    q, k, v = to_device(*qkv(1, 2, 1, 9, 12, 8))
    out, lse = az.attention(q, k, v, causal=True, backend="triton", return_lse=True)
    ref, ref_lse = az.attention(q, k, v, causal=True, backend="reference", return_lse=True)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Split-KV decode


@pytest.fixture
def decode_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the split-KV launches, with a small length threshold so the interpreter stays quick."""
    calls: list[int] = []
    real = tb._decode

    def spy(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(tb, "_decode", spy)
    monkeypatch.setattr(tb, "DECODE_MIN_LK", 64)
    return calls


DECODE_CASES: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
    ("lq1_gqa", (2, 8, 2, 1, 203, 32), {}),
    ("lq3_causal_mqa", (1, 4, 1, 3, 150, 16), {"causal": True}),
    ("lq16_window", (1, 2, 2, 16, 130, 16), {"window": (40, 0)}),
    ("lq5_mask_bias", (2, 2, 1, 5, 97, 24), {"mask": True, "bias": True}),
    ("lq2_dropout", (1, 4, 2, 2, 120, 16), {"dropout_p": 0.4, "seed": 99}),
]


DECODE_PARAMS = [
    pytest.param(dtype, *case, id=f"{case[0]}-{DTYPE_IDS[dtype]}")
    for case in DECODE_CASES
    for dtype in (F32, BF16)
    if dtype == F32 or case[0] in ("lq1_gqa", "lq5_mask_bias")
]


@pytest.mark.parametrize("dtype,name,shape,kw", DECODE_PARAMS)
def test_decode_against_golden(
    decode_calls: list[int], dtype: torch.dtype, name: str, shape: tuple[int, ...], kw: dict[str, Any]
) -> None:
    kw = dict(kw)
    B, Hq, _, Lq, Lk, _ = shape
    if kw.pop("mask", False):
        keep = random_keep(B, 1, Lq, Lk)
        keep[0, 0, 0] = False  # a fully blocked row
        kw["mask"] = keep.to(DEVICE)
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(1, Hq, Lq, Lk, dtype=torch.float64).to(DEVICE)
    golden(dtype, *shape, grads=False, **kw)
    assert decode_calls, "the split-KV path was not taken"


@pytest.mark.parametrize("big", [-1e9, torch.finfo(torch.float32).min], ids=["1e9", "finfo"])
def test_decode_merges_splits_whose_kept_keys_all_carry_a_huge_bias(
    decode_calls: list[int], monkeypatch: pytest.MonkeyPatch, big: float
) -> None:
    """A row whose kept keys all carry an additive mask's −1e9 (or finfo.min), kept unevenly by two
    splits (whole key blocks: most kept keys in the second): its output is the mean of their
    values. The splits once handed the merge their float32 lse, ≈ −1e9 + log n_s with none of
    log n_s's bits, and it weighed both splits alike (error 0.06–0.09, found by a sweep); now each
    split's max and sum."""
    monkeypatch.setattr(tb, "DECODE_SPLITS", 2)
    B, H, Lk, D = 1, 2, 200, 16
    q, k, v = (torch.randn(B, H, n, D, device=DEVICE) for n in (1, Lk, Lk))
    bias = torch.full((1, 1, 1, Lk), big, device=DEVICE)
    keep = torch.ones(1, 1, 1, Lk, dtype=torch.bool, device=DEVICE)
    keep[..., :90] = False  # keys 90..199 kept
    with torch.no_grad():
        out = az.attention(q, k, v, bias=bias, mask=keep, backend="triton")
    assert decode_calls, "the split-KV path was not taken"
    mean = v[..., 90:, :].mean(dim=-2, keepdim=True)  # (B, H, 1, D)
    torch.testing.assert_close(out, mean, rtol=1e-5, atol=1e-5)


def test_decode_not_taken_when_grad_is_needed(decode_calls: list[int]) -> None:
    golden(F32, 1, 2, 1, 2, 80, 16)  # with gradients: the forward kernel, which has a backward
    assert not decode_calls


# ---------------------------------------------------------------------------------------------
# torch.library registration, torch.compile, errors


def test_custom_ops_pass_opcheck() -> None:
    # (B, L, H, D) storage viewed as (B, H, L, D): fakes and kernels must agree on output strides
    q, k, v = (torch.randn(1, n, 2, 16, device=DEVICE).transpose(1, 2).requires_grad_() for n in (17, 20, 20))
    bias = torch.randn(1, 2, 17, 20, device=DEVICE, requires_grad=True)
    keep = random_keep(1, 1, 17, 20).to(DEVICE)
    free = ops.UNBOUNDED
    args = (q, k, v, keep, bias, None, None, True, 5, free, 0.25, 0.0, 0.0, 0, True)
    torch.library.opcheck(tb.triton_fwd, args)
    ids = torch.tensor([[0] * 9 + [1] * 11], dtype=torch.int32, device=DEVICE)  # (1, 20): segments, softcap
    torch.library.opcheck(tb.triton_fwd, (q, k, v, None, None, ids[:, :17], ids, False, free, free, 0.25, 3.0, 0.0, 0,
                                          False))
    with torch.no_grad():
        for dtype, out_f32 in ((torch.float32, False), (torch.float16, False), (torch.float16, True)):
            qd, kd, vd = (t.detach().to(dtype) for t in (q[:, :, :2], k, v))
            dargs = (qd, kd, vd, None, None, None, None, False, free, free, 0.25, 0.0, 0.0, 0, out_f32)
            torch.library.opcheck(tb.triton_decode, dargs, test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph() -> None:
    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE, requires_grad=True) for n in (17, 20, 20))

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return az.attention(q, k, v, causal=True, backend="triton") * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    out.sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    f(q, k, v).sum().backward()
    torch.testing.assert_close(out, f(q, k, v))
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tb, "interpreting", lambda: False)
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        az.attention(q, q, q, backend="triton")


def test_missing_triton_says_how_to_install() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, attnzero as az\n"
        "q = torch.randn(1, 1, 4, 8)\n"
        "try:\n    az.attention(q, q, q, backend='triton')\n"
        "except ImportError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "ERR" in out.stdout and "pip install triton" in out.stdout, out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# benchmarks/gpu.py: its correctness check and tables on the CPU, its kernels compiled for sm_90

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_check_and_tables() -> None:
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    gpu.DEVICE = DEVICE
    assert gpu.check("causal gqa", BF16, (1, 4, 2, 20, 20, 16), causal=True) == []
    row = {"D": 64, "L": 1024, "B": 16, "causal": True, "pass": "fwd", "ours_tflops": 1.0, "ratio": 0.5}
    result = {"gpu": "X", "date": "d", "torch": "t", "triton": "t", "failures": [],
              "ceilings": {"matmul_bf16_tflops": 1.0, "copy_gbs": 2.0}, "training": [row],
              "decode": [{"B": 1, "Lk": 4096, "Hq": 32, "Hkv": 8, "ours_gbs": 1.0}]}
    text = gpu.tables(result)
    assert "| 64 | 1024 | 16 | causal | fwd |" in text and "| 1 | 4096 |" in text


LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="triton's CUDA compiler ships in its Linux wheels"
)


def _without_interpreter(script: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # this tree's kernels, whatever checkout the installed attnzero points at
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *script], capture_output=True, text=True, env=env, timeout=600)


@LINUX_ONLY
def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """What the interpreter cannot check: every kernel launched by the backend (forward, split-KV
    decode and its merge, the backward's Δ, dK/dV and dQ) lowers to sm_90 code that fits its shared
    memory — without extras (no window: the constexpr-zero block ranges; deterministic dQ) and with
    every feature on (window, mask, bias and its gradient, dropout, atomic dQ, float32 O)."""
    out = _without_interpreter([str(ROOT / "benchmarks" / "gpu.py"), "--compile-check", "--quick", "--dims", "64"])
    assert out.returncode == 0 and "FAIL" not in out.stdout, out.stdout + out.stderr
    compiled = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("  ok   ")]
    from attnzero.kernels import backward, decode, forward

    kernels = {n for m in (forward, backward, decode) for n in vars(m) if n.endswith("_kernel")}
    assert kernels == {"fwd_kernel", "split_kernel", "merge_kernel", "delta_kernel", "dkdv_kernel", "dq_kernel"}
    assert set(compiled) == kernels, out.stdout  # each kernel of the backend was compiled
    assert len(compiled) == 2 * 4 + 2, out.stdout  # the 4 attention kernels in 2 feature sets, merge, Δ


@LINUX_ONLY
def test_sm90_compile_check_reports_a_kernel_that_does_not_compile(tmp_path: Path) -> None:
    """The compile check can fail: the same kernel compiles with 16×16 blocks and is reported, not
    passed, with 8×8 ones (tl.dot's inner dimension must be >= 16)."""
    script = tmp_path / "broken.py"
    script.write_text(
        "import importlib.util, sys\n"
        "import triton\n"
        "import triton.language as tl\n"
        f"spec = importlib.util.spec_from_file_location('gpu_bench', {str(ROOT / 'benchmarks' / 'gpu.py')!r})\n"
        "gpu = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(gpu)\n"
        "@triton.jit\n"
        "def small_dot_kernel(X, BLOCK: tl.constexpr):\n"
        "    offs = tl.arange(0, BLOCK)\n"
        "    x = tl.load(X + offs[:, None] * BLOCK + offs[None, :])\n"
        "    tl.store(X + offs[:, None] * BLOCK + offs[None, :], tl.dot(x, x))\n"
        "print(gpu.compile_for_sm90(small_dot_kernel, {'X': '*bf16'}, {'BLOCK': 16}, 4, 1))\n"
        "print(gpu.compile_for_sm90(small_dot_kernel, {'X': '*bf16'}, {'BLOCK': 8}, 4, 1))\n"
    )
    out = _without_interpreter([str(script)])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-2].startswith("(True, 'shared="), out.stdout  # the same kernel at 16×16 compiles
    assert lines[-1].startswith("(False, "), out.stdout


def test_auto_picks_triton_for_cuda_inputs() -> None:
    """functional._auto on a CUDA query (a stand-in object: this machine may have no GPU)."""
    from types import SimpleNamespace

    from attnzero import functional

    cuda_q = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(1, 2, 512, 64), device="cuda")
    k = SimpleNamespace(shape=(1, 2, 512, 64))
    assert functional._auto(cuda_q, k) == "triton"  # type: ignore[arg-type]
    cuda_q64 = SimpleNamespace(is_cuda=True, dtype=torch.float64, shape=(1, 2, 512, 64), device="cuda")
    assert functional._auto(cuda_q64, k) != "triton"  # type: ignore[arg-type]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    Lq=st.integers(1, 50),
    Lk=st.integers(1, 50),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 20)),
    right=st.one_of(st.none(), st.integers(0, 20)),
    gqa=st.sampled_from([(2, 2), (2, 1), (4, 2)]),
    deterministic=st.booleans(),
)
def test_property_block_ranges(
    monkeypatch: pytest.MonkeyPatch, Lq: int, Lk: int, causal: bool, left: int | None, right: int | None,
    gqa: tuple[int, int], deterministic: bool,
) -> None:
    """Random lengths and bands against the golden: the block skipping and edge masking of every
    kernel (16×16 tiles under the interpreter) must agree with the dense formula."""
    monkeypatch.setattr(tb, "DETERMINISTIC", deterministic)
    window = None if left is None and right is None else (left, right)
    golden(F32, 1, gqa[0], gqa[1], Lq, Lk, 16, causal=causal, window=window)


def test_double_backward_gives_a_differentiable_gradient() -> None:
    """create_graph=True through the Triton backend: the gradient has a graph (recomputed by the
    formula), and the second-order gradient equals the reference's."""
    q, k, v = (t.float().requires_grad_(True) for t in to_device(*qkv(1, 2, 1, 9, 12, 8)))
    b = torch.randn(1, 2, 9, 12, device=DEVICE, requires_grad=True)
    second = []
    for backend in ("triton", "reference"):
        out = az.attention(q, k, v, bias=b, causal=True, backend=backend)  # type: ignore[arg-type]
        (gq,) = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
        assert gq.requires_grad
        second.append(torch.autograd.grad(gq.square().sum(), (q, k, v, b)))
    for got, want in zip(*second):
        assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
