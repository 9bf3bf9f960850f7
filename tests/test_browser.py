"""Chapter 1 in a real browser: JupyterLab + headless Debian Chromium (Playwright).

Opens chapters/01_memory.ipynb (a temporary copy), runs all cells, moves the
Memory Explorer's Ψ slider with the keyboard and checks that the chart redraws.
Screenshots go to artifacts/browser/ (ignored by git).

Without /usr/bin/chromium (or $ZEROLAB_CHROMIUM) the test is skipped — unless
CI=true, where it fails. Install it with ``apt-get install -y chromium`` (never
``playwright install``). Run: ``pytest -m browser tests/test_browser.py``.
"""
import json
import os
import shutil
import time

import pytest

from zerolab.book.widgets import format_params

from browser_util import (CHROMIUM, REPO, chromium, digest, jupyter_lab, run_all,
                          wait_all_cells_ran, wait_image_stable, wait_kernel_ready)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

NOTEBOOK = REPO / "chapters" / "01_memory.ipynb"
ARTIFACTS = REPO / "artifacts" / "browser"
CHART = ".widget-output img[src^='data:image/png']"   # PNG or the alt-text HTML <img>
PSI = ".zl-psi .noUi-handle[role=slider]"


@pytest.fixture(scope="module", autouse=True)
def need_chromium():
    missing = [what for what, ok in ((CHROMIUM, os.access(CHROMIUM, os.X_OK)),
                                     ("python playwright", _has_playwright())) if not ok]
    if missing:
        msg = (f"browser test needs {', '.join(missing)}: install with "
               f"`apt-get install -y chromium` and `pip install playwright` (never `playwright install`)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg + " [CI=true: failing instead of skipping]")
        pytest.skip(msg)


def _has_playwright():
    try:
        import playwright.sync_api  # noqa: F401
        return True
    except ImportError:
        return False


def test_memory_explorer_reacts_in_jupyterlab(tmp_path):
    from playwright.sync_api import expect
    t0 = time.monotonic()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "lab"
    (root / "chapters").mkdir(parents=True)
    shutil.copy(NOTEBOOK, root / "chapters" / NOTEBOOK.name)
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    n_visible = sum(c["cell_type"] == "code" and not c["metadata"].get("jupyter", {}).get("source_hidden")
                    for c in cells)

    with jupyter_lab(root) as url, chromium(tmp_path / "profile") as page:
        marks = {"server": time.monotonic() - t0}
        page.goto(f"{url}/lab/tree/chapters/{NOTEBOOK.name}")
        wait_kernel_ready(page)
        marks["kernel ready"] = time.monotonic() - t0
        run_all(page)
        wait_all_cells_ran(page, n_visible)
        marks["ran all"] = time.monotonic() - t0
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                              has_text="Traceback")
        assert errors.count() == 0, errors.first.inner_text()[:2000]

        explorer = page.locator(".widget-vbox", has=page.locator(PSI)).first
        explorer.scroll_into_view_if_needed()
        before = wait_image_stable(page, CHART)
        explorer.screenshot(path=str(ARTIFACTS / "01_explorer_before.png"))
        handle = page.locator(PSI).first
        readout = page.locator(".zl-psi .widget-readout").first
        text0 = readout.inner_text()
        psi0 = float(text0)

        handle.focus()
        for _ in range(3):                       # 3 steps of 0.01 decades: Ψ x 1.07
            handle.press("ArrowRight")
        expect(readout).not_to_have_text(text0, timeout=5_000)
        psi = float(readout.inner_text())
        assert psi > psi0, (psi0, psi)
        # every key press is a redraw in the kernel: wait until the caption under the
        # chart names the slider's final Ψ, then until the image settles
        caption = page.locator(".widget-output", has=page.locator("img[src^='data:image/png']")).first
        expect(caption).to_contain_text(f"Ψ = {format_params(psi)} parameters, N = 64.", timeout=20_000)
        after = wait_image_stable(page, CHART, differs_from=before)
        marks["redrawn"] = time.monotonic() - t0
        explorer.screenshot(path=str(ARTIFACTS / "01_explorer_after.png"))
        page.screenshot(path=str(ARTIFACTS / "01_page.png"))

        assert digest(after) != digest(before)
        assert after.startswith("data:image/png")
        assert "With 80 GB per GPU" in caption.inner_text()
    took = time.monotonic() - t0
    print("seconds since start:", {k: round(v, 1) for k, v in marks.items()}, "total", round(took, 1))
    # ~20 s on an idle 2-core machine. The budget is about this test's own cost, so it is
    # only enforced when the machine is not busy with other work (load below the core count).
    if os.getloadavg()[0] < (os.cpu_count() or 1):
        assert took < 60, f"browser scenario took {took:.1f} s: {marks}"
