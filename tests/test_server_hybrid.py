"""A hybrid (Qwen3.5: Gated DeltaNet + gated attention) served end to end: a tiny random model
written as a GGUF file the way llama.cpp writes one (with SmolLM2's tokenizer and chat template
copied in), started with infernix-serve, and asked over loopback with the openai SDK."""
import concurrent.futures as cf
import subprocess
import sys

import openai
import pytest

from conftest import start_server
from hf_reference import make_hf_model, write_hybrid_gguf


@pytest.fixture(scope="module")
def hybrid_gguf(smollm, tmp_path_factory):
    hf = make_hf_model("qwen3_5", seed=21, vocab_size=smollm.cfg.vocab_size, hidden_size=64, num_hidden_layers=4,
                       layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=1024)
    path = tmp_path_factory.mktemp("hybrid") / "tiny-qwen35.gguf"
    write_hybrid_gguf(hf, path, "qwen3_5", tokenizer_from=smollm.path)
    return path


@pytest.fixture(scope="module")
def hybrid_url(hybrid_gguf, tmp_path_factory):
    path = hybrid_gguf
    yield from start_server(tmp_path_factory, "--model", str(path), "--max-num-seqs", "4", "--max-model-len", "512",
                            "--served-model-name", "tiny-qwen35")


@pytest.mark.extended
def test_hybrid_gguf_serves_concurrent_chats(hybrid_url):
    client = openai.OpenAI(base_url=hybrid_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == ["tiny-qwen35"]

    def ask(i):
        return client.chat.completions.create(model="tiny-qwen35", temperature=0, max_tokens=12,
                                              messages=[{"role": "user", "content": f"Count to {i} please." * (i + 1)}])
    with cf.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, range(4)))
    for r in replies:
        assert r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 10
    alone = ask(2)                                     # greedy: the same reply as inside the batch of four
    assert alone.choices[0].message.content == replies[2].choices[0].message.content
    stream = client.chat.completions.create(model="tiny-qwen35", temperature=0, max_tokens=12, stream=True,
                                            messages=[{"role": "user", "content": "Count to 2 please." * 3}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == replies[2].choices[0].message.content


def test_plan_shows_the_state_pool(hybrid_gguf):
    out = subprocess.run([sys.executable, "-m", "scripts.serve", "--model", str(hybrid_gguf), "--plan",
                          "--max-num-seqs", "4", "--max-model-len", "512"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "qwen3_5" in out.stdout and "state pool:" in out.stdout and "Gated DeltaNet" in out.stdout
