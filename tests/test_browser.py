"""The HTML page of a trace in a real browser: headless Chromium driven by Selenium.

Skipped, with the reason, where Chromium, its driver or Selenium is missing
(CI installs Debian's ``chromium`` and ``chromium-driver``). The page is
opened from ``file://``. What the page must show comes from the model built
for the test (names, number of calls, paths) and from Python's own ``sorted``;
a screenshot of each window size is left in ``$QKVTRACE_ARTIFACTS`` (default
``test-artifacts/``) for people to look at.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _html_model import build

import qkvtrace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(os.environ.get("QKVTRACE_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("no Chromium and ChromeDriver here (Debian: apt-get install chromium chromium-driver)",
                allow_module_level=True)  # fmt: skip

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two forwards and a backward of the test model, with maps: rows mha, attend, mha, attend."""
    model, x = build()
    with qkvtrace.trace(model, attention_maps=True) as t:
        model(x)
        model(x).pow(2).mean().backward()
    return t.result.save_html(tmp_path_factory.mktemp("page") / "trace.html", title="trace of the test model")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,800"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def opened(browser: Any, page: Path, width: int = 1280, height: int = 800) -> Any:
    browser.set_window_size(width, height)
    browser.get(page.as_uri())
    browser.get_log("browser")  # what an earlier page said is not this page's
    browser.refresh()
    return browser


def visible_modules(browser: Any) -> list[str]:
    rows = browser.find_elements(By.CSS_SELECTOR, "table.calls tbody tr")
    return [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows if r.is_displayed()]


def test_the_page_loads_without_console_errors_and_shows_every_call(browser: Any, page: Path) -> None:
    """Witness: the model built for the test (two forwards: mha, attend each) and the browser's own console."""
    opened(browser, page)
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert errors == []
    assert visible_modules(browser) == ["mha", "attend", "mha", "attend"]
    paths = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "table.calls tbody tr td:nth-child(3)")]
    assert paths == ["fallback", "sdpa", "fallback", "sdpa"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "trace-page-1280x800.png"))


def test_sorting_by_a_column(browser: Any, page: Path) -> None:
    """Witness: Python's ``sorted`` of the module names the model has."""
    opened(browser, page)
    header = browser.find_element(By.CSS_SELECTOR, "th[data-key=module] button")
    header.click()
    assert visible_modules(browser) == sorted(["mha", "attend", "mha", "attend"])
    header.click()
    assert visible_modules(browser) == sorted(["mha", "attend", "mha", "attend"], reverse=True)
    browser.find_element(By.CSS_SELECTOR, "th[data-key=index] button").click()
    indices = [r.get_attribute("data-index") for r in browser.find_elements(By.CSS_SELECTOR, "table.calls tbody tr")]
    assert indices == ["0", "1", "2", "3"]


def test_filtering_by_path_backend_and_module(browser: Any, page: Path) -> None:
    """Witness: the model built for the test: ``attend`` is the only SDPA caller, ``mha`` the only MHA; the
    backend filter's options against the backend cells the browser shows and PyTorch's ``SDPBackend`` names."""
    opened(browser, page)
    Select(browser.find_element(By.ID, "filter-path")).select_by_value("sdpa")
    assert visible_modules(browser) == ["attend", "attend"]
    assert browser.find_element(By.ID, "shown").text == "2 of 4 rows shown"
    Select(browser.find_element(By.ID, "filter-path")).select_by_value("")
    browser.find_element(By.ID, "filter-module").send_keys("mh")
    assert visible_modules(browser) == ["mha", "mha"]
    browser.find_element(By.ID, "filter-module").clear()
    backend = Select(browser.find_element(By.ID, "filter-backend"))
    cells = {c.get_attribute("textContent").strip()  # every row's, shown or filtered out
             for c in browser.find_elements(By.CSS_SELECTOR, "table.calls tbody tr td:nth-child(4)")}  # fmt: skip
    # the filter offers "all" and exactly the backends in the table's column, each an SDPBackend name (or none)
    assert cells and cells <= {*torch.nn.attention.SDPBackend.__members__, "none"}, cells
    assert sorted(o.get_attribute("value") for o in backend.options) == sorted({"", *cells})
    for option in [o.get_attribute("value") for o in backend.options if o.get_attribute("value")]:
        backend.select_by_value(option)
        rows = [r for r in browser.find_elements(By.CSS_SELECTOR, "table.calls tbody tr") if r.is_displayed()]
        assert rows and all(r.find_elements(By.TAG_NAME, "td")[3].text == option for r in rows)


def test_clicking_a_call_shows_its_map(browser: Any, page: Path) -> None:
    """Witness: the browser's own layout -- the heatmaps of call 1 are not displayed until its row is clicked."""
    opened(browser, page)
    maps = browser.find_elements(By.CSS_SELECTOR, "#call-1 svg.map")
    assert len(maps) >= 1 and not any(m.is_displayed() for m in maps)
    row = browser.find_element(By.CSS_SELECTOR, "tr[data-call=call-1]")
    row.find_elements(By.TAG_NAME, "td")[1].click()
    assert browser.find_element(By.ID, "call-1").get_attribute("open") is not None
    assert all(m.is_displayed() for m in browser.find_elements(By.CSS_SELECTOR, "#call-1 svg.map"))
    assert "selected" in row.get_attribute("class")
    browser.save_screenshot(str(ARTIFACTS / "trace-page-call-1.png"))


@pytest.mark.parametrize("width", [1280, 400])
def test_readable_on_a_wide_and_a_narrow_window(browser: Any, page: Path, width: int) -> None:
    """Witness: the browser's layout -- the page never scrolls sideways; wide tables scroll in their own box."""
    opened(browser, page, width=width)
    browser.find_element(By.CSS_SELECTOR, "tr[data-call=call-1] td:nth-child(2)").click()  # open a map as well
    overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0
    size = browser.execute_script("return parseFloat(getComputedStyle(document.querySelector('table.calls')).fontSize)")
    assert size >= 12
    browser.save_screenshot(str(ARTIFACTS / f"trace-page-{width}-wide.png"))


def test_the_routes_picture_text_is_readable_at_1280(browser: Any, tmp_path: Path) -> None:
    """Witness: the browser's layout -- the height Chromium gives the smallest text of the routes picture of the
    tiny LM (a picture thousands of points wide) on a 1280-px window, and the page's own sideways scroll."""
    from qkvtrace.analyses.demos import demo_tiny_lm
    from qkvtrace.analyses.grads import measure

    model, args = demo_tiny_lm()
    path = tmp_path / "grads.html"
    measure(model, args).save_html(path)
    opened(browser, path, width=1280)
    smallest = browser.execute_script(
        "const texts = [...document.querySelectorAll('.picture svg text')];"
        "return Math.min(...texts.map(t => t.getBoundingClientRect().height));"
    )
    assert smallest >= 11, smallest  # a 12-px line box; glyph boxes of 12-px text are about 13-14 px high
    overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0  # the picture scrolls in its own box, not the page
    browser.save_screenshot(str(ARTIFACTS / "grads-page-1280-wide.png"))
