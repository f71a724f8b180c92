"""A real browser (Debian's Chromium driven by Playwright): open the app, send a prompt, start a small load,
check that the inspector's plots render with non-zero size and show the requests, and screenshot each tab.

Skipped when /usr/bin/chromium is missing. Screenshots go to assets/_tmp/screenshots/ (git-ignored); with
KVSCOPE_UPDATE_SCREENSHOTS=1 they replace assets/screenshot_*.png (the README's). KVSCOPE_BROWSER_MODEL
picks the model (default: the random-weight tiny preset; "bundled" = SmolLM2-135M-Instruct);
KVSCOPE_BROWSER_DP=2 runs two data-parallel replicas (the inspector then shows each one).
"""
import os
import re
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium not installed"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def url():
    import app as A
    from engine.config import EngineConfig
    from webui.host import EngineHost
    model = os.environ.get("KVSCOPE_BROWSER_MODEL", "dummy:tiny")
    cfg = EngineConfig(model=None if model == "bundled" else model, device="cpu",
                       num_kv_blocks=int(os.environ.get("KVSCOPE_BROWSER_BLOCKS", "48")), max_num_seqs=16,
                       max_num_batched_tokens=256, data_parallel_size=int(os.environ.get("KVSCOPE_BROWSER_DP", "1")))
    host = EngineHost(cfg).start()
    srv = A.serve_in_thread(host)
    yield srv.url
    srv.stop()
    host.shutdown()


@pytest.fixture(scope="module")
def shots():
    d = ROOT / "assets" if os.environ.get("KVSCOPE_UPDATE_SCREENSHOTS") == "1" else ROOT / "assets" / "_tmp" / "screenshots"
    d.mkdir(parents=True, exist_ok=True)
    return d


def plot_box(page, elem_id, timeout=20.0):
    """The rendered Plotly element's box, read in one evaluation inside the page: a live update re-creates the
    element every second, and a locator's element can be detached between resolving and measuring it."""
    deadline = time.time() + timeout
    box = None
    while time.time() < deadline:
        box = page.evaluate(PLOT_BOX_JS, elem_id)
        if box and box["width"] > 0 and box["height"] > 0:
            return box
        time.sleep(0.2)
    return box


PLOT_BOX_JS = """(id) => {
  const svg = document.querySelector('#' + id + ' .js-plotly-plot .main-svg');
  if (!svg) return null;
  const b = svg.getBoundingClientRect();
  return {x: b.x, y: b.y, width: b.width, height: b.height};
}"""


FIGURE_BOXES_JS = """(id) => {
  const root = document.querySelector('#' + id);
  const plot = root && root.querySelector('.js-plotly-plot');
  const svg = plot && plot.querySelector('.main-svg');
  if (!svg) return null;
  const box = e => { const b = e.getBoundingClientRect(); return {x: b.x, y: b.y, w: b.width, h: b.height}; };
  const texts = [...plot.querySelectorAll('.annotation, .gtitle')].filter(e => e.textContent.trim());
  return {container: box(root), plot: box(svg), texts: texts.map(e => ({text: e.textContent, ...box(e)})),
          legend: plot.querySelector('.legend') ? box(plot.querySelector('.legend')) : null};
}"""

# words of the table headers that the browser split over two lines (one word, several line boxes)
BROKEN_HEADER_WORDS_JS = """(sel) => {
  const broken = [];
  for (const th of document.querySelectorAll(sel + ' th')) {
    const walker = document.createTreeWalker(th, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const m of node.textContent.matchAll(/\\S+/g)) {
        const r = document.createRange();
        r.setStart(node, m.index); r.setEnd(node, m.index + m[0].length);
        const lines = new Set([...r.getClientRects()].filter(b => b.width > 0).map(b => Math.round(b.top)));
        if (lines.size > 1) broken.push(m[0]);
      }
    }
  }
  return broken;
}"""


def overlaps(a, b, slack=1.0):
    return (a["x"] + slack < b["x"] + b["w"] and b["x"] + slack < a["x"] + a["w"]
            and a["y"] + slack < b["y"] + b["h"] and b["y"] + slack < a["y"] + a["h"])


def layout_problems(page, elem_id):
    """Why a figure's layout is wrong: narrower than 90% of its container, or overlapping titles / legend."""
    f = page.evaluate(FIGURE_BOXES_JS, elem_id)
    if f is None:
        return [f"{elem_id}: not rendered"]
    bad = []
    if f["plot"]["w"] < 0.9 * f["container"]["w"]:
        bad.append(f"{elem_id}: figure {f['plot']['w']:.0f} px wide in a {f['container']['w']:.0f} px container")
    boxes = f["texts"] + ([dict(text="(legend)", **f["legend"])] if f["legend"] else [])
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if overlaps(a, b):
                bad.append(f"{elem_id}: {a['text'][:40]!r} overlaps {b['text'][:40]!r}")
    return bad


def test_app_in_a_real_browser(url, shots):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 950})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        page.wait_for_selector("#kv-send", timeout=60000)

        # ---- Playground: send a prompt (greedy), watch it stream, see per-request stats
        temp = page.locator("#kv-temperature input[type=number]").first
        temp.fill("0")
        temp.press("Enter")
        page.fill("#kv-chat-input textarea", "What is the capital of France?")
        page.click("#kv-send")
        page.wait_for_function("() => /(^|\\s)(length|stop)(\\s|$)/m.test(document.querySelector('#kv-req-stats')"
                               "?.innerText || '')", timeout=60000)
        stats = page.inner_text("#kv-req-stats")
        assert "TTFT" in stats and "chat-" in stats
        assert page.evaluate(BROKEN_HEADER_WORDS_JS, "#kv-req-stats") == []
        bubbles = page.locator("#kv-chatbot .message")
        assert bubbles.count() >= 2
        if os.environ.get("KVSCOPE_BROWSER_MODEL") == "bundled":       # greedy SmolLM2 knows this one
            assert "Paris" in page.inner_text("#kv-chatbot")
        page.screenshot(path=str(shots / "screenshot_playground.png"), full_page=True)

        # raw completion mode streams into its own box
        page.get_by_label("Completion").check()
        page.fill("#kv-comp-input textarea", "Once upon a time")
        page.click("#kv-send")
        page.wait_for_function("() => (document.querySelector('#kv-comp-output textarea')?.value || '').length > 3",
                               timeout=60000)
        page.get_by_label("Chat").check()

        # ---- Load: a small seeded load on a small KV pool (so it also preempts)
        page.get_by_role("tab", name="Load").click()
        # the page load measured the engine and sized the preset from it
        page.wait_for_function("() => (document.querySelector('#kv-preset-md')?.innerText || '').includes("
                               "'Calibrated')", timeout=60000)
        calibrated = float(re.search(r"Calibrated: ([\d.]+) req/s", page.inner_text("#kv-preset-md")).group(1))
        assert float(page.locator("#kv-rate input").input_value()) == calibrated
        page.locator("#kv-nreq input").fill("16")
        page.locator("#kv-rate input").fill("8")
        page.locator("#kv-pmin input").fill("32")
        page.locator("#kv-pmax input").fill("96")
        page.locator("#kv-omin input").fill("200")         # long enough that several requests overlap,
        page.locator("#kv-omax input").fill("300")         # whatever the machine's speed
        assert page.locator("#kv-target").get_by_text("HTTP (OpenAI-compatible)").count() == 1
        page.click("#kv-start-load")
        page.wait_for_function("() => (document.querySelector('#kv-load-msg')?.innerText || '').includes('Started')",
                               timeout=20000)

        # ---- Inspector, live while the load runs
        page.get_by_role("tab", name="Inspector").click()
        in_use_seen = 0
        deadline = time.time() + 90
        while time.time() < deadline:
            title = page.locator("#kv-plot-blockmap .gtitle").first
            if title.count():
                m = re.search(r"(\d+) in use", title.text_content() or "")
                if m:
                    in_use_seen = max(in_use_seen, int(m.group(1)))
            if in_use_seen and page.locator("#kv-plot-timeline .ytick text").count() >= 8:
                break
            time.sleep(0.3)
        assert in_use_seen > 0, "the block map never showed blocks in use"
        for pid in ("kv-plot-blockmap", "kv-plot-timeline", "kv-plot-throughput", "kv-plot-timings", "kv-plot-spec"):
            box = plot_box(page, pid)
            assert box and box["width"] > 200 and box["height"] > 150, (pid, box)
        ticks = page.locator("#kv-plot-timeline .ytick text").all_text_contents()
        assert sum(t.startswith("L") for t in ticks) >= 8, ticks
        page.screenshot(path=str(shots / "screenshot_inspector_live.png"), full_page=True)

        # ---- Load finishes: progress bar done and the summary table with definitions
        page.get_by_role("tab", name="Load").click()
        page.wait_for_selector("#kv-progress .kv-progress[data-state=done]", timeout=120000)
        page.wait_for_function("() => (document.querySelector('#kv-summary')?.innerText || '').includes('TTFT')",
                               timeout=20000)
        summary = page.inner_text("#kv-summary")
        assert "first token excluded" in summary and "Output throughput" in summary
        page.screenshot(path=str(shots / "screenshot_load.png"), full_page=True)

        # ---- Inspector after the load (its figures were last updated while the tab was hidden): every figure
        # fills its container, no subplot title / legend overlaps another, latency histograms filled
        page.get_by_role("tab", name="Inspector").click()
        page.wait_for_function("() => document.querySelectorAll('#kv-plot-latency .bars path').length > 0",
                               timeout=20000)
        figs = ("kv-plot-blockmap", "kv-plot-timeline", "kv-plot-throughput", "kv-plot-latency", "kv-plot-timings")
        deadline = time.time() + 10                 # resizes follow the tab switch within a second
        problems = None
        while problems != [] and time.time() < deadline:
            problems = [p for pid in figs for p in layout_problems(page, pid)]
            time.sleep(0.3)
        assert problems == []
        lat_titles = page.locator("#kv-plot-latency .annotation").all_text_contents()
        assert sum(t.startswith(("TTFT", "TPOT", "ITL", "E2EL")) for t in lat_titles) == 4, lat_titles
        page.screenshot(path=str(shots / "screenshot_inspector.png"), full_page=True)
        page.locator("#kv-plot-timeline").scroll_into_view_if_needed()
        page.locator("#kv-plot-timeline").screenshot(path=str(shots / "screenshot_timeline.png"))
        page.locator("#kv-plot-blockmap").screenshot(path=str(shots / "screenshot_blockmap.png"))

        for tab in ("Engine settings", "Compare", "Export"):
            page.get_by_role("tab", name=tab).click()
            page.wait_for_timeout(600)
            page.screenshot(path=str(shots / f"screenshot_{tab.split()[0].lower()}.png"), full_page=True)
        browser.close()
        assert not errors, errors
    for name in ("playground", "load", "inspector", "engine", "compare", "export"):
        assert (shots / f"screenshot_{name}.png").stat().st_size > 10_000
