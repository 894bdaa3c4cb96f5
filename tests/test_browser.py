"""Real-browser test: `streamlit run app.py` driven by Playwright in Debian's Chromium.

Visits every page, fails on any exception or error alert shown, moves a slider, downloads the
configuration JSON and validates it with pace_core.config, and saves screenshots under
artifacts/screenshots/. The server is started as the README starts it (app_support.served_app); neither the
browser nor the server reaches outside the host. Needs /usr/bin/chromium (Debian's package; never a
downloaded browser).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path

import pytest
from app_support import EMBEDDED_DIR, REPO_ROOT, app_model_param, outbound_attempts, served_app

from pace_core.accounting import capacity
from pace_core.config import get_config
from pace_core.export import config_from_dict, config_from_json, config_to_json
from pace_core.shapes import load_shape

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = REPO_ROOT / "artifacts" / "screenshots"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGE_TIMEOUT_MS = 300_000        # live analyses on a loaded 2-core CPU: calibration, drift, generation
PAGES = ["", "compare", "state_heatmaps", "head_ranking", "drift", "memory", "generations", "benchmarks", "export"]

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at "
                                "/usr/bin/chromium (apt-get install chromium; `make test` does it)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The app served as the README starts it; yields (base url, URL model params, outbound attempts log)."""
    params = app_model_param(tmp_path_factory.mktemp("model"))
    with served_app(tmp_path_factory.mktemp("server")) as (base, _, outbound):
        yield base, params, outbound


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1440, "height": 2000}, accept_downloads=True)
        page = context.new_page()
        page.outside_requests = []  # every request to another host than the app's (must stay empty)
        page.on("request", lambda r: None if urllib.parse.urlsplit(r.url).scheme in ("data", "blob")
                or urllib.parse.urlsplit(r.url).hostname == "127.0.0.1" else page.outside_requests.append(r.url))
        yield page
        context.close()
        browser.close()


def _url(base: str, path: str, params: dict[str, str]) -> str:
    query = urllib.parse.urlencode(params)
    return f"{base}/{path}" + (f"?{query}" if query else "")


def _settle(page) -> None:
    """Wait until the script run has finished (the app root says notRunning) and the page has a title."""
    page.wait_for_selector('[data-testid="stApp"][data-test-script-state="notRunning"]', timeout=PAGE_TIMEOUT_MS)
    page.wait_for_selector('[data-testid="stMain"] h1', timeout=PAGE_TIMEOUT_MS)
    page.wait_for_timeout(500)


def _assert_no_error(page, name: str) -> None:
    exceptions = page.locator('[data-testid="stException"]')
    errors = page.locator('[data-testid="stAlertContentError"]')
    assert exceptions.count() == 0, f"{name}: exception shown: {exceptions.first.inner_text()}"
    assert errors.count() == 0, f"{name}: error shown: {errors.first.inner_text()}"


def test_every_page_renders_without_error(server, page):
    base, params, _ = server
    SHOTS.mkdir(parents=True, exist_ok=True)
    for path in PAGES:
        started = time.monotonic()
        page.goto(_url(base, path, params))
        _settle(page)
        print(f"{path or 'overview'}: {time.monotonic() - started:.1f} s")
        _assert_no_error(page, path or "overview")
        page.screenshot(path=str(SHOTS / f"{path or 'overview'}.png"), full_page=True)
    assert page.outside_requests == []  # offline: no font, icon or statistics request leaves the host
    assert page.locator('[data-testid="stAppDeployButton"]').count() == 0  # toolbar minimal


def test_slider_moves_and_json_download_validates(server, page):
    base, params, _ = server
    page.goto(_url(base, "export", dict(params, preset="pace-4", bits="4")))
    _settle(page)
    code = page.locator('[data-testid="stCode"]').first
    assert '"num_bits": 4' in code.inner_text()
    slider = page.get_by_role("slider", name="State bits (bits/value)")
    slider.focus()
    slider.press("ArrowLeft")                      # 4 -> 3 bits
    page.wait_for_function("() => location.search.includes('bits=3')", timeout=PAGE_TIMEOUT_MS)
    page.wait_for_function("""() => [...document.querySelectorAll('[data-testid="stCode"]')]
                                     .some(e => e.innerText.includes('"num_bits": 3'))""", timeout=PAGE_TIMEOUT_MS)
    _settle(page)
    with page.expect_download() as info:
        page.get_by_role("button", name="Download custom.json").click()
    download = info.value
    assert download.suggested_filename == "custom.json"
    cfg = config_from_json(Path(download.path()).read_text(encoding="utf-8"))
    assert cfg.bits == 3 and cfg.group_axis == "key" and cfg.decode_period == 8
    _assert_no_error(page, "export")
    page.screenshot(path=str(SHOTS / "export_after_slider.png"), full_page=True)


def _main_text(page) -> str:
    return page.locator('[data-testid="stMain"]').inner_text()


def test_shipped_results_and_the_new_parts(server, page):
    """A fresh clone's shipped results fill the measured sections; the planner's numbers are
    pace_core.accounting's; Generations shows stored continuations side by side; Benchmarks leads with
    its headline."""
    base, params, _ = server
    page.goto(_url(base, "", dict(params, preset="pace-4")))
    _settle(page)
    text = _main_text(page)
    if not params:  # the embedded model: its results are shipped in data/results/pace-tiny-qwen35
        assert "No stored perplexity run" not in text and "No stored claims report" not in text
        assert "Source: stored result of python -m pace_core " in text  # the stored run's provenance is shown

    page.goto(_url(base, "memory", dict(params, preset="pace-4")))
    _settle(page)
    shape = load_shape(params.get("model") or str(EMBEDDED_DIR))
    cap = capacity(get_config("pace-4"), shape, int(141e9), weight_bits=16, context=8192)
    metric = page.locator('[data-testid="stMetric"]').filter(has_text="max sequences, chosen: pace-4")
    assert metric.locator('[data-testid="stMetricValue"]').inner_text() == f"{cap.sequences:,}"
    _assert_no_error(page, "memory")

    if not params:
        page.goto(_url(base, "generations", params))
        _settle(page)
        page.get_by_text("stored:", exact=False).first.click()
        _settle(page)
        columns = page.locator('[data-testid="stColumn"]').filter(has=page.locator('[data-testid="stHtml"]'))
        columns.nth(1).wait_for(timeout=PAGE_TIMEOUT_MS)  # the click's rerun may begin after _settle saw a run end
        assert columns.count() >= 2
        assert "degenerate continuation" in _main_text(page)
        _assert_no_error(page, "generations")

    page.goto(_url(base, "benchmarks", params))
    _settle(page)
    text = _main_text(page)
    assert "Decode step of 24 GDN layers" in text and "Each cell: time per token" in text
    page.screenshot(path=str(SHOTS / "benchmarks_headline.png"), full_page=True)


SUCCESS_TEXT = '[data-testid="stAlertContentSuccess"] [data-testid="stMarkdownContainer"]'
"""A success alert's text (without its icon's name)."""


def _success(page) -> str:
    alerts = page.locator(SUCCESS_TEXT)
    return alerts.first.inner_text() if alerts.count() else ""


def test_compare_recommends_the_frontiers_best_under_a_budget_and_exports_it(server, page):
    """The Compare page's recommendation for budgets between the frontier's points is the frontier point of the most
    bits within the budget, the frontier computed here from the stored points (sorted by bits, each point whose KL
    is below every KL of fewer bits); its export button downloads that configuration."""
    base, params, _ = server
    page.goto(_url(base, "compare", params))
    _settle(page)
    if params:  # a random checkpoint made for this test: nothing stored, the page names the command
        assert "python -m pace_core compare" in _main_text(page)
        return
    from pace_core.results import list_results

    [result] = [r for r in list_results(str(EMBEDDED_DIR), "compare").results if not r.stale][:1]
    points = sorted(result.data["points"], key=lambda p: (p["resident_bits"], p["kl"]))
    frontier = []
    for p in points:
        if all(p["kl"] < q["kl"] for q in frontier):
            frontier.append(p)
    assert len(frontier) >= 3
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    budget_box = page.get_by_role("spinbutton", name="Bits per state value", exact=True)
    pairs = [(here, above, round((here["resident_bits"] + above["resident_bits"]) / 2, 3))
             for here, above in zip(frontier, frontier[1:])]
    pairs = [
        (here, budget) for here, above, budget in pairs if here["resident_bits"] <= budget < above["resident_bits"]
    ]
    assert len(pairs) >= 2
    for here, budget in pairs[:4]:  # a budget between two frontier points: the one of fewer bits is the best
        want = f"{here['config']}: {here['resident_bits']:.2f} bits per state value, KL {here['kl']:.1e} to fp32"
        budget_box.fill(f"{budget:.3f}")
        budget_box.press("Enter")
        try:  # the rerun after the new budget: until its recommendation is shown (else the assertion names it)
            page.wait_for_function("""([selector, want]) => { const a = document.querySelector(selector);
                                                              return a && a.innerText.startsWith(want); }""",
                                   arg=[SUCCESS_TEXT, want], timeout=60_000)
        except PlaywrightTimeout:
            pass
        _settle(page)
        assert _success(page).startswith(want), (budget, _success(page))
        _assert_no_error(page, "compare")
    with page.expect_download() as info:
        page.get_by_role("button", name=f"Export {here['config']}.json").click()
    cfg = config_from_json(Path(info.value.path()).read_text(encoding="utf-8"))
    assert cfg == config_from_dict(here["configuration"])  # the configuration measured, its calibration included
    page.screenshot(path=str(SHOTS / "compare_budget.png"), full_page=True)


def test_a_link_and_a_file_show_their_values_as_text(server, page):
    """A shared link whose values are Markdown (a link, an image on another host, HTML, a web address) shows them as
    text in the app's warnings: no link, no image, no request to another host (before: the warning held a live link
    and the browser fetched the image). A pasted file whose configuration name is such Markdown is refused, its name
    shown as text."""
    base, params, _ = server
    image, link, html = ("![i](http://evil.example/track.png)", "[Fix this](http://evil.example/phish)",
                         "<img src=http://evil.example/x.png>")
    key = "![k](http://evil.example/key.png)"
    sent = len(page.outside_requests)
    query = dict(params, preset=image, bits=link, weights=html, device="www.evil.example", **{key: "1"})
    page.goto(_url(base, "", query))
    _settle(page)
    warnings = page.locator('[data-testid="stAlertContentWarning"]')
    shown = " ".join(warnings.nth(i).inner_text() for i in range(warnings.count())).replace("\u2060", "")
    for value in (image, link, html, "www.evil.example", key):
        assert value in shown, value
    app = page.locator('[data-testid="stApp"]')
    assert not [h for h in (a.get_attribute("href") for a in app.locator("a").all()) if h and "evil" in h]
    assert app.locator('img[src*="evil"]').count() == 0

    page.goto(_url(base, "export", params))
    _settle(page)
    doc = json.loads(config_to_json(get_config("rtn-int5").replace(name=image)))
    box = page.get_by_label("…or paste JSON here")
    box.fill(json.dumps(doc))
    box.press("Control+Enter")
    page.wait_for_selector('[data-testid="stAlertContentError"]', timeout=PAGE_TIMEOUT_MS)
    _settle(page)
    error = page.locator('[data-testid="stAlertContentError"]').first.inner_text().replace("\u2060", "")
    assert f"pace.name={image!r} is not allowed" in error
    assert not [h for h in (a.get_attribute("href") for a in app.locator("a").all()) if h and "evil" in h]
    page.wait_for_timeout(1000)
    assert page.outside_requests[sent:] == []


def test_the_server_reached_nothing_outside(server, page):
    """After every page above (model loads, live analyses, downloads): no outbound attempt by the server."""
    assert outbound_attempts(server[2]) == []
