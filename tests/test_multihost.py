"""Several hosts on one machine: two processes of two CPU devices each join through jax.distributed
(gloo between them) and run one model over a mesh of all four devices (infernix_jax/distributed.py).
Process 0 schedules and writes (infernix-generate) or serves (infernix-serve); process 1 replays its
steps. The output is the one process's on one device, and process 1 ends when process 0 does."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.extended      # (several processes: `pytest -m extended`)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int) -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}


def spawn(mod: str, args: list, pid: int, port: int, tp: int = 4):
    return subprocess.Popen([sys.executable, "-m", mod, *args, "--tp", str(tp), "--coordinator", f"127.0.0.1:{port}",
                             "--num-processes", "2", "--process-id", str(pid)], env=env(2),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_generate_on_two_processes_matches_one_device(smollm, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "The capital of France is", "max_tokens": 8}\n'
                   '{"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6}\n'
                   '{"prompt": 5}\n')                          # a bad line: reported, the rest go on
    one = subprocess.run([sys.executable, "-m", "scripts.generate", "--input", str(src), "--output",
                          str(tmp_path / "one.jsonl")], env=env(1), capture_output=True, text=True, timeout=300)
    assert one.returncode == 1, one.stderr              # (the exit-code rule: some lines failed)
    port = free_port()
    args = ["--input", str(src), "--output", str(tmp_path / "two.jsonl")]
    follower = spawn("scripts.generate", args, 1, port)
    leader = spawn("scripts.generate", args, 0, port)
    try:
        assert leader.wait(timeout=400) == 1, leader.stderr.read()            # the bad line, as above
        assert follower.wait(timeout=60) == 0, follower.stderr.read()         # (it reads no input)
    finally:
        for p in (leader, follower):
            p.kill()
    want = [json.loads(ln) for ln in (tmp_path / "one.jsonl").read_text().splitlines()]
    got = [json.loads(ln) for ln in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert got == want and want[0]["completion_tokens"] == 8 and "error" in want[2]


def test_serve_on_two_processes(smollm):
    port, http = free_port(), free_port()
    args = ["--port", str(http), "--max-num-seqs", "2", "--max-model-len", "512"]
    follower = spawn("scripts.serve", args, 1, port)
    leader = spawn("scripts.serve", args, 0, port)
    try:
        deadline = time.time() + 300
        while True:
            assert leader.poll() is None, leader.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(1)
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == " Paris.\n\nThe answer is:"
        leader.send_signal(signal.SIGINT)                      # the leader stops; so does the follower
        # (after the step in flight: under the extended run's load, a warm-up compile can take a minute+)
        assert leader.wait(timeout=240) is not None
        assert follower.wait(timeout=120) == 0, follower.stderr.read()
    finally:
        for p in (leader, follower):
            p.kill()


def test_a_mesh_must_cover_every_process_s_devices(smollm, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    port, args = free_port(), ["--input", str(src), "--output", str(tmp_path / "out.jsonl")]
    procs = [spawn("scripts.generate", args, pid, port, tp=2) for pid in (1, 0)]
    try:
        for p in procs:
            assert p.wait(timeout=300) == 2
            err = p.stderr.read()
            assert "must cover every device of every process (4), got 2" in err and "Traceback" not in err, err
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("flags, msg", [(["--coordinator", "127.0.0.1:1"], "need --coordinator HOST:PORT, --num-processes"),
                                        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
                                         "--process-id must be in [0, 2)")])
def test_bad_multihost_flags_are_one_line_errors(flags, msg, tmp_path):
    r = subprocess.run([sys.executable, "-m", "scripts.serve", "--port", "1", *flags], env=env(1),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_prefix_cache_tiers_on_two_processes(smollm, tmp_path):
    """Every tier of the prefix cache with the model over both processes' devices (multihost_cache.py):
    a shared prefix pushed off the device comes back from the RAM tier with its state snapshot from
    the SSD, and after a restart from the cache file; the same tokens as one device without a cache."""
    from multihost_cache import model_, prompts
    from infernix_jax.engine import Engine, Request, SamplingParams
    driver = os.path.join(os.path.dirname(__file__), "multihost_cache.py")
    for phase in ("first", "again"):
        port = free_port()
        procs = [subprocess.Popen([sys.executable, driver, str(rank), str(port), str(tmp_path), phase], env=env(2),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
        try:
            for p in procs:
                assert p.wait(timeout=400) == 0, p.stderr.read()
        finally:
            for p in procs:
                p.kill()
    first, again = (json.loads((tmp_path / f"{phase}.json").read_text()) for phase in ("first", "again"))
    shared, _ = prompts()
    eng = Engine(model_(), max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128, prefix_cache=False)
    want = [r.token_ids for r in eng.generate([Request(q, SamplingParams(max_tokens=4, temperature=0,
                                                                          ignore_eos=True)) for q in shared])]
    assert first["first"] == want[0] and first["evicted"] and first["snapshot_on_ssd"]
    assert first["second"] == again["second"] == want[1]
    assert first["cached"] == again["cached"] == 64            # the shared prefix, resumed from its snapshot
    assert first["stats"]["ram"] >= 64 and again["loaded"] > 0 and again["stats"]["ram"] >= 64
