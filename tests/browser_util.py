"""Drive JupyterLab in a real browser: a throwaway server on loopback and Debian's
Chromium through Python Playwright (never ``playwright install``).

Used by tests/test_browser.py (chapter 1's Memory Explorer). The pitfalls handled
here were measured on this machine (docs/MEASUREMENTS.md): the news popup, Run All
clicked before the kernel exists, intermediate frames of a redrawn chart.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = os.environ.get("ZEROLAB_CHROMIUM", "/usr/bin/chromium")   # Debian's; override for other systems
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parents[1]

# user settings written before the server starts: {plugin path: settings}
LAB_SETTINGS = {
    # no "check for news" popup over the notebook
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    # every cell in the DOM (no virtual scrolling), so we can find and wait on any of them
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    # never write the (temporary copy of the) notebook back
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def jupyter_lab(root: Path, timeout: float = 30.0):
    """Start ``jupyter lab`` serving ``root`` on 127.0.0.1 without a token; yield its URL."""
    port = free_port()
    settings = root / ".lab-settings"
    for name, value in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "JUPYTER_RUNTIME_DIR": str(root / ".runtime"), "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--allow-root", "--IdentityProvider.token=", "--ServerApp.password=",
           f"--ServerApp.root_dir={root}", "--ServerApp.disable_check_xsrf=True",
           # server extensions the test does not need (language server, terminals): faster start
           "--ServerApp.jpserver_extensions=jupyter_lsp=False",
           "--ServerApp.jpserver_extensions=jupyter_server_terminals=False",
           f"--LabApp.workspaces_dir={root / '.workspaces'}", f"--LabApp.user_settings_dir={settings}"]
    log = open(root / "jupyter.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{(root / 'jupyter.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"jupyter lab did not answer on {url} within {timeout} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextmanager
def chromium(user_data_dir: Path, viewport=(1400, 1000)):
    """A headless Debian Chromium page (fresh profile) driven by Playwright."""
    from playwright.sync_api import sync_playwright
    shutil.rmtree(user_data_dir, ignore_errors=True)
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(user_data_dir), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": viewport[0], "height": viewport[1]})
        try:
            yield ctx.pages[0] if ctx.pages else ctx.new_page()
        finally:
            ctx.close()


def wait_kernel_ready(page, timeout_ms=60_000):
    """The kernel exists and is idle (the status bar says Idle *before* it exists)."""
    page.wait_for_selector(".jp-DebuggerBugButton[aria-disabled='false']", timeout=timeout_ms)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout_ms)


def run_all(page):
    page.locator(".lm-MenuBar-item", has_text="Run").first.click()
    page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()


def wait_all_cells_ran(page, n_visible: int, settle_ms=1000, timeout_ms=90_000):
    """Every code cell with a visible prompt shows an execution count, none is queued or
    running ([*]), and the kernel has stayed idle for ``settle_ms`` (hidden-input cells
    show no prompt, and the kernel flickers idle between queued cells)."""
    page.evaluate("() => { window.__zlIdle = null; }")
    page.wait_for_function(
        """([n, ms]) => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
                .map(p => p.textContent.trim()).filter(p => p !== '');
            const idle = document.querySelector(".jp-Notebook-ExecutionIndicator[data-status='idle']");
            const done = prompts.length === n && prompts.every(p => /^\\[\\d+\\]:$/.test(p)) && idle;
            if (!done) { window.__zlIdle = null; return false; }
            window.__zlIdle = window.__zlIdle || performance.now();
            return performance.now() - window.__zlIdle >= ms;
        }""", arg=[n_visible, settle_ms], polling=100, timeout=timeout_ms)


def image_src(page, selector: str) -> str:
    return page.locator(selector).first.get_attribute("src") or ""


def digest(src: str) -> str:
    return hashlib.sha256(src.encode()).hexdigest()[:16]


_STABLE_JS = """([sel, ms, old]) => {
    const img = document.querySelector(sel);
    if (!img || !img.src || !img.complete) return false;
    const w = window.__zlStable || (window.__zlStable = {});
    if (w.src !== img.src) { w.src = img.src; w.t = performance.now(); return false; }
    return img.src !== old && performance.now() - w.t >= ms;
}"""


def wait_image_stable(page, selector: str, stable_ms=600, timeout_ms=20_000, differs_from=None) -> str:
    """Wait until the image at ``selector`` has not changed for ``stable_ms`` (a redraw
    shows intermediate frames) and differs from ``differs_from``; return its src."""
    page.evaluate("() => { window.__zlStable = {}; }")
    page.wait_for_function(_STABLE_JS, arg=[selector, stable_ms, differs_from],
                           polling=100, timeout=timeout_ms)
    return image_src(page, selector)
