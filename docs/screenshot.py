"""Draw docs/images/trace-page.png: the page of `qkvtrace trace demo:tiny-lm --show-maps --backward --html`.

Run ``python docs/screenshot.py`` from the repository root with qkvtrace
installed, Selenium (``pip install selenium``) and Chromium with its driver
(Debian: ``apt-get install chromium chromium-driver``). The page is written
by the command line, opened from ``file://`` in headless Chromium at 1280
pixels wide, with the first call's details open and its row selected.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

OUT = Path(__file__).resolve().parent / "images" / "trace-page.png"


def main() -> None:
    chromium, driver_path = shutil.which("chromium") or shutil.which("google-chrome"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        sys.exit("needs Chromium and ChromeDriver (Debian: apt-get install chromium chromium-driver)")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "trace.html"
        subprocess.run([sys.executable, "-m", "qkvtrace", "trace", "demo:tiny-lm", "--show-maps", "--backward",
                        "--html", str(page)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                     "--disable-background-networking", "--window-size=1280,1700"):  # fmt: skip
            options.add_argument(flag)
        browser = webdriver.Chrome(service=Service(driver_path), options=options)
        try:
            browser.get(page.as_uri())
            browser.execute_script(
                "document.getElementById('call-0').open = true;"
                "document.querySelector('tr[data-call=call-0]').classList.add('selected');"
            )
            OUT.parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(OUT))
        finally:
            browser.quit()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
