"""The dashboard page in a real headless browser (Debian's chromium through selenium) against an
in-process server on the session model: the key (typed into the page's form, never taken from its
address), the block map, live updates, replay, no console errors.

KVSERVE_UPDATE_SCREENSHOT=1 also writes the screenshot taken under load to docs/dashboard.png.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from test_kv_state import HEADERS, KEY, PREFIX, start_load, state
from test_server_hardening import serving

from kvserve.server.app import build_app

webdriver = pytest.importorskip("selenium.webdriver")
DOCS_PNG = Path(__file__).resolve().parent.parent / "docs" / "dashboard.png"


@pytest.fixture(scope="module")
def served(llm, tmp_path_factory):
    record = tmp_path_factory.mktemp("dashboard") / "state.jsonl"
    app = build_app(llm.engine, api_key=KEY, record=str(record))
    with serving(app) as url:
        yield SimpleNamespace(url=url, record=record)


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    driver_path, chromium = shutil.which("chromedriver"), shutil.which("chromium")
    if driver_path is None or chromium is None:
        pytest.fail("chromium is not installed: `make install` installs it "
                    "(apt-get install -y chromium chromium-driver)")
    opts = Options()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1400"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    yield driver
    driver.quit()


def wait_for(fn, timeout: float = 30, what: str = "the page"):
    """fn()'s first truthy value, polled."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def map_classes(driver) -> list[str]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#blockmap .cell')).map(c => c.className)")


def errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_page_shows_the_pool_live_with_the_key(served, browser, tmp_path):
    browser.get(f"{served.url}/dashboard?key={KEY}")         # an old bookmark: the key in the address
    login = browser.find_element("id", "login")
    wait_for(login.is_displayed, what="the key form")
    assert "key=" not in browser.current_url                 # dropped from the address bar, and not used
    assert "not used" in browser.find_element("id", "login-error").text
    assert browser.execute_script("return sessionStorage.getItem('kvserve.apiKey')") is None
    browser.find_element("id", "login-key").send_keys(KEY + "\n")
    total = len(state(served.url)["pool"]["state"])
    wait_for(lambda: len(map_classes(browser)) == total, what="one cell per block")
    assert browser.execute_script("return sessionStorage.getItem('kvserve.apiKey')") == KEY
    browser.get_log("browser")  # the 401 before the key was given is expected
    wait_for(lambda: "live" in browser.find_element("id", "status").text, what="the live stream")
    before = map_classes(browser)
    threads = start_load(served.url, [PREFIX + f"Dashboard {i}:" for i in range(3)], 80, n=2)   # long enough for several snapshots
    seen = set()

    def busy():
        classes = map_classes(browser)
        seen.add(tuple(classes))
        return len(seen) >= 5 and any("shared" in c for c in classes) and rows(browser) >= 4
    wait_for(busy, what="the map to change under load")
    assert len(map_classes(browser)) == total and map_classes(browser) != before
    wait_for(lambda: hover_shared_block(browser), what="a hovered shared block to name its holders")
    shot = tmp_path / "dashboard.png"
    browser.save_screenshot(str(shot))
    if os.environ.get("KVSERVE_UPDATE_SCREENSHOT"):
        shutil.copyfile(shot, DOCS_PNG)
    for t in threads:
        t.join()
    wait_for(lambda: rows(browser) == 0, what="the requests to end")
    assert not any("used" in c or "shared" in c for c in map_classes(browser))
    assert errors(browser) == []


def rows(driver) -> int:
    return driver.execute_script("return document.querySelectorAll('#requests tbody tr').length")


def hover_shared_block(driver) -> bool:
    """Hovering a shared block names its holders and hash and marks their rows (False while no shared
    block is on the map or it re-rendered under the pointer: the caller polls until one holds)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver import ActionChains
    try:
        cells = [c for c in driver.find_elements("css selector", "#blockmap .cell")
                 if "shared" in c.get_attribute("class")]
        if not cells:
            return False
        ActionChains(driver).move_to_element(cells[0]).perform()
        info = driver.find_element("id", "block-info").text
    except StaleElementReferenceException:
        return False
    marked = driver.execute_script("return document.querySelectorAll('#requests tr.hl').length")
    return "shared" in info and "hash" in info and "held by cmpl-" in info and marked >= 2


def test_without_a_key_the_page_asks_for_one(served, browser):
    browser.get(f"{served.url}/dashboard")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    login = browser.find_element("id", "login")
    wait_for(login.is_displayed, what="the key form")
    browser.find_element("id", "login-key").send_keys(KEY + "\n")
    wait_for(lambda: not login.is_displayed() and map_classes(browser), what="the map after the key")
    browser.get_log("browser")  # the 401 before the key was given is expected


def test_the_page_replays_a_recording(served, browser):
    lines = served.record.read_text().splitlines()
    assert len(lines) >= 3
    browser.get(f"{served.url}/dashboard")
    browser.find_element("id", "replay-file").send_keys(str(served.record))
    wait_for(lambda: browser.find_element("id", "replay").is_displayed(), what="the replay bar")
    slider = browser.find_element("id", "replay-slider")
    assert slider.get_attribute("max") == str(len(lines) - 1)
    assert browser.find_element("id", "replay-pos").text.startswith(f"1 / {len(lines)}")
    browser.find_element("id", "replay-next").click()
    assert browser.find_element("id", "replay-pos").text.startswith(f"2 / {len(lines)}")
    busiest = max(range(len(lines)), key=lambda i: lines[i].count('"running"'))
    browser.execute_script("showFrame(arguments[0])", busiest)
    assert rows(browser) > 0 and any("used" in c or "shared" in c for c in map_classes(browser))
    assert "replay" in browser.find_element("id", "status").text
    assert errors(browser) == []
    assert httpx.get(f"{served.url}/v1/kv/state", headers=HEADERS).status_code == 200
