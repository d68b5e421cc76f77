"""The real agent clients, installed from npm (pinned versions, cached under $INFERNIX_HOME), run
headless against the loopback server with the default model: Codex (Responses API), opencode
(Chat Completions with tools and stream_options) and Claude Code (Anthropic Messages). Each must
finish with exit code 0, print the model's reply, and the server must have answered its endpoint
with 200. The tiny model's replies are not judged; the protocols are."""
import json
import os
import subprocess
import time

import pytest

pytestmark = pytest.mark.extended      # (the npm agent clients (minutes on 2 cores): `pytest -m extended`)

from conftest import SERVED_NAMES, requests_total, start_server

CLIENTS = {"@openai/codex": "0.169.0", "@anthropic-ai/claude-code": "2.1.328", "opencode-ai": "1.18.33"}


@pytest.fixture(scope="module")
def npm_bin():
    from infernix_jax.hub import home
    root = home() / "test-assets" / "agent-clients"
    stamp = root / "installed.json"
    if not stamp.exists() or json.loads(stamp.read_text()) != CLIENTS:
        root.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(root),
                            *(f"{k}@{v}" for k, v in CLIENTS.items())], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"npm install failed: {r.stderr[-800:]}"
        stamp.write_text(json.dumps(CLIENTS))
    return root / "node_modules" / ".bin"


@pytest.fixture()
def server_url(smollm, tmp_path_factory):
    """A fresh server for each client: an agent may leave background requests running when it exits
    (titles, compaction), which would slow the next client's turn on a 2-core machine. Greedy replies
    of at most 48 tokens: the tiny model's sampled rambling (or a loop of tool calls) would otherwise
    decide how long a test runs."""
    log = tmp_path_factory.mktemp("requests") / "requests.jsonl"
    for url in start_server(tmp_path_factory, "--max-batch", "4", "--log-requests", str(log), *SERVED_NAMES,
                            "--max-new-tokens", "48", "--override-generation-config", '{"temperature": 0}'):
        yield url
        print(f"request log {log}:\n" + (log.read_text()[-4000:] if log.exists() else "(empty)"))


def served(server_url, endpoint: str, more_than: float = -1.0) -> float:
    """The server's count of 200 answers on an endpoint. A streamed request is counted when its
    handler returns, which can be a moment after the client has read the last event and exited:
    with more_than, wait up to 15 s for the count to pass it."""
    deadline = time.time() + 15
    while True:
        n = requests_total(server_url, endpoint, 200)
        if n > more_than or time.time() > deadline:
            return n
        time.sleep(0.25)


def run_client(cmd, env, cwd, timeout=300, cut_ok: str | None = None):
    """Output goes to files, not pipes: an agent's helper processes may hold inherited pipes open
    after it exits, and its own log (printed on failure) says where it stopped."""
    full = {"PATH": os.environ["PATH"], "HOME": str(cwd / "home"), "DISABLE_TELEMETRY": "1", **env}
    (cwd / "home").mkdir(parents=True, exist_ok=True)
    out, err = cwd / "stdout.txt", cwd / "stderr.txt"
    with open(out, "w") as o, open(err, "w") as e:
        try:
            r = subprocess.run(cmd, env=full, cwd=cwd, stdout=o, stderr=e, timeout=timeout,
                               stdin=subprocess.DEVNULL, start_new_session=True)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{cmd[0]} did not finish in {timeout} s: {err.read_text()[-3000:]}")
    stdout, stderr = out.read_text(), err.read_text()
    if r.returncode and cut_ok is not None and cut_ok in stdout:
        return stdout          # the reply was cut by this module's 48-token cap: the client says so
    assert r.returncode == 0, f"{cmd[0]} exited {r.returncode}: {stdout[-500:]} {stderr[-1500:]}"
    assert stdout.strip(), f"{cmd[0]} printed no reply: {stderr[-1500:]}"
    return stdout


def test_codex_exec(npm_bin, server_url, tmp_path):
    before = served(server_url, "responses")
    (tmp_path / "codex").mkdir()
    (tmp_path / "codex" / "config.toml").write_text(
        'model = "test-model"\nmodel_provider = "local"\n\n[model_providers.local]\nname = "local"\n'
        f'base_url = "{server_url}/v1"\nenv_key = "LOCAL_API_KEY"\nwire_api = "responses"\n'
        "supports_websockets = true\n\n[analytics]\nenabled = false\n")
    run_client([str(npm_bin / "codex"), "exec", "--skip-git-repo-check", "Say hello."],
               {"CODEX_HOME": str(tmp_path / "codex"), "LOCAL_API_KEY": "x"}, tmp_path)
    assert served(server_url, "responses", more_than=before) > before


def test_opencode_run(npm_bin, server_url, tmp_path):
    before = served(server_url, "chat.completions")
    cfg = tmp_path / "home" / ".config" / "opencode"
    cfg.mkdir(parents=True)
    (cfg / "opencode.json").write_text(json.dumps({
        "provider": {"local": {"npm": "@ai-sdk/openai-compatible", "name": "local",
                               "options": {"baseURL": server_url + "/v1", "apiKey": "x"},
                               "models": {"test-model": {"name": "test-model"}}}},
        "model": "local/test-model"}))
    run_client([str(npm_bin / "opencode"), "run", "--print-logs", "Say hello."], {"OPENCODE_DISABLE_MODELS_FETCH": "1"}, tmp_path)
    assert served(server_url, "chat.completions", more_than=before) > before


def test_claude_code_print(npm_bin, server_url, tmp_path):
    before = served(server_url, "messages")
    run_client([str(npm_bin / "claude"), "-p", "Say hello.", "--model", "test-model"],
               {"ANTHROPIC_BASE_URL": server_url, "ANTHROPIC_AUTH_TOKEN": "x",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}, tmp_path,
               # Claude Code -p exits 1 on stop_reason max_tokens; greedy replies of the 135M model to
               # its (date-stamped) prompt sometimes run past the cap
               cut_ok="exceeded the 128000 output token maximum")
    assert served(server_url, "messages", more_than=before) > before
