"""The web UI in headless Chromium (Debian's `chromium`, driven by Playwright) against a live server
with the default model: send a message and see the streamed reply with its stats, stop a reply,
reload and see the conversation, the API key asked for and kept out of URLs, and replies rendered
without letting their text become markup. Screenshots go to test-artifacts/."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.extended      # (headless Chromium: `pytest -m extended`)

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
    page.wait_for_selector("#send", state="visible", timeout=120_000)          # the reply has ended
    reply = page.text_content(".msg.assistant .content").strip()
    stats = page.text_content(".msg.assistant .stats")
    assert reply and model in stats and "TTFT" in stats and "tok/s" in stats and "tokens" in stats, stats
    assert "streaming" not in stats
    assert page.is_visible("#send") and not page.is_visible("#stop")
    shot(page, "webui-chat")

    # a long reply, stopped once it has started: marked stopped, and the server drops the request
    ask(page, "Write a very long story about a dragon who learns to cook.", 4000)
    page.wait_for_function("document.querySelectorAll('.msg.assistant .content')[1]?.textContent.length > 20",
                           timeout=120_000)
    live = page.text_content(".msg.assistant:nth-of-type(4) .stats")       # stats while it streams
    assert "streaming" in live and "tok/s" in live and "TTFT" in live, live
    page.click("#stop")
    page.wait_for_function("document.querySelector('.msg.assistant:nth-of-type(4) .stats').textContent"
                           ".includes('stopped')", timeout=30_000)
    assert "streaming" not in page.text_content(".msg.assistant:nth-of-type(4) .stats")
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
def keyed(smollm, tmp_path_factory):
    """A server started from a config file (--config) holding its API key: (url, config path)."""
    cfg = tmp_path_factory.mktemp("config") / "serve.json"
    cfg.write_text(json.dumps({"api-key": "s3cret-key", "max-batch": 2, "served-model-name": ["smollm2-135m-instruct"],
                               "prefix-cache-ram-gib": 0.25}))
    for url in start_server(tmp_path_factory, "--config", str(cfg)):
        yield url, cfg


def test_the_page_asks_for_the_api_key_and_keeps_it_out_of_urls(page, keyed):
    url, _ = keyed
    urls = []
    page.on("request", lambda r: urls.append(r.url))
    page.goto(url + "/")
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
    page.wait_for_selector("#send", state="visible", timeout=120_000)
    assert page.query_selector(".msg.assistant .error") is None
    assert urls and not [u for u in urls if "s3cret" in u]
    assert httpx.get(url + "/v1/models").status_code == 401                 # the API itself stays closed
    assert httpx.get(url + "/admin/config").status_code == 401
    assert httpx.get(url + "/").status_code == 200                          # the pages hold nothing
    assert httpx.get(url + "/configure").status_code == 200


def test_configure_shows_the_server_and_changes_settings(page, keyed):
    url, cfg = keyed
    auth = {"Authorization": "Bearer s3cret-key"}
    page.goto(url + "/configure")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#api-key", "s3cret-key")
    page.click("#key-form button[type=submit]")
    page.wait_for_function("document.getElementById('model').textContent.includes('smollm2-135m-instruct')")
    assert "blocks in use" in page.text_content("#kv") and "running" in page.text_content("#requests")
    assert "required" in page.text_content("#model")
    assert "RAM tier" in page.text_content("#prefix") and "of 0.25 GiB" in page.text_content("#prefix")
    assert page.text_content("#restart-command") == f"infernix-serve --config {cfg}"
    assert "s3cret" not in page.content()                                   # never sent back

    # a live setting: the next reply is capped at once
    page.fill("input[name=max-new-tokens]", "3")
    page.fill("input[name='s:temperature']", "0")
    page.click("#apply-live")
    page.wait_for_function("document.getElementById('live-result').textContent.startsWith('Applied')")
    r = httpx.post(url + "/v1/chat/completions", headers=auth, timeout=120,
                   json={"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 50})
    assert r.json()["usage"]["completion_tokens"] <= 3
    live = httpx.get(url + "/admin/config", headers=auth).json()["live"]
    # (the form holds the defaults in force, the default model's card's top_p among them)
    assert live["max-new-tokens"] == 3 and live["sampling"] == {"temperature": 0.0, "top_p": 0.9}

    # settings for the next start: a bad value is refused and changes nothing; a good one is saved
    before = cfg.read_text()
    page.fill("input[name=block-size]", "big")
    page.click("#save-restart")
    page.wait_for_selector("#restart-result.error")
    assert "block-size" in page.text_content("#restart-result") and cfg.read_text() == before
    page.fill("input[name=block-size]", "32")
    page.fill("input[name=kv-cache-gib]", "0.5")
    page.click("#save-restart")
    page.wait_for_function("document.getElementById('restart-result').textContent.includes('Restart the server with')")
    saved = json.loads(cfg.read_text())
    assert saved["block-size"] == 32 and saved["kv-cache-gib"] == 0.5 and saved["max-new-tokens"] == 3
    assert saved["api-key"] == "s3cret-key" and saved["max-num-seqs"] == 2       # what it started with stays
    assert "max-batch" not in saved                                               # (under one name)
    shot(page, "webui-configure")
    # and infernix-serve reads it back
    plan = subprocess.run([sys.executable, "-m", "scripts.serve", "--config", str(cfg), "--plan"],
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr
    assert "0.50 GiB = " in plan.stdout and "x 32 tokens" in plan.stdout and "max_num_seqs:       2" in plan.stdout


def test_admin_config_refuses_bad_bodies_and_other_sites(keyed):
    url, cfg = keyed
    auth = {"Authorization": "Bearer s3cret-key", "Content-Type": "application/json"}
    before = cfg.read_text()
    body = b'{"live": {"max-new-tokens": 1}}'
    for headers, msg in (({"Content-Type": "text/plain"}, "application/json"),
                         ({"Origin": "http://evil.example"}, "evil.example"),
                         ({"Sec-Fetch-Site": "cross-site"}, "another site")):
        r = httpx.post(url + "/admin/config", headers={**auth, **headers}, content=body)
        assert r.status_code == 403 and msg in r.json()["error"]["message"], r.text
    for body, msg in ((b"[1, 2]", "JSON object"), (b"{oops", "not valid JSON"),
                      (b'{"live": []}', "live must be an object"),
                      (b'{"live": {"sampling": {"top_k": Infinity}}}', "top_k"),
                      (b'{"restart": {"lossless": true, "dtype": "bfloat16"}}', "lossless"),
                      (b'{"restart": {"served-model-name": ["a", "--port", "1"]}}', "plain values"),
                      (b'{"live": {"max-pending-requests": 0}}', "max-pending-requests"),
                      (b'{"live": {"model": "x"}}', "not a live setting"),
                      (b'{"live": {"sampling": {"temperature": -1}}}', "temperature"),
                      (b'{"restart": {"max-new-tokens": 5}}', "live setting"),
                      (b'{"restart": {"no-such-option": 1}}', "unknown option"),
                      (b'{"restart": {"port": 70000}}', "port")):
        r = httpx.post(url + "/admin/config", headers=auth, content=body)
        assert r.status_code == 400 and msg in r.json()["error"]["message"], (body, r.text)
    assert cfg.read_text() == before
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.get(url + "/admin/config", headers=auth).json()["live"]["max-new-tokens"] != 1


def test_a_key_from_the_command_line_is_not_written(tmp_path):
    """--api-key on the command line (or in the environment) stays out of the config file: the
    restart command asks for it again. One from the config file stays there."""
    from scripts import serve, serve_config
    p = serve.build_parser()
    a = p.parse_args(["--api-key=-k3y", "--port", "9000"])
    info = serve._admin_info(p, serve_config.started(p, a), None)
    assert "api-key" not in info.started and info.started["port"] == 9000
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"api-key": "-k3y"}))
    args, path = serve_config.argv_with_config(p, ["--config", str(f)])
    info = serve._admin_info(p, serve_config.started(p, p.parse_args(args)), path)
    assert info.started["api-key"] == "-k3y"           # (a value that starts with '-' reads back too)


def test_a_bad_config_file_is_a_one_line_error(tmp_path):
    for text, msg in (("{", "not valid JSON"), ("[]", "JSON object"), ('{"kv-cache": 1}', "unknown option 'kv-cache'"),
                      ('{"lossless": "yes"}', "true or false")):
        f = tmp_path / "c.json"
        f.write_text(text)
        r = subprocess.run([sys.executable, "-m", "scripts.serve", "--config", str(f), "--plan"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def scripted_url(qwen3_tokenizer_dir, tmp_path_factory):
    """The scripted server (tests/scripted_server.py: a real server whose engine replays the text a
    message scripts) with Qwen3's template: replies with reasoning and tool calls, streamed."""
    script_server = str(Path(__file__).with_name("scripted_server.py"))
    yield from start_server(tmp_path_factory, str(qwen3_tokenizer_dir), cmd=(script_server,))


def test_streamed_reasoning_folds_and_tool_calls_show(page, scripted_url):
    page.goto(scripted_url + "/")
    page.wait_for_function("document.getElementById('model-name').textContent !== '…'")
    page.fill("#tools", "[oops")                                     # bad tools: said on the reply, nothing sent
    ask(page, "hello", 10)
    page.wait_for_selector(".msg.assistant .error")
    assert "not valid JSON" in page.text_content(".msg.assistant .error")
    page.fill("#tools", "")
    page.click("#new-chat")
    text = ('<think>\nThe user wants weather.\n</think>\n\nChecking **now**.<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    ask(page, "SCRIPT:" + json.dumps({"text": text, "chars": True}), 200)
    page.wait_for_selector(".msg.assistant .stats", timeout=60_000)
    page.wait_for_selector("#send", state="visible", timeout=60_000)
    assert page.eval_on_selector(".msg.assistant details.reasoning", "d => d.open") is False
    assert page.text_content(".msg.assistant .reasoning-text").strip() == "The user wants weather."
    assert page.text_content(".msg.assistant .content strong") == "now"
    # no tools offered: the server leaves the call in the text, shown as text, not markup
    assert "<tool_call>" in page.text_content(".msg.assistant .content")
    assert page.eval_on_selector_all(".msg.assistant .content tool_call", "els => els.length") == 0
    # with tools: the call streams as tool_calls deltas and shows as a block
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    page.fill("#tools", json.dumps(tools))
    ask(page, "SCRIPT:" + json.dumps({"text": text, "chars": True}), 200)
    page.wait_for_selector(".msg.assistant:nth-of-type(4) .tool-call", timeout=60_000)
    page.wait_for_selector("#send", state="visible", timeout=60_000)
    last = ".msg.assistant:nth-of-type(4)"
    assert page.text_content(f"{last} .content").strip() == "Checking now."
    assert page.text_content(f"{last} .tool-call .tool-name") == "tool call: get_weather"
    assert json.loads(page.text_content(f"{last} .tool-call .tool-args")) == {"city": "Paris"}
    assert "tool_calls" in page.text_content(f"{last} .stats")
    shot(page, "webui-reasoning-tools")
