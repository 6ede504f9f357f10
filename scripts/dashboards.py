"""Look at fleetwise's MLflow dashboards the way a person does: headless Chromium on the UI that
`fleetwise ui` serves, checks on the rendered text, and screenshots.

    python scripts/dashboards.py [--store DIR] [--out DIR] [--train]

--train first runs a small sweep in DIR (`fleetwise train -m` over two strategies: a parent run
with two children, each a job with its metrics, tags, dataset and model). Then, for the store in
DIR (./mlflow.db), it starts `fleetwise ui`, opens the experiment's run list, the newest job's
metric charts, and the sweep parent, and checks what is on screen:

- the run list shows the job's run, its dataset, and its fleetwise.recipe / fleetwise.strategy tags
  (as columns of the run list);
- the run's "Model metrics" page has charts titled train/loss, perf/tokens_per_s,
  memory/peak_bytes_max and memory/predicted_bytes;
- the sweep parent lists its children.

Screenshots go to --out (README: scripts/screenshots/). Exit 0 when every check passes, 1 otherwise.
Chromium: `apt-get install chromium` (Debian/Ubuntu); the browser is driven over the DevTools
protocol (websocket-client).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from fleetwise.rundir import Metric

SWEEP = [
    "recipe=gpt/tiny",
    "train.steps=12",
    "hardware.devices_per_node=2",
    "strategy=dp,sharding",
]
CHARTS = (Metric.LOSS, Metric.TOKENS_PER_S, Metric.PEAK_BYTES_MAX, Metric.PREDICTED_BYTES)
WIDTH = 1400
SEARCH = 'input[placeholder*="Search metric"]'  # the run page's metric search box


def chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, method: str = "GET", timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=timeout) as r:
        return r.read()


def wait_for(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _get(url, timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise RuntimeError(f"{url} did not answer within {timeout:.0f} s") from None
            time.sleep(0.3)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Browser:
    """One headless Chromium page driven over the DevTools protocol."""

    def __init__(self, binary: str, height: int = 1000) -> None:
        import websocket

        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="fleetwise-chromium-")
        args = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        args += ["--no-first-run", f"--user-data-dir={self.profile}", f"--remote-debugging-port={self.port}"]
        args += [f"--window-size={WIDTH},{height}", "about:blank"]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        wait_for(f"http://127.0.0.1:{self.port}/json/version", 60, self.proc)
        pages = json.loads(_get(f"http://127.0.0.1:{self.port}/json/list"))
        page = next(p for p in pages if p.get("type") == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def size(self, height: int) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=WIDTH,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        result = self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''")
        return result.get("result", {}).get("value", "")

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_text(self, needles: list[str], timeout: float = 90.0) -> str:
        """The page's text once every needle is on it (or whatever is there at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if all(n in text for n in needles) or time.monotonic() > deadline:
                return text
            time.sleep(0.5)

    def wait_js(self, expression: str, timeout: float = 90.0) -> bool:
        """Whether `expression` came true on the page within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.3)
        return True

    def screenshot(self, path: Path, height: int) -> Path:
        shot = self.call(
            "Page.captureScreenshot",
            format="png",
            clip={"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": 1},
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def shrink(self, path: Path, width: int = 1000) -> None:
        """README-sized: scaled to `width`, palette PNG (~100 KB)."""
        from PIL import Image

        with Image.open(path) as im:
            small = im.convert("RGB").resize((width, round(im.height * width / im.width)), Image.LANCZOS)
        small.quantize(colors=128).save(path, optimize=True)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        _stop(self.proc)
        shutil.rmtree(self.profile, ignore_errors=True)


def dismiss_overlays(browser: Browser) -> None:
    """MLflow 3's first-visit popovers and its assistant side panel cover the page: close them."""
    browser.evaluate(
        """(() => {
          for (const b of document.querySelectorAll('button')) {
            if (/^(Got it|Dismiss)$/.test(b.innerText.trim())) b.click();
          }
          const title = [...document.querySelectorAll('span, div, h1, h2, h3')]
            .find(e => e.children.length === 0 && e.innerText.trim() === 'MLflow Assistant');
          if (!title) return;
          const t = title.getBoundingClientRect();
          const close = [...document.querySelectorAll('button')]
            .filter(b => { const r = b.getBoundingClientRect();
                           return Math.abs(r.top + r.height / 2 - (t.top + t.height / 2)) < 20 && r.left > t.right; })
            .sort((a, b) => b.getBoundingClientRect().left - a.getBoundingClientRect().left);
          if (close.length) close[0].click();
        })()"""
    )
    time.sleep(1.0)


def find_runs(store: Path):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store.resolve() / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fleetwise")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    parents = [r for r in runs if r.info.run_id in {c.data.tags["mlflow.parentRunId"] for c in children}]
    return exp.experiment_id, runs, children, parents


def look(store: Path, out: Path, *, port: int | None = None) -> list[str]:
    """Serve `store` with `fleetwise ui`, look at the pages, save screenshots; the failed checks."""
    binary = chromium()
    if binary is None:
        return ["chromium is not installed (apt-get install chromium)"]
    out.mkdir(parents=True, exist_ok=True)
    exp_id, runs, children, parents = find_runs(store)
    job = children[0] if children else runs[0]
    port = port or free_port()
    exe = Path(sys.executable).parent / "fleetwise"
    ui = subprocess.Popen(
        [str(exe), "ui", "--port", str(port)],
        cwd=store,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    failures: list[str] = []
    browser = None
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(base + "/health", 240, ui)
        browser = Browser(binary)
        browser.call("Page.enable")
        browser.call("Runtime.enable")

        # 1. the experiment's run list: the sweep parent, expanded to show its children (the jobs)
        browser.size(700)
        browser.open(f"{base}/#/experiments/{exp_id}/runs")
        browser.wait_text([(parents[0] if parents else job).info.run_name])
        dismiss_overlays(browser)
        if parents:
            _expand_parents(browser)
        text = browser.wait_text([job.info.run_name, "synthetic-gpt-seed1234"], timeout=30)
        for needle in [job.info.run_name, "synthetic-gpt-seed1234"]:
            if needle not in text:
                failures.append(f"run list: {needle!r} is not on the page")
        if parents and not all(c.info.run_name in text for c in children):
            failures.append(f"run list: sweep parent {parents[0].info.run_name!r} does not show its children")
        browser.screenshot(out / "runs.png", 700)

        # the run's overview: its fleetwise tags
        browser.open(f"{base}/#/experiments/{exp_id}/runs/{job.info.run_id}")
        want = ["fleetwise.recipe", "fleetwise.strategy", job.data.tags["fleetwise.strategy"], "gpt/tiny"]
        text = browser.wait_text(want, timeout=60)
        failures += [f"run overview: {w!r} is not on the page" for w in want if w not in text]

        # 2. the job's metric charts, each found with the page's search box (charts draw only when
        # scrolled into view, and the run has ~40 of them)
        page = f"{base}/#/experiments/{exp_id}/runs/{job.info.run_id}/model-metrics"
        browser.size(900)
        drawn: set[str] = set()
        browser.open(page)
        # the page keeps the last search of this run across reloads, so which charts (and so which
        # words) it shows depends on it: wait for the search box, not for a chart's name
        browser.wait_js(f"!!document.querySelector({SEARCH!r})", timeout=60)
        dismiss_overlays(browser)
        # one search per chart on the loaded page, each typed over the last (a reload per chart
        # cost a page load each); the last, "train/", leaves the train/ charts for the screenshot
        for chart, wanted in [*((c, [c]) for c in CHARTS), ("train/", [Metric.LOSS])]:
            browser.evaluate(
                f"(() => {{ const i = document.querySelector({SEARCH!r}); i.focus(); i.select(); }})()"
            )
            browser.call("Input.insertText", text=chart)
            drawn |= _wait_charts(browser, wanted, timeout=60)
        missing = [c for c in CHARTS if c not in drawn]
        if missing:
            failures.append(f"run page: no chart for {missing} (charts drawn: {sorted(drawn)})")
        time.sleep(2.0)
        browser.screenshot(out / "charts.png", 900)  # the train/ charts: loss, lr, grad_norm, ...
        for shot in ("runs.png", "charts.png"):
            browser.shrink(out / shot)
    finally:
        if browser is not None:
            browser.close()
        _stop(ui)
    return failures


def _expand_parents(browser: Browser) -> None:
    """The "+" before a parent run's name expands its children."""
    browser.evaluate(
        """(() => { for (const a of document.querySelectorAll('a')) {
             if (!a.innerText.trim().startsWith('sweep-')) continue;
             let cell = a.parentElement;
             for (let i = 0; i < 4 && cell; i++, cell = cell.parentElement) {
               const b = cell.querySelector('button, [role=button]');
               if (b && !b.contains(a)) { b.click(); return; }
             } } })()"""
    )
    time.sleep(1.5)


def _expand_all_sections(browser: Browser) -> None:
    browser.evaluate(
        """(() => { for (const b of document.querySelectorAll('[aria-expanded=false]')) b.click(); })()"""
    )
    time.sleep(1.0)


def _wait_charts(browser: Browser, wanted, timeout: float = 90.0) -> set[str]:
    """Metric names of the charts that have drawn their plot (an SVG, not a spinner), read from
    each chart's legend ("<run name> (memory/peak_bytes_max)")."""
    js = r"""(() => {
      const drawn = new Set();
      for (const svg of document.querySelectorAll('svg.main-svg')) {
        let card = svg.parentElement;
        for (let i = 0; i < 12 && card; i++, card = card.parentElement) {
          const m = (card.textContent || '').match(/\(([a-z_]+\/[a-z_0-9\/]+)\)/);
          if (m) { drawn.add(m[1]); break; }
        }
      }
      return [...drawn];
    })()"""
    deadline = time.monotonic() + timeout
    while True:
        drawn = set(browser.evaluate(js) or [])
        if set(wanted) <= drawn or time.monotonic() > deadline:
            return drawn
        time.sleep(1.0)


def train_sweep(store: Path) -> None:
    exe = Path(sys.executable).parent / "fleetwise"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    subprocess.run([str(exe), "train", "-m", *SWEEP], cwd=store, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, default=Path.cwd(), help="directory holding mlflow.db (default .)")
    p.add_argument("--out", type=Path, default=Path("scripts/screenshots"), help="where screenshots go")
    p.add_argument("--train", action="store_true", help="first run a small sweep in --store")
    args = p.parse_args(argv)
    args.store.mkdir(parents=True, exist_ok=True)
    if args.train:
        train_sweep(args.store)
    failures = look(args.store, args.out.resolve())
    for f in failures:
        print(f"✗ {f}", file=sys.stderr)
    print(f"screenshots: {args.out.resolve()}/runs.png, charts.png")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
