"""How a ``score_mod`` and a ``mask_mod`` are called: the way torch's FlexAttention calls them.

A *score mod* ``score_mod(score, b, h, q_idx, kv_idx) -> score`` rewrites one pair's scaled score
``scale · q · k``; a *mask mod* ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether the pair is
kept (True = may attend). ``b`` is the batch index, ``h`` the *query* head, ``q_idx`` / ``kv_idx``
the 0-based positions of the query and the key (no bottom-right shift; the ring adds its global
offset). Each argument is a 0-d int32 tensor and the function is written for one pair::

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

Here it is called for a whole block at once by ``torch.func.vmap``, nested once per index (kv
innermost, then q, h, b — as torch's Flex nests them), so everything that runs in Flex runs here:
indexing captured tensors with the indices, reductions or ``torch.dot`` over captured tensors,
``h.new_zeros(h.shape)``, integer division, an ``autograd.Function`` with a vmap rule. A plain
broadcast call (the mod once on index tensors of shapes (B,1,1,1), (1,H,1,1), (1,1,r,1),
(1,1,1,c)) gives other results for mods that reduce or read shapes, no probe can prove two calls
equal on every block, and it is not faster: vmap's batching rules broadcast too (ALiBi on a
(1, 8, 2048, 2048) score grid, CPU: 0.49 s vmapped, 0.51 s broadcast) — so it is not used.

Two entries, one per kind of backend:

* ``score_block`` / ``mask_block`` — one block of (batches × query heads × rows × cols), what a
  tiled backend calls per block (flash, the Triton fallbacks, the ring with global positions);
* ``score_grid`` / ``mask_grid`` — the whole (B, H, Lq, Lk) grid, what the reference calls.

Tensors a mod captures may require grad: the block is an ordinary autograd graph, so their
gradients come back through whatever backward differentiates it (the reference: autograd).

Letters: B batch, H query heads, Lq / Lk query / key length; r, c a block's rows and columns.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import inspect
import sys
import sysconfig
import types
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
Range = tuple[int, int]  # [start, stop)

INDEX_DTYPE = torch.int32  # the dtype of b, h, q_idx, kv_idx, as torch's Flex passes them


class ModError(TypeError, RuntimeError):
    """A mod returned something attention cannot use (a different shape or dtype): a ``TypeError``,
    and a ``RuntimeError`` like torch's own errors."""


# Arithmetic that torch's vmap cannot take a symbolic int into under torch.compile: ``w * q_idx``,
# ``q_idx - w``, ``q_idx / w`` with ``w`` an int the compiled program made dynamic (its second value)
# fail in vmap's scalar wrapping (``_to_copy`` of a SymInt, torch 2.13). By name: dynamo guards a
# set of functions badly (membership tests failed their own guards).
_SCALAR_ARITHMETIC = frozenset(
    {"__mul__", "__rmul__", "mul", "multiply", "__add__", "__radd__", "add", "__sub__", "sub", "subtract",
     "__truediv__", "__rtruediv__", "div", "divide", "true_divide", "__floordiv__", "__rfloordiv__",
     "floor_divide", "__mod__", "__rmod__", "remainder"}
)  # fmt: skip


_TRUE_DIVISION = frozenset({"__truediv__", "__rtruediv__", "div", "divide", "true_divide"})


def _int_operand(t: Tensor, n: int, true_division: bool) -> Any:
    """The Python int ``n`` (a SymInt when traced) as vmap can take it beside ``t``, with the result
    eager gives: beside a float tensor, or in a true division, a float number (exact to 2**53; torch
    divides by the number's value, and computes in t's dtype either way); beside an integer or bool
    tensor a 0-d tensor of the result's dtype holding ``n`` wrapped into its range (two's complement,
    as eager's cast of the number wraps it). An int beyond int64's stays as it is (eager refuses it)."""
    if not -(2**63) <= n < 2**63:
        return n
    if t.dtype.is_floating_point or t.dtype.is_complex or true_division:
        return n * 1.0
    dtype = t.dtype if t.dtype != torch.bool else torch.int64
    info = torch.iinfo(dtype)
    return torch.scalar_tensor((n - info.min) % (1 << info.bits) + info.min, dtype=dtype, device=t.device)


class ModOps(TorchFunctionMode):
    """The torch-function mode a mod runs under, for two things vmap cannot do as Flex's users write them:

    * ``table[h, q_idx - kv_idx]`` with 0-d index tensors: Python's indexing would ask each index
      for an int (``__index__``), which a batched tensor cannot give, so indexing by tensors only is
      sent to ``aten.index`` (advanced indexing, which vmap batches);
    * under torch.compile, a Python int in arithmetic with a tensor (``w * (q_idx - kv_idx)``)
      enters as vmap can take it (``_int_operand``), so a captured int that the compiled program
      makes dynamic (a SymInt) does not fail on its second value. (Traced, a SymInt reads as an int:
      every int is converted there, with eager's result. A symbolic float passes as it is.)"""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is Tensor.__getitem__ and len(args) == 2:
            x, index = args
            parts = index if isinstance(index, tuple) else (index,)
            if parts and all(isinstance(i, Tensor) for i in parts):
                return torch.ops.aten.index.Tensor(x, list(parts))
        name = getattr(func, "__name__", "") if torch.compiler.is_compiling() and len(args) == 2 else ""
        if name in _SCALAR_ARITHMETIC:
            a, b = args
            if isinstance(a, Tensor) != isinstance(b, Tensor):
                t, n = (a, b) if isinstance(a, Tensor) else (b, a)
                if isinstance(n, int) and not isinstance(n, bool):  # (a SymInt reads as an int when traced)
                    true_division = name in _TRUE_DIVISION and (kwargs or {}).get("rounding_mode") is None
                    n = _int_operand(t, n, true_division)
                    args = (t, n) if isinstance(a, Tensor) else (n, t)
        return func(*args, **(kwargs or {}))


def _nest(fn: Callable[..., Any], with_score: bool) -> Callable[..., Tensor]:
    """``fn`` vmapped over (b, h, q_idx, kv_idx): kv innermost, b outermost. The score, when there is
    one, is mapped at every level (its dims are (b, h, q, kv)); each index only at its own level.
    What ``fn`` returns for one pair must be a 0-d tensor (else ``ModError``)."""
    name, what = ("score_mod", "score") if with_score else ("mask_mod", "bool")
    user = fn

    def one_pair(*args: Tensor) -> Tensor:
        out = call_one(name, user, args)
        if out.ndim != 0:
            raise ModError(
                f"{name}: expected a 0-d tensor {what} per (b, h, q_idx, kv_idx), got shape {tuple(out.shape)}"
            )
        return out

    fn = one_pair  # (``user`` keeps the user's function: ``fn`` is rebound below)
    lead = (0,) if with_score else ()
    for level in (3, 2, 1, 0):  # kv, q, h, b
        dims = tuple(0 if i == level else None for i in range(4))
        fn = torch.vmap(fn, in_dims=lead + dims)
    return fn


def call_one(name: str, fn: Any, args: Sequence[Tensor]) -> Tensor:
    """``fn(*args)``, the mod ``name`` (``score_mod`` / ``mask_mod``) for one pair, refused unless a
    tensor comes back (``ModError``); a function of another arity is refused by the argument's name
    (its signature asked only after a TypeError: one of the mod's own passes as it is)."""
    try:
        out = fn(*args)
    except TypeError as e:
        try:
            inspect.signature(fn).bind(*args)
        except TypeError:
            raise ModError(f"{name}: expected a function {SIGNATURES[name]}, got {e}") from e
        except ValueError:  # no signature to read (a builtin)
            pass
        raise
    if not isinstance(out, Tensor):
        what = "score" if name == "score_mod" else "bool"
        raise ModError(f"{name}: expected a 0-d torch.Tensor {what} per pair, got {type(out).__name__}")
    return out


def _indices(batches: Range, heads: Range, rows: Range, cols: Range, device: torch.device) -> list[Tensor]:
    """The four index vectors of a block: b (nb,), h (nh,), q_idx (r,), kv_idx (c,), int32."""
    return [torch.arange(a, z, dtype=INDEX_DTYPE, device=device) for a, z in (batches, heads, rows, cols)]


def _checked(name: str, out: Any, shape: tuple[int, ...], dtype: torch.dtype | None, what: str) -> Tensor:
    """The mod's result over the block, refused unless it has the block's shape (and ``dtype``)."""
    if not isinstance(out, Tensor):
        raise ModError(f"{name}: expected a torch.Tensor {what}, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        extra = tuple(out.shape[len(shape) :]) if tuple(out.shape[: len(shape)]) == shape else tuple(out.shape)
        raise ModError(
            f"{name}: expected a 0-d tensor {what} per (b, h, q_idx, kv_idx), the block of shape {shape}; "
            f"got {extra if extra else tuple(out.shape)} per pair"
        )
    if dtype is not None and out.dtype != dtype:
        raise ModError(
            f"{name}: expected the score's dtype {dtype} back, got {out.dtype} (a captured tensor of another "
            f"dtype promotes it: cast it, e.g. table.to(score.dtype))"
        )
    return out


def score_block(score_mod: ScoreMod, s: Tensor, *, batches: Range, heads: Range, rows: Range, cols: Range) -> Tensor:
    """``score_mod`` applied to one block of scaled scores ``s`` (nb, nh, r, c): batches
    ``[b0, b1)``, query heads ``[h0, h1)``, query positions ``[r0, r1)``, key positions
    ``[c0, c1)`` (give global positions where the block sits in a longer sequence). Returns the
    modified scores, same shape and dtype (else ``ModError``); −inf blocks a pair."""
    idx = _indices(batches, heads, rows, cols, s.device)
    want = tuple(i.shape[0] for i in idx)  # (not len(): an exported size would be made a constant)
    if tuple(s.shape) != want:  # (a caller's error, not the user's)
        raise ValueError(f"s: expected the block's shape {want}, got {tuple(s.shape)}")
    if s.numel() == 0:
        return s
    with ModOps():
        out = _nest(score_mod, True)(s, *idx)  # (nb, nh, r, c)
    # a mod that ignores the score or an index comes back from vmap expanded along it (stride 0):
    # its own memory, so that a backend may write into it
    return _checked("score_mod", out, want, s.dtype, "score").contiguous()


def mask_block(
    mask_mod: MaskMod, *, batches: Range, heads: Range, rows: Range, cols: Range, device: torch.device | str | None
) -> Tensor:
    """``mask_mod`` on one block: bool (nb, nh, r, c), True = may attend (a non-bool result counts
    non-zero as True)."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    return mask_on(mask_mod, *_indices(batches, heads, rows, cols, dev))


def mask_on(mask_mod: MaskMod, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod`` on the grid of four index vectors (any int values, int32): bool (nb, nh, r, c)."""
    want = (len(b), len(h), len(q_idx), len(kv_idx))
    if 0 in want:
        return torch.zeros(want, dtype=torch.bool, device=kv_idx.device)
    with ModOps():
        out = _nest(mask_mod, False)(b, h, q_idx, kv_idx)  # (nb, nh, r, c)
    out = _checked("mask_mod", out, want, None, "bool")
    return out if out.dtype == torch.bool else out != 0


def score_block_backward(
    score_mod: ScoreMod,
    s: Tensor,
    ds_mod: Tensor,
    captured: Sequence[Tensor] = (),
    *,
    batches: Range,
    heads: Range,
    rows: Range,
    cols: Range,
) -> tuple[Tensor, list[Tensor | None]]:
    """The backward of ``score_block`` on one block, for a tiled backend's own backward: given the
    block's scaled scores ``s`` (nb, nh, r, c) and the gradient ``ds_mod`` of the *modified* scores,
    ``(ds, grads)`` — the gradient of the scores before the mod, and of each tensor in ``captured``
    (``captured_tensors(score_mod)``; None where the mod does not use it). Summed over the blocks,
    the captured gradients are the whole call's. Recomputes the mod on the block (autograd)."""
    with torch.enable_grad():
        x = s.detach().requires_grad_(True)
        y = score_block(score_mod, x, batches=batches, heads=heads, rows=rows, cols=cols)
        wrt = [x, *[t for t in captured if t.requires_grad]]
        if not y.requires_grad:  # a mod that reads neither the score nor a tensor with a gradient
            return torch.zeros_like(s), [None] * len(captured)
        got = torch.autograd.grad(y, wrt, ds_mod, allow_unused=True)
    ds = torch.zeros_like(s) if got[0] is None else got[0]
    rest = iter(got[1:])
    return ds, [next(rest) if t.requires_grad else None for t in captured]


def pin(fn: Any) -> Any:
    """``fn`` as one call's forward saw it, for that call's backward, which calls the mod again. A
    function gets a copy whose closure cells are its own, holding what the originals hold now: a
    mod made in a loop that reads the loop variable (Python binds it when the mod runs) reads, in
    the backward, the value its forward read — not the loop's last. Any other callable is called
    through such a function. Its walk (``_walk``) is made here, once: the call's forward reads it
    (``captured_tensors``, ``fingerprint``), and so does the backward: the tensors it reaches through
    anything else (globals, fields, containers) are recorded, and a backward that finds it reading
    others raises instead of computing the gradients of another function (``_walk_pinned``); a
    captured tensor changed in place is refused by autograd's own check (each backend saves the
    captured tensors for its backward).
    Traced by dynamo, ``fn`` as it is: the compiled graph holds what the trace read."""
    if torch.compiler.is_compiling():
        return fn
    if not inspect.isfunction(fn):
        target = fn

        def calling(*args: Tensor) -> Tensor:
            return target(*args)  # type: ignore[no-any-return]

        fn = calling
    pinned = _copy(fn)
    roles: list[Role] | None = [] if torch.is_grad_enabled() else None  # (paths: for a backward's check only)
    _PINNED[pinned] = (*_walk(pinned, roles), roles)
    return pinned


def own_closure(fn: Any) -> Any:
    """A function ``fn`` with closure cells of its own, holding what its cells hold now (any other
    callable, or a function without a closure, as it is): what a ``Mask`` keeps of its mask_mod, so
    that a mask made in a loop reading the loop variable stays the mask it was made as, in the
    forward and in the backward that evaluates it again."""
    if torch.compiler.is_compiling() or not inspect.isfunction(fn) or not fn.__closure__:
        return fn
    return _copy(fn)


def _copy(fn: types.FunctionType) -> types.FunctionType:
    """A new function of ``fn``'s code, globals, defaults and attributes, its closure cells copies."""
    cells = tuple(_copy_cell(c) for c in fn.__closure__) if fn.__closure__ else None
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__, out.__module__ = fn.__qualname__, fn.__module__
    out.__dict__.update(fn.__dict__)
    return out


def _copy_cell(cell: Any) -> Any:
    try:
        return types.CellType(cell.cell_contents)
    except ValueError:  # an empty cell (a name bound later in the enclosing function)
        return types.CellType()


# A pinned mod → its walk when pinned: the call's forward reads it (no walk again), a backward
# compares the tensors it reaches then with these.
_PINNED: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], list[Tensor], bool, list[Role] | None]] = (
    weakref.WeakKeyDictionary()
)

# -1 outside a backward (torch.utils.checkpoint asks it too); where torch lacks it, always walk again
_graph_task: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: 0)


def _walk_pinned(fn: Any) -> tuple[tuple[Any, ...], list[Tensor], bool]:
    """``_walk(fn)`` — for a pinned mod, the pin's: its call's forward reads it, and so does the
    backward, whose gradients go to the tensors the forward captured. A backward first walks the mod
    again; where a tensor now stands in another role than in the forward (``_moved``: a field or a
    global rebound, two fields swapped), it calls the mod once on a one-pair block (``_reads_any``)
    and refuses one that reads such a tensor (the backward would differentiate another function).
    One that does not — a module whose forward rebinds a field the mod never reads, such as
    ``self.last = out.detach()`` — keeps the forward's tensors."""
    pinned = _PINNED.get(fn) if inspect.isfunction(fn) else None
    if pinned is None:
        return _walk(fn)
    if _graph_task() != -1 and pinned[3] is not None:  # (None: pinned without grad, no backward of its own)
        roles: list[Role] = []
        key, tensors, _ = _walk(fn, roles)
        moved = _moved(pinned[0], pinned[1], pinned[3], key, tensors, roles)
        if moved and _reads_any(fn, moved, (pinned[1] or moved)[0].device):  # (where the mod's tables live)
            raise ModError(
                "score_mod: the tensors it reads changed between this call's forward and its backward (a global, "
                "a field or a container rebound); the backward would differentiate another function. Bind what "
                "it reads when it is made (a default argument such as `i=i`, or a closure)"
            )
    return pinned[0], list(pinned[1]), pinned[2]


def _moved(
    was_key: tuple[Any, ...], was: list[Tensor], was_roles: list[Role],
    key: tuple[Any, ...], now: list[Tensor], roles: list[Role],
) -> list[Tensor]:  # fmt: skip
    """The tensors of a walk ``(key, now, roles)`` that may be read where the forward's walk read
    another: one met at a path (``self.table``, ``cfg["x"]["w"]``, ``tables[1]``) where the forward
    met another tensor or none, and every tensor met under a path that a reference now leads to
    instead of the forward's (``self.cur = self.layers[1]``). A field, buffer or hook added or
    rebound elsewhere moves nothing else."""
    if was_key == key and len(was) == len(now) and all(a is b for a, b in zip(was, now)):
        return []
    before = {path: was[i] for kind, path, i in was_roles if kind == "T"}
    led = {path: to for kind, path, to in was_roles if kind == "R"}
    elsewhere = [to for kind, path, to in roles if kind == "R" and led.get(path) != to]
    # every meeting of a tensor both walks met, in walk order: one met in another order (a dict
    # re-inserted, keys alike swapped) may be read by position (values(), iteration) where another was
    kept = {id(t) for t in was} & {id(t) for t in now}
    order_was = [id(was[i]) for kind, _, i in was_roles if kind == "T" and id(was[i]) in kept]
    order_now = [id(now[i]) for kind, _, i in roles if kind == "T" and id(now[i]) in kept]
    reordered = {b for a, b in zip(order_was, order_now) if a != b}
    if len(order_was) != len(order_now):  # met more or fewer times: no meeting can be matched to the forward's
        reordered |= set(order_now)
    moved: list[Tensor] = []
    for kind, path, i in roles:
        if kind != "T":
            continue
        t = now[i]
        if before.get(path) is t and id(t) not in reordered and not any(path[: len(to)] == to for to in elsewhere):
            continue
        if not any(t is m for m in moved):
            moved.append(t)
    return moved


class _Reads(TorchFunctionMode):
    """Records whether any tensor of ``ids`` is an argument of a torch function or tensor method."""

    def __init__(self, ids: set[int]) -> None:
        super().__init__()
        self.ids, self.hit = ids, False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.hit = self.hit or any(
            isinstance(a, Tensor) and id(a) in self.ids for a in torch.utils._pytree.tree_leaves((args, kwargs))
        )
        return func(*args, **kwargs)


def _reads_any(fn: Any, tensors: list[Tensor], device: torch.device) -> bool:
    """Whether the score_mod ``fn`` reads one of ``tensors`` when called on a one-pair block on
    ``device`` (at index 0 everywhere); True too when that call fails — the backward cannot vouch
    for the mod then."""
    reads = _Reads({id(t) for t in tensors})
    s = torch.zeros(1, 1, 1, 1, device=device)  # (b, h, q, kv)
    try:
        with torch.no_grad(), reads, ModOps():
            _nest(fn, True)(s, *_indices((0, 1), (0, 1), (0, 1), (0, 1), s.device))
    except Exception:  # any failure: refuse, as when it reads them
        return True
    return reads.hit


def captured_tensors(fn: Any) -> list[Tensor]:
    """The tensors a mod reads besides its arguments, for a backend that must give them gradients
    outside autograd's graph (its own backward, ``score_block_backward``): every tensor ``_walk``
    meets (closures, globals, defaults, partials, containers, objects' and modules' fields —
    parameters, buffers and plain tensor fields), each once, in the order met: ``fingerprint``'s."""
    return _walk_pinned(fn)[1]


def fingerprint(fn: Any) -> tuple[tuple[Any, ...] | None, list[Tensor]]:
    """What a mod's traced graph depends on besides its arguments, as a hashable key (``_walk``):
    equal keys trace to the same graph (``cpu_mods.py`` and ``kernels/codegen.py`` keep generated
    code by it). None when the walk cannot vouch for that — nesting deeper than it follows, a
    container longer than ``_BIG`` (a mod that reaches data: not walked), an object it cannot
    compare — and then nothing may be kept by it. Returns ``(key, tensors)``: the
    captured tensors in the key's order (``captured_tensors``)."""
    key, tensors, complete = _walk_pinned(fn)
    return (key if complete else None), tensors


Trail = tuple[Any, ...]  # the labels from the mod to a value: fields' and keys' names, list indices, ...
Role = tuple[str, Trail, Any]  # ("T", path, index in tensors) or ("R", path, the path it was first met at)


def _walk(fn: Any, roles: list[Role] | None = None) -> tuple[tuple[Any, ...], list[Tensor], bool]:
    """Everything a mod reads besides its arguments, as a structure: closures; the globals, defaults
    and own attributes of every function; partials' arguments with their names; dicts' keys and
    values; objects' and modules' fields, slots and class attributes (a user class's constants,
    properties and methods; a module's parameters, buffers, submodules, hooks and plain fields); and
    the attributes its code names on a Python module or a class it reads as a global. Each object
    once, a later meeting as a reference to the first (``(t1, t1, t2)`` and ``(t1, t2, t2)``
    differ); the code of every function (a lambda made anew with the same code is the same); the
    value of every Python number, string and flag (traced in as constants; ``repr`` for floats:
    -0.0 is not 0.0); a numpy array's values; each tensor's type, shape, strides, dtype, device,
    requires_grad and Python attributes (their values are read when the generated code runs, not
    traced in); anything else by equality, held in the key — but an object hashed by identity by its
    fields and class, not itself. A library's function (torch's, attnzero's, Python's, an installed
    package's: ``_library``) by its code, closure and defaults, not its globals. Every field of an
    object counts, named by the mod's code or not: what a trace reads cannot be listed from the code
    (special methods, ``getattr`` of a computed name, a library reading ``vars(obj)``). Returns
    ``(key, tensors in the order met, complete)``. ``roles``, when given, gets the path of every
    meeting of a tensor (the first and each later one) with its index in the tensors, and of every
    later meeting of another object with the path it was first met at (``_moved``)."""
    out: list[Any] = []
    tensors: list[Tensor] = []
    first: dict[int, int] = {}  # id of an object met → its number (the order of first meetings)
    held: list[Any] = []  # what the walk met, alive until it ends (ids stay unique)
    complete = True
    trail: list[Any] = []  # the path to the value met now (kept for ``roles`` only)
    first_at: dict[int, Trail] = {}  # id of an object met → the path it was first met at (for ``roles``)

    def of_class(obj: Any, depth: int, names: list[str]) -> None:
        """A user class's own attributes (not a library's): constants, and the code of its methods
        and properties (they may read other fields, which are walked anyway)."""
        for cls in type(obj).__mro__:
            if _library(cls.__module__):
                continue
            for k, x in vars(cls).items():
                if k.startswith("__") and k.endswith("__") and k != "__call__":
                    continue
                out.append(("CK", cls.__qualname__, k))
                visit(_unwrap(x), depth + 1, names, out[-1])

    def fields(obj: Any, depth: int, names: list[str]) -> None:
        """Every field (a module's parameters, buffers, submodules, hooks, ``training``, plain fields)."""
        for k, x in (_own_dict(obj) or {}).items():
            if not isinstance(obj, torch.nn.Module) or k not in _MODULE_INTERNALS:
                out.append(("K", k))
                visit(x, depth + 1, names, out[-1])
        for cls in type(obj).__mro__:  # __slots__ fields
            for k in getattr(cls, "__slots__", ()):
                x = _slot(obj, k) if k not in ("__dict__", "__weakref__") else _MISSING
                if x is not _MISSING:
                    out.append(("K", k))
                    visit(x, depth + 1, names, out[-1])

    def visit(obj: Any, depth: int, names: list[str], label: Any) -> None:
        """``meet(obj)`` at the path ``trail`` + ``label`` (kept only for ``roles``)."""
        if roles is None:
            meet(obj, depth, names)
            return
        trail.append(label)
        try:
            meet(obj, depth, names)
        finally:
            trail.pop()

    def meet(obj: Any, depth: int, names: list[str]) -> None:
        nonlocal complete
        if type(obj) in weakref.ProxyTypes:  # (type(): isinstance asks the referent, a dead one raises)
            try:
                referent = obj.__repr__.__self__
            except ReferenceError:
                out.append(("DEAD",))
                return
            out.append(("WP",))
            obj = referent
        if obj is None or isinstance(obj, (bool, int, str, bytes)):
            out.append(("V", type(obj), obj))
            return
        if isinstance(obj, (float, complex)):
            out.append(("V", type(obj), repr(obj)))
            return
        if depth > 24:
            complete = False
            return
        if id(obj) in first:
            if roles is not None and isinstance(obj, Tensor):
                roles.append(("T", tuple(trail), next(i for i, t in enumerate(tensors) if t is obj)))
            elif roles is not None:
                roles.append(("R", tuple(trail), first_at[id(obj)]))
            out.append(("R", first[id(obj)]))
            return
        first[id(obj)] = len(first)
        held.append(obj)
        if roles is not None:
            first_at[id(obj)] = tuple(trail)
        if isinstance(obj, Tensor):  # (a tensor's values are read when the code runs; not its layout)
            if roles is not None:
                roles.append(("T", tuple(trail), len(tensors)))
            out.append(("T", type(obj), tuple(obj.shape), obj.stride(), obj.dtype, obj.device, obj.requires_grad))
            tensors.append(obj)
            if _own_dict(obj):  # Python attributes set on it (``t.scale``)
                fields(obj, depth, names)
        elif type(obj).__module__ == "numpy" and getattr(getattr(obj, "dtype", None), "hasobject", False):
            complete = False  # an array of objects: its bytes are their addresses, not what they hold
        elif type(obj).__module__ == "numpy" and hasattr(obj, "tobytes"):  # an ndarray or a numpy scalar
            values = hashlib.sha256(obj.tobytes()).digest()  # (its values' digest: a key holds no copy of them)
            out.append(("A", type(obj), str(getattr(obj, "dtype", "")), getattr(obj, "shape", ()), values))
        elif isinstance(obj, torch.nn.Module):
            out.append(("N", type(obj)))
            fields(obj, depth, names)  # parameters, buffers, submodules, hooks, plain fields, ``training``
            of_class(obj, depth, names)
        elif isinstance(obj, functools.partial):
            out.append(("P", len(obj.args)))
            for n, x in enumerate((obj.func, *obj.args)):
                visit(x, depth + 1, names, ("P", n))
            for k, x in obj.keywords.items():
                out.append(("K", k))
                visit(x, depth + 1, names, out[-1])
        elif isinstance(obj, (list, tuple, dict, set, frozenset, collections.deque)) and len(obj) > _BIG:
            complete = False  # data, not configuration: not walked, but for the tensors it holds
            out.append(("BIG",))  # (dict(model.named_parameters()): each parameter gets its gradient)
            for n, x in enumerate(obj.values() if isinstance(obj, dict) else obj):
                if isinstance(x, Tensor):
                    visit(x, depth + 1, names, ("I", n))
        elif isinstance(obj, (list, tuple, collections.deque)):
            out.append(("L", type(obj), len(obj)))
            for n, x in enumerate(obj):
                visit(x, depth + 1, names, ("I", n))
            if type(obj) not in (list, tuple):  # a subclass's fields (``lst.scale``), a namedtuple's none
                fields(obj, depth, names)
        elif isinstance(obj, (dict, types.MappingProxyType)):
            out.append(("D", type(obj), len(obj)))
            for k, x in obj.items():
                out.append(("K", k if isinstance(k, (str, int)) else repr(k)))
                visit(x, depth + 1, names, out[-1])
            if type(obj) not in (dict, types.MappingProxyType):
                fields(obj, depth, names)
        elif isinstance(obj, (set, frozenset)):
            if not all(x is None or isinstance(x, (bool, int, float, str, bytes)) for x in obj):
                complete = False  # objects in no order: their repr would stand for them
            out.append(("S", type(obj), tuple(sorted(repr(x) for x in obj))))
        elif isinstance(obj, weakref.ref):
            out.append(("W",))
            visit(obj(), depth + 1, names, ("W",))  # what it points to now
        elif isinstance(obj, types.BuiltinMethodType | types.MethodWrapperType) and not isinstance(
            getattr(obj, "__self__", None), (types.ModuleType, type, type(None))
        ):  # a builtin's method bound to data: ``TAB.get``, ``TAB.__getitem__``, ``(p,).__getitem__``
            out.append(("BM", obj.__name__))
            visit(obj.__self__, depth + 1, names, ("BM",))
        elif inspect.ismethod(obj):
            out.append(("M",))
            visit(obj.__self__, depth + 1, _names(obj.__func__.__code__), ("self",))  # a classmethod's ``cls.alpha``
            visit(obj.__func__, depth + 1, names, ("func",))
        elif inspect.isfunction(obj):
            own = _names(obj.__code__)
            out.append(("F", obj.__code__, len(obj.__closure__ or ())))
            for n, cell in enumerate(obj.__closure__ or ()):
                try:
                    x = cell.cell_contents
                except ValueError:  # an empty cell
                    out.append(("E",))
                    continue
                visit(x, depth + 1, own, ("cell", n))
            out.append(("FD",))
            visit(obj.__defaults__, depth + 1, own, ("FD",))
            visit(obj.__kwdefaults__, depth + 1, own, ("KD",))
            visit(dict(vars(obj)), depth + 1, own, ("FA",))  # the function's own attributes (``fn.alpha``)
            for name in own if not _library(obj.__module__) else ():
                if name in obj.__globals__:
                    out.append(("G", name))
                    visit(obj.__globals__[name], depth + 1, own, out[-1])
        elif isinstance(obj, (type, types.ModuleType)):
            # a config class or module read as a global: the attributes the code names (``Cfg.alpha``,
            # ``cfg.alpha``), as stored (a property is not run) — not every attribute (``torch``'s thousands)
            # A class's methods name more of its attributes (a classmethod's ``cls.alpha``): those too.
            out.append(("C", obj))
            todo, done = list(names), set()
            home = obj.__name__ if isinstance(obj, types.ModuleType) else obj.__module__
            if "getattr" in names and not _library(home):
                # a name computed in the code (``getattr(cfg, f"table_{i}")``): every attribute of a user's own
                todo += [k for k in vars(obj) if not (k.startswith("__") and k.endswith("__"))]
            while todo:
                name = todo.pop(0)
                x = inspect.getattr_static(obj, name, _MISSING)
                if x is _MISSING and isinstance(obj, types.ModuleType) and name not in done:
                    x = vars(obj).get("__getattr__", _MISSING)  # PEP 562: the module computes it
                    name = "__getattr__" if x is not _MISSING else name
                if x is _MISSING or name in done:
                    continue
                done.add(name)
                x = _unwrap(x)
                if isinstance(obj, type) and inspect.isfunction(x):
                    todo += _names(x.__code__)
                out.append(("K", name))
                visit(x, depth + 1, names, out[-1])
        elif callable(obj) or _own_dict(obj) is not None or hasattr(type(obj), "__slots__"):
            # the object itself too where its fields cannot tell it apart (a builtin such as torch.exp);
            # not one whose fields are walked: each new instance (a frozen dataclass, a callable made
            # per call) would be a new key, traced again and held by the cache with all it holds
            by_fields = _own_dict(obj) is not None or _slots(obj)
            out.append(("O", type(obj), obj) if _hashable(obj) and not by_fields else ("O", type(obj)))
            fields(obj, depth, names)
            of_class(obj, depth, names)
        elif _hashable(obj):
            out.append(("X", type(obj), obj))  # compared by equality (held by the key)
        else:
            complete = False

    visit(fn, 0, [], ())
    # the four functions reach one another through their cells: a cycle that kept everything the walk
    # met (the mod, its tensors, a bound method's module) alive until the cycle collector ran
    of_class = fields = visit = meet = None  # type: ignore[assignment]  # noqa: F811 (emptied cells)
    return tuple(out), tensors, complete


_MISSING = object()


def _unwrap(x: Any) -> Any:
    """A class attribute as the code it runs: a staticmethod's or classmethod's function, a
    property's getter; anything else as it is."""
    if isinstance(x, (staticmethod, classmethod)):
        return x.__func__
    return x.fget if isinstance(x, property) else x


@functools.cache
def _library(module: str | None) -> bool:
    """Whether code is a library's — torch's, attnzero's, Python's own or an installed package's (a
    file under the interpreter's library folders) — rather than the user's: its globals are the
    library, not the mod's configuration, and are not walked (an installed package's setting changed
    at run time is not seen). A lambda made in a module's ``forward`` reaches the class, its
    ``forward``, and from its globals ``az`` or pytest's helpers: walked, they took in whole packages
    and their caches, the key was None and every call traced again."""
    top = (module or "").split(".")[0]
    if top in ("torch", "attnzero"):
        return True
    file = getattr(sys.modules.get(top), "__file__", None)
    if file is None:  # built into the interpreter (builtins, sys) — or made at run time (the user's)
        return top in sys.builtin_module_names
    return any(Path(file).resolve().is_relative_to(p) for p in _INSTALLED)  # not a user's sched.py


_INSTALLED = tuple({Path(sysconfig.get_path(k)).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def _slots(obj: Any) -> bool:
    return any(k not in ("__dict__", "__weakref__") for c in type(obj).__mro__ for k in getattr(c, "__slots__", ()))


def _own_dict(obj: Any) -> dict[str, Any] | None:
    """``obj.__dict__``, or None — also where asking raises (a ``__getattr__`` that raises KeyError, a
    dead weak proxy): the walk only keys the cache, it must not fail a call the mod itself runs."""
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:
        return None
    return d if isinstance(d, dict) else None


def _slot(obj: Any, name: str) -> Any:
    """A slot's value, or ``_MISSING`` (unset, or asking raises)."""
    try:
        return object.__getattribute__(obj, name)
    except Exception:
        return _MISSING


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True

_BIG = 1000  # a list, dict or set longer than this is not walked: the key is None (nothing kept)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {
    "_parameters", "_buffers", "_modules", "training", "_forward_hooks", "_forward_pre_hooks"
}  # fmt: skip


def _names(code: Any) -> list[str]:
    """The global and attribute names a code object and the code objects nested in it (lambdas,
    inner functions) refer to, and its string constants (``getattr(self, "gamma", 1.0)``)."""
    out = list(code.co_names)
    for c in code.co_consts:
        if inspect.iscode(c):
            out += _names(c)
        elif isinstance(c, str) and c.isidentifier():
            out.append(c)
    return out


def score_grid(score_mod: ScoreMod, s: Tensor, *, q_offset: int = 0, kv_offset: int = 0) -> Tensor:
    """``score_mod`` on the whole grid of scaled scores ``s`` (B, H, Lq, Lk) (what the reference
    calls); query ``i`` is at position ``q_offset + i``, key ``j`` at ``kv_offset + j``."""
    B, H, Lq, Lk = s.shape
    return score_block(
        score_mod, s, batches=(0, B), heads=(0, H), rows=(q_offset, q_offset + Lq), cols=(kv_offset, kv_offset + Lk)
    )


def mask_grid(mask_mod: MaskMod, B: int, H: int, Lq: int, Lk: int, device: torch.device | str | None = None) -> Tensor:
    """``mask_mod`` on the whole (B, H, Lq, Lk) grid, bool — dense: only for small problems and tests
    (``masks.from_mod`` evaluates it block by block)."""
    return mask_block(mask_mod, batches=(0, B), heads=(0, H), rows=(0, Lq), cols=(0, Lk), device=device)


SIGNATURES = {
    "score_mod": "score_mod(score, b, h, q_idx, kv_idx) -> score",
    "mask_mod": "mask_mod(b, h, q_idx, kv_idx) -> bool",
}


def check_callable(name: str, fn: Any) -> Any:
    """``fn`` if it is None or callable, else a ``TypeError`` naming the argument (``score_mod`` or
    ``mask_mod``) and the signature expected."""
    if fn is not None and not callable(fn):
        from .checks import ArgumentTypeError

        raise ArgumentTypeError(f"{name}: expected None or a function {SIGNATURES[name]}, got {type(fn).__name__}")
    return fn


__all__ = [
    "INDEX_DTYPE",
    "MaskMod",
    "ModError",
    "ModOps",
    "ScoreMod",
    "captured_tensors",
    "fingerprint",
    "mask_block",
    "mask_grid",
    "mask_on",
    "own_closure",
    "pin",
    "score_block",
    "score_block_backward",
    "score_grid",
]  # fmt: skip
