"""The web UI in headless Chromium (Debian's `chromium`, driven by Playwright) against a live server
with the default model: send a message and see the streamed reply with its stats, stop a reply,
reload and see the conversation, the API key asked for and kept out of URLs, and replies rendered
without letting their text become markup. Screenshots go to test-artifacts/."""
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from conftest import start_server

CHROMIUM = os.environ.get("INFERNIX_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
# as root, in a machine with no way out: no sandbox, and none of Chromium's own background traffic
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the test extra installs playwright")
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (.ci/run installs Debian's chromium)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    # bypass_csp: the pages forbid eval, which Playwright's string predicates use (the app never does)
    ctx = browser.new_context(viewport={"width": 1100, "height": 800}, bypass_csp=True)
    p = ctx.new_page()
    errors = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    yield p
    ctx.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def ask(page, text: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_chat_streams_stops_and_survives_a_reload(page, server_url):
    page.goto(server_url + "/")
    page.wait_for_function("document.getElementById('model-name').textContent !== '…'")
    model = page.text_content("#model-name")
    assert model == "smollm2-135m-instruct"

    ask(page, "Name three colours.", 24)
    page.wait_for_selector(".msg.assistant .stats", timeout=120_000)
    reply = page.text_content(".msg.assistant .content").strip()
    stats = page.text_content(".msg.assistant .stats")
    assert reply and model in stats and "TTFT" in stats and "tok/s" in stats and "tokens" in stats, stats
    assert page.is_visible("#send") and not page.is_visible("#stop")
    shot(page, "webui-chat")

    # a long reply, stopped once it has started: marked stopped, and the server drops the request
    ask(page, "Write a very long story about a dragon who learns to cook.", 4000)
    page.wait_for_function("document.querySelectorAll('.msg.assistant .content')[1]?.textContent.length > 20",
                           timeout=120_000)
    page.click("#stop")
    page.wait_for_selector(".msg.assistant:nth-of-type(4) .stats", timeout=30_000)
    assert "stopped" in page.text_content(".msg.assistant:nth-of-type(4) .stats")
    deadline = time.time() + 30
    while httpx.get(server_url + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(server_url + "/health").json()["running"] == 0
    stopped_text = page.text_content(".msg.assistant:nth-of-type(4) .content")

    # reload: the conversation comes back from local storage, as it was
    page.reload()
    page.wait_for_selector(".msg.assistant:nth-of-type(4)")
    texts = page.eval_on_selector_all(".msg .content", "els => els.map(e => e.textContent)")
    assert texts[0] == "Name three colours." and texts[1].strip() == reply and texts[3] == stopped_text
    assert page.eval_on_selector_all("#chat-list li", "els => els.length") == 1
    page.click("#new-chat")
    assert page.eval_on_selector_all("#chat-list li", "els => els.length") == 2
    assert page.eval_on_selector_all(".msg", "els => els.length") == 0


def test_reasoning_folds_tool_calls_show_and_text_stays_text(page, server_url):
    """A stored conversation with reasoning, a tool call and hostile markdown: reasoning folded,
    the call as a block, code fenced, no element made from the reply's text, images as links."""
    page.goto(server_url + "/")
    hostile = ("# Title\n**bold** and `<b>code</b>`\n\n```python\nprint('<script>x</script>')\n```\n"
               "- <img src=x onerror=\"window.hit=1\">\n- [bad](javascript:window.hit=1) [good](https://example.com)\n"
               "![cat](https://example.com/cat.png)")
    store = {"current": "c1", "chats": [{"id": "c1", "title": "stored", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": hostile, "reasoning": "thinking it over",
         "tool_calls": [{"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}],
         "stats": {"model": "m", "ttft_ms": 120, "tok_s": 33.3, "tokens": 20, "finish": "tool_calls"}}]}]}
    page.evaluate("s => localStorage.setItem('infernix.chats', JSON.stringify(s))", store)
    page.reload()
    page.wait_for_selector(".msg.assistant .tool-call")
    assert page.eval_on_selector(".msg.assistant details.reasoning", "d => d.open") is False
    assert page.text_content(".tool-call .tool-name") == "tool call: get_weather"
    assert "Paris" in page.text_content(".tool-call .tool-args")
    content = ".msg.assistant .content"
    assert page.text_content(f"{content} h3") == "Title"
    assert page.text_content(f"{content} strong") == "bold"
    assert page.text_content(f"{content} pre.code") == "print('<script>x</script>')"
    assert page.eval_on_selector_all(f"{content} img, {content} script, {content} b", "els => els.length") == 0
    hrefs = page.eval_on_selector_all(f"{content} a", "els => els.map(a => a.getAttribute('href'))")
    assert hrefs == ["https://example.com", "https://example.com/cat.png"]
    assert "[image: cat]" in page.text_content(f"{content} a.image-link")
    assert page.evaluate("window.hit") is None
    shot(page, "webui-rendering")


@pytest.fixture(scope="module")
def keyed_url(smollm, tmp_path_factory):
    yield from start_server(tmp_path_factory, "--api-key", "s3cret-key", "--max-batch", "2")


def test_the_page_asks_for_the_api_key_and_keeps_it_out_of_urls(page, keyed_url):
    urls = []
    page.on("request", lambda r: urls.append(r.url))
    page.goto(keyed_url + "/")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#api-key", "wrong")
    page.click("#key-form button[type=submit]")
    page.wait_for_function("document.getElementById('status').textContent.includes('API key needed')")
    page.fill("#api-key", "s3cret-key")
    page.click("#key-form button[type=submit]")
    page.wait_for_function("document.getElementById('model-name').textContent !== '…'")
    assert page.is_hidden("#key-form")
    ask(page, "Hi!", 4)
    page.wait_for_selector(".msg.assistant .stats", timeout=120_000)
    assert not page.text_content(".msg.assistant .error") if page.query_selector(".msg.assistant .error") else True
    assert urls and not [u for u in urls if "s3cret" in u]
    assert httpx.get(keyed_url + "/v1/models").status_code == 401          # the API itself stays closed
    assert httpx.get(keyed_url + "/").status_code == 200                    # the page holds nothing
