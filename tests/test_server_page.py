"""The live page in a real headless Chromium (Debian's `chromium`, driven by Playwright through its
`executable_path`; Playwright's own browser download is never used). It loads with no console error, a
prompt typed into it streams the engine's text, and the block grid shows blocks held (and shared by the
n=2 choices) while the request runs and none after. A screenshot is saved (to $LIVE_PAGE_SCREENSHOT too,
when set: that is how docs/img/07-live-page.png is made). Skips where Chromium or Playwright is absent."""

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_support import make_char_checkpoint, offline_greedy, running_server, slowed_engine

from mini_transformer.engine import EngineConfig

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
WAIT_MS = 30_000  # every wait is bounded


def test_live_page_streams_and_shows_the_blocks(tmp_path):
    model, tokenizer = make_char_checkpoint(tmp_path / "ckpt", max_seq_len=384)
    prompt, max_tokens = "Hello there, page", 300
    expected = tokenizer.decode(offline_greedy(model, [tokenizer.encode(prompt)], max_tokens)[0])
    # three other clients share a system prompt; with max_num_seqs=4 one of the five requests waits
    others = [f"System: answer briefly.\nUser: question {i}\n" for i in range(3)]
    with running_server(tmp_path / "ckpt", config=EngineConfig(block_size=4, num_blocks=400, max_num_seqs=4),
                        model_name="tiny") as server, sync_api.sync_playwright() as playwright, \
            ThreadPoolExecutor(3) as pool, slowed_engine(server):  # >= 3 s running: many 250 ms page polls
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            problems = []
            page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda err: problems.append(str(err)))
            page.goto(server.url + "/", timeout=WAIT_MS)
            page.wait_for_function("document.getElementById('model-name').textContent === 'tiny'", timeout=WAIT_MS)
            page.wait_for_function("document.querySelectorAll('#grid .block').length === 400", timeout=WAIT_MS)
            assert page.locator("#grid .block.used").count() == 0

            page.fill("#prompt", prompt)
            page.fill("#max-tokens", str(max_tokens))
            page.fill("#temperature", "0")
            page.fill("#n", "2")
            background = [pool.submit(httpx.post, server.url + "/v1/completions", timeout=120,
                                      json={"model": "tiny", "prompt": p, "max_tokens": 250, "temperature": 0})
                          for p in others]
            page.click("#send")
            # while it runs: text streams in, blocks are held, the prompt's full blocks are shared by both choices
            page.wait_for_function("document.querySelector('.completion') && "
                                   "document.querySelector('.completion').textContent.length > 0", timeout=WAIT_MS)
            page.wait_for_function("document.querySelectorAll('#grid .block.used').length > 0 && "
                                   "document.querySelectorAll('#grid .block.shared').length > 0", timeout=WAIT_MS)
            try:  # for the picture only: let the other clients' requests show up in the table too
                page.wait_for_function("document.querySelectorAll('#requests tr').length >= 4", timeout=5_000)
            except sync_api.TimeoutError:
                pass
            page.screenshot(path=str(tmp_path / "live-page.png"))
            if os.environ.get("LIVE_PAGE_SCREENSHOT"):
                page.screenshot(path=os.environ["LIVE_PAGE_SCREENSHOT"])
            # afterwards: the whole text, and an empty pool
            page.wait_for_function("!document.getElementById('send').disabled", timeout=WAIT_MS)
            page.wait_for_function("document.querySelectorAll('#grid .block.used').length === 0", timeout=WAIT_MS)
            assert all(f.result().status_code == 200 for f in background)
            texts = page.locator(".completion").all_text_contents()
            assert texts == [expected, expected]  # greedy: both choices equal the offline engine's output
            assert "done in" in page.locator("#request-info").text_content()
            assert problems == []
        finally:
            browser.close()
    assert (tmp_path / "live-page.png").stat().st_size > 0
