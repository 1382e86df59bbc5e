"""The pages in a real headless Chromium against a real uvicorn server: every page loads, its charts
drew (SVG shapes with a non-empty size on screen), and the browser console has no errors.

Uses Debian's Chromium at /usr/bin/chromium through Playwright (no browser download). Where it is
missing the test is skipped with the reason — except in CI (``CI`` set), where that is a failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from test_pages import INFEASIBLE_PLAN, PIPELINE_PLAN, SMALL_PLAN, measured_profile

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.slow


def _browser_or_skip() -> None:
    if not CHROMIUM.exists():
        why = f"{CHROMIUM} is missing (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(why + " — CI must run the browser test (.ci/run installs Chromium)")
        pytest.skip(why)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"playwright is not installed: {exc}")
        pytest.skip(f"playwright is not installed: {exc}")


def test_pages_in_a_real_browser(tmp_path: Path, live_server) -> None:  # noqa: ANN001
    _browser_or_skip()
    from playwright.sync_api import sync_playwright

    with live_server(f"sqlite:///{tmp_path / 'x.db'}") as server, httpx.Client(base_url=server.url, timeout=60) as api:
        small = api.post("/v1/plans", json=SMALL_PLAN).json()
        infeasible = api.post("/v1/plans", json=INFEASIBLE_PLAN).json()
        pipeline = api.post("/v1/plans", json=PIPELINE_PLAN).json()
        assert small["status"] == "ok" and infeasible["status"] == "infeasible" and pipeline["plan"]["layout"]["pp"] > 1
        run = api.post("/v1/runs", json={"plan_id": small["id"], "report": {
            "layout": small["plan"]["layout"], "device": "cpu", "num_ranks": small["num_gpus"], "warmup_steps": 1,
            "steps": [{"step": 0, "loss": 10.0, "time_s": 1.0}], "median_step_time_s": 1.0, "tokens_per_s": 1000,
            "peak_memory_bytes_per_rank": [1]}})
        assert run.status_code == 201, run.text
        measured = measured_profile(api)
        reference_id = small["profile_id"]

        # (url, least number of drawn chart shapes expected)
        pages = [("/", 0), (f"/profiles/{reference_id}", 20), (f"/profiles/{measured['id']}", 40), ("/plans", 0),
                 (f"/plans/{small['id']}", 10), (f"/plans/{pipeline['id']}", 100), (f"/plans/{infeasible['id']}", 0),
                 ("/runs", 3), (f"/runs/{run.json()['id']}", 3)]
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"], headless=True)
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 900})
                errors: list[str] = []
                page.on("console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else None)
                page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
                for url, least in pages:
                    errors.clear()
                    response = page.goto(server.url + url, wait_until="load")
                    assert response is not None and response.status == 200, url
                    assert page.locator("nav a").count() >= 4, url
                    if least:
                        shapes = page.locator("svg.chart path, svg.chart rect, svg.chart circle")
                        assert shapes.count() >= least, (url, shapes.count())
                        sizes = page.evaluate(
                            "() => [...document.querySelectorAll('svg.chart')].map(s => {"
                            " const r = s.getBoundingClientRect(); return [r.width, r.height]; })")
                        assert sizes and all(w > 50 and h > 50 for w, h in sizes), (url, sizes)
                        drawn = page.evaluate(
                            "() => [...document.querySelectorAll('svg.chart circle, svg.chart rect')]"
                            ".filter(e => { const r = e.getBoundingClientRect(); "
                            "return r.width > 0 && r.height > 0; }).length"
                        )
                        assert drawn >= 2, (url, drawn)  # the background and at least one mark
                    if url == f"/plans/{infeasible['id']}":
                        assert page.get_by_text("No layout: why").is_visible()
                    if url == f"/plans/{pipeline['id']}":
                        box = page.locator("svg.timeline").bounding_box()
                        assert box and box["width"] > 500 and box["height"] > 100
                    assert not errors, (url, errors)
                # /docs is FastAPI's Swagger UI, whose JS and CSS come from a CDN this machine cannot reach:
                # check only that the HTML is served, not the console.
                response = page.goto(server.url + "/docs", wait_until="domcontentloaded")
                assert response is not None and response.status == 200
            finally:
                browser.close()
