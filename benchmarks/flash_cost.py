"""What flash.py costs without a compiled kernel: the textbook flash (``attnzero.flash``) against
torch's SDPA and, with ``--old COMMIT``, against the flash.py of an older commit (its modules taken
from git into a temporary package ``attnzero_old``, so that both run in the same process). CPU,
float32, same run, interleaved medians; each backend's own entry (``flash.attention``), no
validation on either side. The ratios are of times: ``÷ torch`` above 1 is slower than torch.

    .venv/bin/python benchmarks/flash_cost.py [--old 9a76e81] [--repeats 7] [--blocks 64x256] [--threads 1]

Results: docs/benchmarks.md, "flash.py without the kernel".
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from attnzero import flash
from attnzero.bench import machine, time_interleaved

ROOT = Path(__file__).resolve().parents[1]
# the modules an old flash.py imports (relative imports only); missing ones are left out
OLD_MODULES = ("flash", "parallel", "softcap_cpu", "dropout", "geometry", "reference", "trace", "constants", "masks")
SHAPES = [  # (name, B, H, L, D, backward)
    ("B1 H8 L2048 D64 causal, fwd", 1, 8, 2048, 64, False),
    ("B1 H8 L2048 D64 causal, fwd+bwd", 1, 8, 2048, 64, True),
    ("B12 H4 L256 D32 causal, fwd+bwd", 12, 4, 256, 32, True),
]


def old_flash(commit: str, into: Path) -> ModuleType:
    """``flash`` of ``commit``, imported as ``attnzero_old.flash`` from a package of its modules."""
    pkg = into / "attnzero_old"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in (*OLD_MODULES, "softcap.c"):
        path = f"src/attnzero/{name}" + ("" if name.endswith(".c") else ".py")
        got = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if got.returncode == 0:
            (pkg / Path(path).name).write_text(got.stdout)
    sys.path.insert(0, str(into))
    return importlib.import_module("attnzero_old.flash")


def runs(B: int, H: int, L: int, D: int, backward: bool, impls: dict[str, Any]) -> dict[str, Callable[[], None]]:
    """One causal call of each implementation (``flash.attention``-like, or "torch"), and its backward."""
    q, k, v = (torch.randn(B, H, L, D, requires_grad=backward) for _ in range(3))
    dout = torch.randn(B, H, L, D)
    scale = D**-0.5

    def one(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(backward):
                out = fn()
                if backward:
                    out.backward(dout)

        return run

    fns: dict[str, Callable[[], None]] = {
        "torch": one(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))
    }
    for name, (mod, kw) in impls.items():
        fns[name] = one(lambda mod=mod, kw=kw: mod.attention(q, k, v, causal=True, scale=scale, **kw)[0])
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="a commit whose flash.py to time beside (e.g. 9a76e81)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--blocks", nargs="*", default=[], help="extra block sizes of the textbook flash, RxC")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = machine()
    threads = torch.get_num_threads()
    print(f"{info['date']} · {info['cpu']} · {info['cores']} · torch {info['torch']} · {threads} threads")
    impls: dict[str, Any] = {f"flash.py {flash.BLOCK[0]}x{flash.BLOCK[1]}": (flash, {})}
    for b in args.blocks:
        r, c = (int(x) for x in b.split("x"))
        impls[f"flash.py {r}x{c}"] = (flash, {"block": (r, c)})
    with tempfile.TemporaryDirectory() as tmp:
        if args.old:
            impls[f"old flash ({args.old})"] = (old_flash(args.old, Path(tmp)), {})
        names = ["torch", *impls]
        # time ratios: above 1 = slower than torch (than the old flash)
        print("\n| case | " + " | ".join(f"{n}" for n in names) + " | " + " | ".join(f"{n} ÷ torch" for n in impls)
              + (" | textbook ÷ old |" if args.old else " |"))  # fmt: skip
        print("|---" * (1 + len(names) + len(impls) + (1 if args.old else 0)) + "|")
        for label, B, H, L, D, backward in SHAPES:
            t = time_interleaved(runs(B, H, L, D, backward, impls), args.repeats)
            cells = [f"{t[n] * 1e3:.1f} ms" for n in names] + [f"{t[n] / t['torch']:.2f}" for n in impls]
            if args.old:
                cells.append(f"{t[names[1]] / t[names[-1]]:.2f}")
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
