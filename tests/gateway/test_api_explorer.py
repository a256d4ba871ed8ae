"""The API explorer (`/schema/swagger`) is served whole by the gateway: every script, style and
icon it loads is same-origin, and it renders in Chromium with every other host unreachable."""

from __future__ import annotations

import os
import re
import shutil

import httpx
import pytest
from playwright.sync_api import Route, sync_playwright

from bench.usage_workload import CHROMIUM_ARGS
from loramux.gateway.server import RunningServer

ASSET_URL = re.compile(r"""<(?:script|link)[^>]*?\s(?:src|href)=["']([^"']+)["']""")


def asset_urls(html: str) -> list[str]:
    return ASSET_URL.findall(html)


def test_the_explorers_assets_are_same_origin_and_load(gateway: RunningServer) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        page = client.get("/schema/swagger")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        urls = asset_urls(page.text)
        assert len(urls) == 4, urls
        for url in urls:
            assert url.startswith("/") and not url.startswith("//"), url
            asset = client.get(url)
            assert asset.status_code == 200, url
            assert len(asset.content) > 1000
        assert "cdn" not in page.text and "https://" not in page.text.split("<body>")[0]
        assert client.get("/schema-assets/swagger-editor-bundle.js").status_code == 404
        assert client.get("/schema-assets/..%2Fstatic%2Fswagger-ui.js").status_code == 404


@pytest.mark.skipif(
    shutil.which("chromium") is None and not os.environ.get("CI"),
    reason="Chromium is not installed (apt-get install chromium)",
)
def test_the_explorer_renders_with_the_network_off(gateway: RunningServer) -> None:
    elsewhere: list[str] = []

    def only_the_gateway(route: Route) -> None:
        if route.request.url.startswith(gateway.url):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort("internetdisconnected")

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page()
            page.route("**/*", only_the_gateway)
            page.goto(f"{gateway.url}/schema/swagger")
            page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
            assert "loramux" in page.inner_text(".swagger-ui .info .title")
            assert page.locator(".opblock-tag").count() > 3
        finally:
            browser.close()
    assert elsewhere == []
