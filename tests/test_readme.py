"""The README's example runs as written (a user's first contact with the library)."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def test_readme_example_runs() -> None:
    blocks = python_blocks(README)
    assert blocks, "README.md has no python example"
    scope: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), scope)
    out, y = scope["out"], scope["y"]
    assert isinstance(out, torch.Tensor) and out.shape == (2, 8, 128, 64)
    assert isinstance(y, torch.Tensor) and y.shape == (2, 10, 512)
    assert torch.isfinite(out).all() and torch.isfinite(y).all()


def test_readme_decoding_example_runs() -> None:
    block = next(b for b in python_blocks(README) if "KVCache" in b)
    scope: dict[str, object] = {}
    exec(compile(block, str(README), "exec"), scope)
    cache, step = scope["cache"], scope["step"]
    assert len(cache) == 21  # type: ignore[arg-type]
    assert isinstance(step, torch.Tensor) and step.shape == (1, 1, 256)


def test_readme_modern_attention_example_runs() -> None:
    for path in (README, README.with_name("README.zh-CN.md")):
        block = next(b for b in python_blocks(path) if "softcap" in b)
        scope: dict[str, object] = {}
        exec(compile(block, str(path), "exec"), scope)
        out = scope["out"]
        assert isinstance(out, torch.Tensor) and out.shape == (1, 8, 512, 64) and torch.isfinite(out).all()


def test_readme_flex_snippet_runs_and_is_torchs_by_its_import(tmp_path: Path) -> None:
    """The FlexAttention snippet runs as written (forward and the CPU backward), and with its import
    switched back to torch's gives torch's output (forward only: torch refuses the CPU backward)."""
    import warnings

    block = next(b for b in python_blocks(README) if "attnzero.flex" in b)
    ours: dict[str, object] = {}
    torch.manual_seed(0)
    exec(compile(block, str(README), "exec"), ours)
    q = ours["q"]
    assert isinstance(q, torch.Tensor) and q.grad is not None and torch.isfinite(q.grad).all()
    theirs_src = block.replace("from attnzero.flex import", "from torch.nn.attention.flex_attention import")
    theirs_src = "\n".join(line for line in theirs_src.splitlines() if "requires_grad_" not in line and
                           ".backward()" not in line)  # fmt: skip
    theirs: dict[str, object] = {}
    path = tmp_path / "torch_flex.py"  # its own file: torch's compile reads the mods' source lines
    path.write_text(theirs_src, encoding="utf-8")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(theirs_src, str(path), "exec"), theirs)
    out, want = ours["out"], theirs["out"]
    assert isinstance(out, torch.Tensor) and isinstance(want, torch.Tensor)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
