"""The report in a real headless Chromium (report_browser.py, over CDP): a sessions run and a
two-run comparison render with no console error or exception, every plot decodes, the
screenshot is not blank, and the page's visible text names what ran.

Needs a Chromium binary (`make browser` installs Debian's); skips, saying so, without one."""

from __future__ import annotations

import io

import pytest
from typer.testing import CliRunner

from agentserve.workload.report_browser import check_page, find_chromium

from .report_runs import MODEL, TRACE, URL, report_app, write_run

pytestmark = pytest.mark.skipif(find_chromium() is None,
                                reason="no Chromium on PATH: `make browser` installs it (Debian, apt-get, root)")


def _not_blank(png: bytes, size: tuple[int, int]) -> None:
    from PIL import Image

    im = Image.open(io.BytesIO(png)).convert("RGB")
    assert im.size == size and size[1] > 1000  # the full page, not the viewport
    colours = im.getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 50  # text, tables and plots, not one flat colour
    lo, hi = im.convert("L").getextrema()
    assert hi - lo > 200


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    base = tmp_path_factory.mktemp("browser")
    a, b = write_run(base / "cached"), write_run(base / "uncached", slow=2.0, cache=False)
    res = CliRunner().invoke(report_app(), ["report", str(a), str(b)])
    assert res.exit_code == 0, res.output
    return a / "report.html", a / "compare.html"


def test_sessions_run_renders_in_chromium(pages) -> None:
    seen = check_page(pages[0])
    assert seen.errors == []
    assert seen.images == 6 and seen.broken_images == 0
    _not_blank(seen.png, seen.size)
    for text in (f"agentserve bench: {MODEL} at {URL}", TRACE, "UTC", "agentserve bench --url", "CPUs",
                 "Sessions over time", "Cached vs computed tokens per turn", "HTTP 500: engine fell over"):
        assert text in seen.text, text


def test_comparison_renders_in_chromium(pages) -> None:
    seen = check_page(pages[1])
    assert seen.errors == []
    assert seen.images >= 6 and seen.broken_images == 0
    _not_blank(seen.png, seen.size)
    for text in ("agentserve report: cached vs uncached", "Differences", "uncached - cached", "(+100%)", URL):
        assert text in seen.text, text


def test_a_broken_page_is_caught(tmp_path) -> None:
    """The checks can fail: a script error and an undecodable image are reported."""
    page = tmp_path / "broken.html"
    page.write_text("<!doctype html><html><body><p>x</p><img src='data:image/png;base64,AAAA'>"
                    "<script>console.error('boom'); undefinedFunction();</script></body></html>")
    seen = check_page(page)
    assert seen.broken_images == 1
    assert any("boom" in e for e in seen.errors) and any("undefinedFunction" in e for e in seen.errors)
