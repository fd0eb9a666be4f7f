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
