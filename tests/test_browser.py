"""The interactive page in a real browser: headless Chromium driven by selenium.

The page is built from made-up weights (no model needed): it must render without console errors,
draw one line per (query, key) pair, redraw when another head or layer is chosen, and show only
one token's lines when that token is hovered. Skips only where Chromium is absent on a user's
machine; under CI=true (where .ci/run installs chromium and chromium-driver) that absence fails.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import absent

from attnzero import viz


def _browser() -> tuple[str, str]:
    """Paths of the Chromium binary and its driver (Debian: chromium, chromium-driver)."""
    if importlib.util.find_spec("selenium") is None:
        absent("selenium is not installed (pip install -e '.[hf]')")
    binary = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        absent("Chromium and its driver are not installed (apt-get install chromium chromium-driver)")
    assert binary is not None and driver is not None
    return binary, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    binary, driver_path = _browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    profile = tmp_path_factory.mktemp("chromium-profile")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1200,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: selenium never looks for (or downloads) one itself.
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield drv
    finally:
        drv.quit()


def _views() -> list[viz.SentenceView]:
    gen = torch.Generator().manual_seed(0)
    en = "[CLS] the animal didn ' t cross the street because it was too tired [SEP]".split()
    zh = ["[CLS]", "我", "愛", "山", "上", "的", "花", "[SEP]"]
    views = []
    for title, tokens, focus in (("english", en, 10), ("中文", zh, 2)):
        L = len(tokens)
        weights = torch.softmax(3 * torch.randn(3, 4, L, L, generator=gen), dim=-1)  # (layers, heads, L, L)
        views.append(viz.SentenceView(title, tokens, weights, focus))
    return views


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return viz.save_html(_views(), tmp_path_factory.mktemp("page") / "attention.html")


def _opacities(drv) -> list[str]:  # type: ignore[no-untyped-def]
    return drv.execute_script(  # type: ignore[no-any-return]
        "return Array.from(document.querySelectorAll('#lines line')).map(l => l.getAttribute('stroke-opacity'));"
    )


def _severe(drv) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    return [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]


def test_page_renders_without_console_errors(browser, page: Path) -> None:  # type: ignore[no-untyped-def]
    browser.get(page.as_uri())
    assert _severe(browser) == []
    L = len(_views()[0].tokens)
    assert len(_opacities(browser)) == L * L  # one line per (query, key) pair
    texts = browser.execute_script(
        "return Array.from(document.querySelectorAll('#view text')).map(t => t.textContent);"
    )
    assert texts.count("animal") == 2  # the token on both sides


def test_choosing_another_head_or_layer_redraws(browser, page: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(page.as_uri())
    head0 = _opacities(browser)
    Select(browser.find_element(By.ID, "head")).select_by_value("2")
    head2 = _opacities(browser)
    assert browser.find_element(By.ID, "view").get_attribute("data-head") == "2"
    assert head2 != head0
    Select(browser.find_element(By.ID, "head")).select_by_value("mean")
    assert _opacities(browser) not in (head0, head2)
    Select(browser.find_element(By.ID, "layer")).select_by_value("1")
    assert browser.find_element(By.ID, "view").get_attribute("data-layer") == "1"
    Select(browser.find_element(By.ID, "sentence")).select_by_value("1")  # the Chinese sentence
    assert len(_opacities(browser)) == len(_views()[1].tokens) ** 2
    assert _severe(browser) == []


def test_hovering_a_token_shows_only_its_weights(browser, page: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    browser.get(page.as_uri())
    token = browser.find_element(By.CSS_SELECTOR, "#view text[data-side='query'][data-index='2']")
    ActionChains(browser).move_to_element(token).perform()
    lines = browser.execute_script(
        "return Array.from(document.querySelectorAll('#lines line'))"
        ".map(l => [l.getAttribute('data-query'), Number(l.getAttribute('stroke-opacity'))]);"
    )
    assert all(opacity == 0 for q, opacity in lines if q != "2")
    assert sum(opacity for q, opacity in lines if q == "2") == pytest.approx(1.0, abs=2e-3)  # a softmax row
    assert "animal" in browser.find_element(By.ID, "panel").text  # token 2 is "animal"
    assert _severe(browser) == []
