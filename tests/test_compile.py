"""torch.compile and torch.export through attnzero: a small nanoGPT-style model compiles with
``fullgraph=True`` (no graph break caused by attnzero) on every backend and through the drop-in, with
and without dropout, and gives what it gives eagerly, forward and backward; a module whose batch
size depends on the data (``x = x[keep]``) exports, and the exported program runs for any batch,
0 included.

Most cases compile with the ``aot_eager`` backend: it runs dynamo and AOTAutograd — where graph
breaks, fake tensors and the autograd of the custom ops are decided — without the minute of C++
compilation inductor needs per graph on a small CPU; one case runs through inductor. Random
numbers: attnzero draws its dropout seed in the graph with ``torch.randint``, which inductor lowers
to its own generator unless ``fallback_random`` is set (as for torch's own dropout), so the
inductor case sets it to compare with eager.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import absent
from torch import nn

import attnzero as az
from attnzero import flex

VOCAB, BLOCK = 32, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention block, with its attention call made by attnzero."""

    def __init__(self, d_model: int, n_head: int, dropout: float, backend: str) -> None:
        super().__init__()
        self.n_head, self.dropout, self.backend = n_head, dropout, backend
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        if self.backend == "sdpa":  # the drop-in
            y = az.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = az.attention(q, k, v, causal=True, dropout_p=p, backend=self.backend)  # type: ignore[arg-type]
        assert isinstance(y, torch.Tensor)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, backend: str) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, backend)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, backend: str, dropout: float = 0.0, d_model: int = 32, n_head: int = 4, n_layer: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d_model), nn.Embedding(BLOCK, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, backend) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d_model), nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _need(backend: str) -> None:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        absent("backend='triton' needs `pip install triton`")


def _step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Loss and the gradients of every parameter, with torch's RNG at ``seed``."""
    torch.manual_seed(seed)
    loss = model(idx, targets)
    return [loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))]


def _compare(eager: list[torch.Tensor], compiled: list[torch.Tensor]) -> None:
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("backend", ["reference", "flash", "triton", "auto", "sdpa"])
def test_compiled_model_has_no_graph_break_and_matches_eager(backend: str, dropout: float) -> None:
    _need(backend)
    torch.manual_seed(0)
    model = TinyGPT(backend, dropout).train()
    idx, targets = torch.randint(0, VOCAB, (3, BLOCK)), torch.randint(0, VOCAB, (3, BLOCK))
    explained = torch._dynamo.explain(model)(idx, targets)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _compare(_step(model, idx, targets, seed=1), _step(compiled, idx, targets, seed=1))
    if dropout:  # and the dropout really is there: another seed, other numbers
        assert not torch.equal(_step(compiled, idx, targets, seed=1)[0], _step(compiled, idx, targets, seed=2)[0])


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_inductor_compiled_model_with_dropout_matches_eager(backend: str) -> None:
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = TinyGPT(backend, dropout=0.2).train()
    idx, targets = torch.randint(0, VOCAB, (3, BLOCK)), torch.randint(0, VOCAB, (3, BLOCK))
    with inductor_config.patch(fallback_random=True):  # inductor's randint = eager's (see the docstring)
        compiled = torch.compile(model, fullgraph=True)
        _compare(_step(model, idx, targets, seed=1), _step(compiled, idx, targets, seed=1))


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_compile_with_dynamic_sizes_masks_and_zero_batch(backend: str) -> None:
    """Symbolic sizes in the checks, a Mask argument (densified under compile), a bias, a window,
    and a zero batch: all trace with fullgraph=True and match eager. (The masks are built outside
    the compiled function: building them is masks.py's eager code.)"""

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: az.Mask) -> torch.Tensor:
        bias = torch.linspace(-1.0, 0.0, k.shape[2])
        out = az.attention(q, k, v, mask=keep, bias=bias, window=(5, None), backend=backend)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        return out

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for B, Lq, Lk in ((2, 5, 9), (3, 7, 12), (0, 4, 6)):
        q, k, v = torch.randn(B, 4, Lq, 8), torch.randn(B, 2, Lk, 8), torch.randn(B, 2, Lk, 8)
        keep = az.masks.causal(Lq, Lk)
        if B:
            keep = keep & az.masks.padding(torch.randint(1, Lk + 1, (B,)), Lk)
        torch.testing.assert_close(compiled(q, k, v, keep), fn(q, k, v, keep))


def test_compile_under_autocast_matches_eager() -> None:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return az.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, traced = fn(q, k, v), compiled(q, k, v)
    assert traced.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(traced, eager)


# ---------------------------------------------------------------------------------------------
# torch.export with a batch size that depends on the data


class KeepRows(nn.Module):
    """Keeps the rows of ``x`` that ``keep`` selects (a data-dependent batch u0), then attends with a
    (u0, 1, 1, L) key-padding mask."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x, pad = x[keep], pad[keep]  # (u0, L, 16), (u0, L)
        B, L, _ = x.shape
        q = self.proj(x).view(B, L, 2, 8).transpose(1, 2)  # (u0, 2, L, 8)
        mask = pad.view(B, 1, 1, L)  # (u0, 1, 1, L)
        if self.how == "sdpa":
            return az.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        out = az.attention(q, q, q, mask=mask, causal=True, backend=self.how)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        return out


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
@pytest.mark.parametrize("how", ["sdpa", "reference", "flash", "auto"])
def test_export_with_a_data_dependent_batch(how: str, strict: bool) -> None:
    torch.manual_seed(0)
    module = KeepRows(how)
    x, pad = torch.randn(4, 6, 16), torch.rand(4, 6) < 0.8
    pad[:, 0] = True
    program = torch.export.export(module, (x, torch.tensor([True, False, True, True]), pad), strict=strict)
    for keep in ([True, False, True, True], [False, True, False, False], [False] * 4, [True] * 4):
        k = torch.tensor(keep)
        torch.testing.assert_close(program.module()(x, k, pad), module(x, k, pad))


def test_export_takes_every_length_a_shortcut_was_chosen_for() -> None:
    """Shortcuts that are right either way (torch's top-left causal as attnzero's causal when
    Lq == Lk; a window side that reaches every key as unbounded) no longer guard on the example's
    lengths: an exported drop-in refused Lq == Lk at run time, and a window of 128 capped the
    exportable length at the example's 64."""
    import torch.nn.functional as F

    class Causal(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return az.scaled_dot_product_attention(q, k, v, is_causal=True)

    Lq, Lk = torch.export.Dim("Lq", min=2, max=64), torch.export.Dim("Lk", min=2, max=64)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 9, 8)
    ep = torch.export.export(Causal(), (q, k, k), dynamic_shapes={"q": {2: Lq}, "k": {2: Lk}, "v": {2: Lk}})
    for a, b in ((5, 9), (12, 3), (7, 7)):
        qq, kk = torch.randn(1, 2, a, 8), torch.randn(1, 2, b, 8)
        torch.testing.assert_close(ep.module()(qq, kk, kk), F.scaled_dot_product_attention(qq, kk, kk, is_causal=True))

    class Window(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = az.attention(x, x, x, window=(128, 0))
            assert isinstance(out, torch.Tensor)
            return out

    L = torch.export.Dim("L", min=2, max=4096)
    ep = torch.export.export(Window(), (torch.randn(1, 2, 64, 8),), dynamic_shapes={"x": {2: L}})
    x = torch.randn(1, 2, 300, 8)
    torch.testing.assert_close(ep.module()(x), az.attention(x, x, x, window=(128, 0), backend="reference"))


def _alibi_like(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return s + 0.1 * (i - j)


def test_export_a_score_mod_with_dynamic_batch_and_length() -> None:
    """A score_mod's block shape is read as sizes, not len(): len() made an exported B and L
    constants (torch's flex exports the same module)."""

    class Modded(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = az.attention(q, k, v, score_mod=_alibi_like)
            assert isinstance(out, torch.Tensor)
            return out

    B, L = torch.export.Dim("B", max=8), torch.export.Dim("L", min=2, max=32)
    q = torch.randn(2, 2, 8, 16)
    ep = torch.export.export(Modded(), (q, q, q), dynamic_shapes={x: {0: B, 2: L} for x in ("q", "k", "v")})
    x = torch.randn(1, 2, 5, 16)
    torch.testing.assert_close(ep.module()(x, x, x), az.attention(x, x, x, score_mod=_alibi_like, backend="reference"))
    # with GQA (4 query heads on 2): the formula's grouped scores were a view of a matmul's output,
    # whose symbolic strides made export specialise L
    q4, kv = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    ep = torch.export.export(Modded(), (q4, kv, kv), dynamic_shapes={x: {0: B, 2: L} for x in ("q", "k", "v")})
    x4, y = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    want = az.attention(x4, y, y, score_mod=_alibi_like, backend="reference")
    torch.testing.assert_close(ep.module()(x4, y, y), want)


class _TableMod(nn.Module):
    """A learned per-head bias read by a score_mod made in forward: through self, or a local."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4))

    def forward(self, q: torch.Tensor, local: bool) -> torch.Tensor:
        tab = self.table
        mod = (lambda s, b, h, i, j: s + tab[h]) if local else (lambda s, b, h, i, j: s + self.table[h])
        out = az.attention(q, q, q, score_mod=mod)
        assert isinstance(out, torch.Tensor)
        return out


@pytest.mark.parametrize("local", [False, True], ids=["self", "local"])
def test_a_compiled_module_whose_score_mod_reads_its_parameter(local: bool) -> None:
    """Traced by dynamo the mod is not walked (the walk for torch.func's check, run first, made dynamo
    trace vars() of a parameter it tracks: InternalTorchDynamoError)."""
    m = _TableMod()
    q = torch.randn(1, 4, 6, 8)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, local), m(q, local))


def test_a_scale_from_a_traced_size_compiles_with_dynamic_shapes() -> None:
    """scale = 1 / sqrt(q.shape[-1]) under dynamic shapes is a symbolic float: the finiteness check
    could not trace it (every fullgraph compile failed), as flex's default scale."""

    def fn(q: torch.Tensor) -> torch.Tensor:
        out = az.attention(q, q, q, scale=1 / math.sqrt(q.shape[-1]))
        assert isinstance(out, torch.Tensor)
        return out + flex.flex_attention(q, q, q)

    compiled = torch.compile(fn, fullgraph=True, backend="eager", dynamic=True)
    for D in (8, 16):
        q = torch.randn(1, 2, 5, D)
        torch.testing.assert_close(compiled(q), fn(q))


@pytest.mark.parametrize("strict", [False, True])
def test_export_masks_built_from_the_inputs_sizes(strict: bool) -> None:
    """``az.masks.causal(Lq, Lk) & az.masks.window(...)`` from q's and k's lengths: non-strict export
    (torch's default) hands the builders SymInts, which they refused ("expected a positive int") and
    the Mask made ints of (the lengths specialised)."""

    class Masked(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            Lq, Lk = q.shape[2], k.shape[2]
            out = az.attention(q, k, v, mask=az.masks.causal(Lq, Lk) & az.masks.window(Lq, Lk, 4, None))
            assert isinstance(out, torch.Tensor)
            return out

    L, S = torch.export.Dim("L", min=2, max=64), torch.export.Dim("S", min=2, max=64)
    q, kv = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 12, 8)
    ep = torch.export.export(Masked(), (q, kv, kv), dynamic_shapes=({2: L}, {2: S}, {2: S}), strict=strict)
    q2, kv2 = torch.randn(1, 2, 17, 8), torch.randn(1, 2, 30, 8)
    torch.testing.assert_close(ep.module()(q2, kv2, kv2), Masked()(q2, kv2, kv2))


class FromData(torch.nn.Module):
    """Attention with ``az.masks.padding`` / ``document`` made from the module's input ``x`` (lengths
    or ids), or from Python ints when ``x`` is not read."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        L = q.shape[2]
        mask = {
            "padding": lambda: az.masks.padding(x, kv_len=L),
            "padding_ints": lambda: az.masks.padding([L, 5]),
            "document_causal": lambda: az.masks.document(x) & az.masks.causal(L),
            "document_batched": lambda: az.masks.document(x),
            "cu_seqlens_ints": lambda: az.masks.document(cu_seqlens=[0, 7, L]),
        }[self.how]()
        out = az.attention(q, q, q, mask=mask)
        assert isinstance(out, torch.Tensor)
        return out


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
@pytest.mark.parametrize("how", ["padding", "padding_ints", "document_causal", "document_batched", "cu_seqlens_ints"])
def test_export_masks_made_from_lengths_and_ids(how: str, strict: bool) -> None:
    """``az.masks.padding`` and ``document`` read their lengths / ids (checks, blocks to skip), which
    export cannot: both failed to export, from tensors and from Python ints alike (a data-dependent
    guard; strict: "Skip calling torch.compiler.disable()d function"). Under export they are the
    comparison itself, computed in the program: run again with other lengths / ids, the program
    gives what eager attnzero gives for them."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 16, 8)
    xs = {
        "padding": (torch.tensor([16, 9]), torch.tensor([3, 12])),
        "document_causal": (torch.tensor([0] * 5 + [1] * 11), torch.tensor([0] * 9 + [1] * 2 + [2] * 5)),
        "document_batched": (torch.tensor([[0] * 5 + [1] * 11, [0] * 16]), torch.tensor([[0] * 9 + [4] * 7, [2] * 16])),
    }.get(how, (torch.zeros(1), torch.ones(1)))
    module = FromData(how)
    program = torch.export.export(module, (q, xs[0]), strict=strict)
    for x in xs:
        torch.testing.assert_close(program.module()(q, x), module(q, x), rtol=0, atol=0)


def test_export_refuses_what_it_cannot_read() -> None:
    """Under export a tensor of lengths needs ``kv_len`` (the mask's length is max(lengths) otherwise,
    a value), and ``cu_seqlens`` must be Python ints (the packed length is a value): each refused by
    name, where export's own error spoke of a guard on a symbol."""
    q = torch.randn(1, 2, 16, 8)

    class Bad(torch.nn.Module):
        def __init__(self, make: Any) -> None:
            super().__init__()
            self.make = make

        def forward(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return az.attention(q, q, q, mask=self.make(x))  # type: ignore[return-value]

    with pytest.raises(ValueError, match=r"kv_len: expected an int under torch\.export"):
        torch.export.export(Bad(lambda x: az.masks.padding(x)), (q, torch.tensor([16])), strict=False)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected Python ints under torch\.export"):
        torch.export.export(Bad(lambda x: az.masks.document(cu_seqlens=x)), (q, torch.tensor([0, 16])), strict=False)
    with pytest.raises(ValueError, match="lengths: expected a 1-D sequence of ints"):
        torch.export.export(Bad(lambda x: az.masks.padding(x, 16)), (q, torch.ones(1, 2)), strict=False)


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
@pytest.mark.parametrize("how", ["alike_causal", "alike_window_lse", "unalike_causal", "unalike_score_mod_sinks"])
def test_export_attention_varlen(how: str, strict: bool) -> None:
    """attention_varlen reads cu_seqlens (its sequences as Python ints), which export cannot: it
    failed to export (a data-dependent guard; strict: a disabled function). Under export it is one
    call over the packed row with the mask computed in the program from cu_seqlens; the program,
    run with other packings (an empty sequence, a sequence with queries and no keys), gives what
    eager attention_varlen gives."""
    torch.manual_seed(0)
    alike = how.startswith("alike")
    Tk = 16 if alike else 20
    q, k, v = torch.randn(16, 4, 8), torch.randn(Tk, 2, 8), torch.randn(Tk, 2, 8)
    cu_q = [[0, 5, 16], [0, 9, 16], [0, 0, 16], [0, 16, 16]]
    cu_k = cu_q if alike else [[0, 12, 20], [0, 3, 20], [0, 20, 20], [0, 0, 20]]
    options: dict[str, Any] = {
        "alike_causal": {"causal": True},
        "alike_window_lse": {"window": (3, 1), "return_lse": True},
        "unalike_causal": {"causal": True},
        "unalike_score_mod_sinks": {"score_mod": lambda s, b, h, i, j: s + 0.1 * (i - j) + b, "sinks": torch.ones(4)},
    }[how]

    class Varlen(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Any:
            return az.attention_varlen(q, k, v, a, b, **options)

    ints = torch.int32
    program = torch.export.export(Varlen(), (q, k, v, torch.tensor(cu_q[0], dtype=ints), torch.tensor(cu_k[0])),
                                  strict=strict)  # fmt: skip
    for a, b in zip(cu_q, cu_k):
        args = (q, k, v, torch.tensor(a, dtype=ints), torch.tensor(b))
        torch.testing.assert_close(program.module()(*args), Varlen()(*args))


def test_exported_attention_varlen_takes_any_number_of_sequences_and_any_window() -> None:
    """Review findings: the exported program read the number of sequences with len() (fixed at the
    example's N: a dynamic N failed to export), and added window sides to int32 positions (a side
    of 2³¹ − 1 or more wrapped around: results off by 1.6–3.3)."""
    torch.manual_seed(0)
    from torch.export import Dim

    class Varlen(nn.Module):
        def __init__(self, window: Any) -> None:
            super().__init__()
            self.window = window

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Any:
            return az.attention_varlen(q, k, v, a, b, causal=True, window=self.window, return_lse=True)

    q, k, v = torch.randn(17, 4, 8), torch.randn(21, 2, 8), torch.randn(21, 2, 8)
    a, b = torch.tensor([0, 5, 9, 17]), torch.tensor([0, 7, 7, 21])
    Tq, Tk, N1 = Dim("Tq", min=2, max=4096), Dim("Tk", min=2, max=4096), Dim("N1", min=3, max=64)
    shapes = {"q": {0: Tq}, "k": {0: Tk}, "v": {0: Tk}, "a": {0: N1}, "b": {0: N1}}
    program = torch.export.export(Varlen(None), (q, k, v, a, b), dynamic_shapes=shapes).module()
    q2, k2 = torch.randn(30, 4, 8), torch.randn(11, 2, 8)
    for cq, ck in (([0, 10, 20, 30], [0, 3, 3, 11]), ([0, 10, 30], [0, 3, 11]), ([0, 1, 2, 3, 30], [0, 3, 4, 5, 11])):
        args = (q2, k2, k2, torch.tensor(cq), torch.tensor(ck))
        torch.testing.assert_close(program(*args), Varlen(None)(*args))
    for window in ((None, 2**31 - 1), (2**40, 0), (3, 2**33)):
        module = Varlen(window)
        program = torch.export.export(module, (q, k, v, a, b)).module()
        torch.testing.assert_close(program(q, k, v, a, b), module(q, k, v, a, b))


def test_a_softcap_passed_in_compiles_as_a_symbolic_float() -> None:
    """A softcap given as an argument (Gemma 2's, a module's field) is a symbolic float under
    dynamic=True, and on its second value by default: the finiteness check could not trace it."""

    def fn(q: torch.Tensor, cap: float) -> torch.Tensor:
        out = az.attention(q, q, q, softcap=cap, causal=True)
        assert isinstance(out, torch.Tensor)
        return out

    q = torch.randn(1, 2, 5, 8)
    for dynamic in (None, True):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="eager", dynamic=dynamic)
        for cap in (30.0, 50.0):
            torch.testing.assert_close(compiled(q, cap), fn(q, cap))
        for bad in (0.0, -1.0, math.inf):  # refused compiled too (the check is comparisons, not skipped)
            with pytest.raises(Exception, match=r"softcap|exception"):
                compiled(q, bad)


@pytest.mark.parametrize("case", ["score_mod", "reference_lse"])
def test_dropout_traces_without_a_graph_break(case: str) -> None:
    """Dropout with a score_mod, or on the reference with its lse, traced whole (fullgraph): the seed
    stays a tensor drawn in the graph (an int read back had broken the graph four times), and the
    entries dropped are eager's for the same RNG state."""
    slopes = torch.rand(2)

    def f(q: torch.Tensor) -> torch.Tensor:
        if case == "score_mod":
            out = az.attention(q, q, q, dropout_p=0.3, score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j).abs())
            assert isinstance(out, torch.Tensor)
            return out
        out, lse = az.attention(q, q, q, dropout_p=0.3, backend="reference", return_lse=True)  # type: ignore[misc]
        return out + lse.unsqueeze(-1)

    q = torch.randn(1, 2, 12, 8, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    got = compiled(q)
    torch.manual_seed(3)
    torch.testing.assert_close(got, f(q))


def test_a_compiled_model_runs_varlen_for_new_sequence_lengths_without_recompiling() -> None:
    # One graph break around the call, whatever the lengths: traced, each new cu_seqlens recompiled
    # the call's frames (and twenty graphs broke around its read-backs).
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    proj = nn.Linear(8, 16)

    def step(x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        q, k = proj(x).view(-1, 2, 2, 4).unbind(1)  # (T, 8) → (T, 16) → q, k (T, 2, 4)
        return az.attention_varlen(q * 2, k, k, cu, cu, causal=True).square().sum()

    cus = [torch.tensor(cu, dtype=torch.int32) for cu in ([0, 10, 24], [0, 5, 24], [0, 17, 24], [0, 3, 24])]
    _compiles_once(step, counter, list(proj.parameters()), cus)


def _compiles_once(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], counter: Any, params: list[torch.Tensor],
    args: list[torch.Tensor],
) -> None:
    """``step(x, arg)`` compiled equals it eagerly, values and gradients of ``params``, for each
    arg, and compiles no more frames after the first arg (at most two: before and after a call)."""
    compiled = torch.compile(step, backend=counter)
    torch.manual_seed(0)
    x = torch.randn(24, 8)
    for n, arg in enumerate(args):
        got = compiled(x, arg)
        got_grads = torch.autograd.grad(got, params)
        want = step(x, arg)
        want_grads = torch.autograd.grad(want, params)
        torch.testing.assert_close(got, want)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b)
        if n == 0:
            frames = counter.frame_count
    assert counter.frame_count == frames
    assert frames <= 2  # the code before the call and the code after it


@pytest.mark.parametrize("builder", ["padding", "document"])
def test_a_mask_built_inside_a_compiled_model_costs_no_recompile(builder: str) -> None:
    # masks.padding / document read their lengths or ids (checks, the blocks to skip): traced, each
    # call broke the graph five to eight times and new lengths recompiled; run eagerly, neither.
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    proj = nn.Linear(8, 8)

    def step(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        q = proj(x).view(2, 12, 2, 4).transpose(1, 2)  # (2·12, 8) → (2, 2, 12, 4)
        if builder == "padding":
            keep = az.masks.padding(lengths, 12)
        else:  # two documents per row, packed: ids from the lengths
            keep = az.masks.document(cu_seqlens=torch.cat([lengths.new_zeros(1), lengths, lengths.new_full((1,), 12)]))
        out = az.attention(q, q, q, mask=keep, causal=True)
        assert isinstance(out, torch.Tensor)
        return out.square().sum()

    lengths = [torch.tensor(n if builder == "padding" else n[:1]) for n in ([12, 7], [3, 12], [5, 9])]
    _compiles_once(step, counter, list(proj.parameters()), lengths)


@pytest.mark.parametrize("how", ["and_", "from_tensor"])
def test_a_tensor_joined_to_a_mask_the_readme_way_traces_whole(how: str) -> None:
    # (`pad & causal` itself makes dynamo run the whole function eagerly: README says what to write)
    def fn(q: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        causal = az.masks.causal(q.shape[2])
        keep = az.masks.and_(pad, causal) if how == "and_" else az.masks.from_tensor(pad) & causal
        out = az.attention(q, q, q, mask=keep)
        assert isinstance(out, torch.Tensor)
        return out

    q, pad = torch.randn(2, 2, 10, 4), torch.arange(10).view(1, 1, 1, 10) < torch.tensor([10, 6]).view(2, 1, 1, 1)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, pad), fn(q, pad))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_decode_step_with_a_cache_and_rotary_compiles_whole(grad: bool) -> None:
    """MultiHeadAttention with rotary embeddings and a KVCache, a step compiled with fullgraph=True,
    under no_grad (in place) and recording gradients (a copy of the storage): nothing in the cache
    or the rotary table breaks the graph (a check for inference mode did), and the outputs are
    eager's."""
    torch.manual_seed(0)
    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=2, rope=True).eval()
    x = torch.randn(1, 4, 32)
    step = torch.compile(lambda x, c: m(x, cache=c), fullgraph=True, backend="eager")
    outs = {}
    for name, run in (("eager", lambda x, c: m(x, cache=c)), ("compiled", step)):
        cache = az.KVCache(1, 8, 2, 8)
        with torch.set_grad_enabled(grad):
            outs[name] = torch.cat([run(x[:, :2], cache)] + [run(x[:, i : i + 1], cache) for i in (2, 3)], dim=1)
    torch.testing.assert_close(outs["compiled"], outs["eager"])
    assert outs["compiled"].requires_grad == grad
