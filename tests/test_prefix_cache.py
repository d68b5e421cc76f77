"""The prefix cache: greedy output is token-identical whether a prefix was computed, shared from
cached device blocks (whole or copy-on-write), or brought back from the RAM tier; a continuing
conversation resumes from the end of the previous reply; hybrids resume from state snapshots;
the RAM tier gives memory back under pressure and takes it again."""
import logging
import re

import numpy as np
import pytest

from infernix_jax.engine import Engine, Request, SamplingParams
from infernix_jax.cache.block_manager import BlockManager
from infernix_jax.cache.host_tier import GiB, HostTier
from infernix_jax.engine.sequence import Sequence
from test_engine import tiny  # noqa: F401  (fixture)
from test_engine_hybrid import hybrid  # noqa: F401  (fixture)

N_NEW = 8


def greedy(n=N_NEW):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def texts():
    rng = np.random.default_rng(3)
    system = list(map(int, rng.integers(10, 40000, 70)))           # shared by every prompt: 4 blocks + 6
    tails = [list(map(int, rng.integers(10, 40000, n))) for n in (5, 23, 40, 1)]
    return system, [system + t for t in tails]


def run(eng, prompts, n=N_NEW):
    return eng.generate([Request(p, greedy(n)) for p in prompts])


def uncached(model, prompts, n=N_NEW, kv_dtype=""):
    eng = Engine(model, max_num_seqs=1, max_num_batched_tokens=64, decode_steps=1, prefix_cache=False,
                 kv_dtype=kv_dtype)
    return [r.token_ids for r in run(eng, prompts, n)]


# quantized KV too: each token's codes depend on its own K/V only (kv_quant), so a block reused
# from the cache holds exactly what a fresh prefill would write, however it was chunked
KV_DTYPES = ["", "int8", "k8v4"]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_shared_prefix_reused_from_device_blocks(tiny, texts, kv_dtype):
    system, prompts = texts
    want = uncached(tiny, prompts, kv_dtype=kv_dtype)
    eng = Engine(tiny, max_num_seqs=4, max_num_batched_tokens=64, decode_steps=2, kv_dtype=kv_dtype)
    first = run(eng, prompts[:1])[0]
    assert first.cached_tokens == 0 and first.token_ids == want[0]
    rest = run(eng, prompts[1:])                  # concurrently, all sharing the system prompt's blocks
    assert [r.token_ids for r in rest] == want[1:]
    # 70 shared tokens: 4 whole blocks shared, 6 tokens of the fifth copied (copy-on-write)
    assert [r.cached_tokens for r in rest] == [70, 70, 70]
    assert eng.cache.stats["device"] >= 3 * 70
    assert eng.bm.num_free == eng.bm.num_blocks and all(r == 0 for r in eng.bm.ref)


def test_resent_prompt_computes_only_its_last_token(tiny, texts):
    _, prompts = texts
    eng = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, decode_steps=2)
    a = run(eng, prompts[2:3])[0]
    b = run(eng, prompts[2:3])[0]
    assert b.token_ids == a.token_ids == uncached(tiny, prompts[2:3])[0]
    assert b.cached_tokens == len(prompts[2]) - 1


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("n", [13, 20])     # the reply ends with its last dispatch / inside it, on a new block
def test_next_turn_resumes_from_the_end_of_the_reply(tiny, texts, n, kv_dtype):
    _, prompts = texts
    eng = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, decode_steps=3, kv_dtype=kv_dtype)
    turn1 = run(eng, prompts[1:2], n=n)[0]
    follow = prompts[1] + turn1.token_ids + [11, 12, 13, 14, 15]
    turn2 = run(eng, [follow])[0]
    # everything computed before is reused: the prompt and the reply but its last token (never fed)
    assert turn2.cached_tokens == len(prompts[1]) + n - 1
    assert turn2.token_ids == uncached(tiny, [follow], kv_dtype=kv_dtype)[0]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_evicted_blocks_come_back_from_the_ram_tier(tiny, texts, kv_dtype):
    from infernix_jax.models.kv_pool import kv_bytes_per_block
    system, prompts = texts
    per_block = kv_bytes_per_block(tiny.cfg, tiny.dtype, kv_dtype, 16)
    eng = Engine(tiny, max_num_seqs=1, max_num_batched_tokens=64, decode_steps=2, max_model_len=128,
                 kv_cache_gib=10 * per_block / GiB, prefix_cache_ram_gib=64 * per_block / GiB, kv_dtype=kv_dtype,
                 ram_resize="off")
    assert eng.bm.num_blocks == 10
    want = uncached(tiny, prompts[:2], kv_dtype=kv_dtype)
    assert run(eng, prompts[:1])[0].token_ids == want[0]
    rng = np.random.default_rng(9)
    for _ in range(3):                            # unrelated prompts push the system prompt off the device
        run(eng, [list(map(int, rng.integers(10, 40000, 100)))], n=2)
    assert not any(m.tokens == tuple(system[:16]) for m in eng.bm.meta.values())
    assert eng.cache.host.captured > 0
    got = run(eng, prompts[1:2])[0]
    assert got.token_ids == want[1]
    assert got.cached_tokens == 70 and eng.cache.stats["ram"] >= 70


def test_a_failure_while_admitting_a_cache_hit_fails_that_request_only(tiny, texts):
    import queue
    system, prompts = texts
    want = uncached(tiny, prompts[:2])
    eng = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, decode_steps=1)
    run(eng, prompts[:1])                          # the shared system prompt is cached now
    commit, calls = eng.cache.commit, []

    def failing_commit(seq, hit):                  # the hit's blocks are taken, then something breaks
        commit(seq, hit)
        calls.append(seq)
        if len(calls) == 1:
            raise RuntimeError("injected")
    eng.cache.commit = failing_commit
    def ask(prompt):
        q = queue.Queue()
        eng.submit(Request(prompt, greedy(), on_event=q.put))
        ids = []
        while True:
            ev = q.get(timeout=120)
            ids += ev.token_ids
            if ev.kind in ("done", "error"):
                return ev.kind, ids
    eng.start(warmup=False)
    try:
        assert ask(prompts[1])[0] == "error"       # the one being admitted fails ...
        assert ask(prompts[1]) == ("done", want[1])     # ... the next is served (the pool was reset)
        assert ask(prompts[0]) == ("done", want[0])
    finally:
        eng.stop()
    assert len(calls) == 2                         # the third one reuses the second one's blocks
    assert eng.bm.num_free == eng.bm.num_blocks     # nothing leaked


def test_eviction_takes_leaves_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    evicted = []
    bm.on_evict = lambda b, meta: evicted.append(meta.tokens)
    s = Sequence(Request([1, 2, 3, 4, 5, 6, 7], greedy()), None, set())
    bm.grow(s, 7)
    s.num_computed = 7
    bm.seal_full_blocks(s)
    bm.release(s)                                 # 3 full blocks and the partial [7] stay cached
    assert bm.num_cached == 4 and len(bm.free) == 2
    for _ in range(4):
        bm.take()
    assert evicted == [(7,), (5, 6)]                 # the last blocks first
    assert bm.num_cached == 2


def test_ram_tier_gives_memory_back_and_takes_it_again(caplog):
    avail = [8 * GiB]
    tier = HostTier(4 * GiB, "auto", reserve_bytes=2 * GiB, available=lambda: avail[0])

    class M:
        def __init__(self, key):
            self.key, self.parent, self.tokens = key, 0, (key,)
    block = GiB // 4
    for p in range(3):                             # three pieces of 4 blocks, as read off the device
        tier.add([M(4 * p + i) for i in range(4)], np.zeros((4, 1, 1, 1, 1)), np.zeros((4, 1, 1, 1, 1)), block)
    assert tier.used == 3 * GiB and tier.limit == 4 * GiB
    tier.get(1)                                    # a block of the oldest piece is used again
    with caplog.at_level(logging.INFO, logger="infernix.cache"):
        avail[0] = int(0.5 * GiB)                  # pressure: 1.5 GiB short of the reserve
        tier.check_memory(now=10.0)
        assert tier.limit == int(1.5 * GiB) and tier.used <= tier.limit
        assert set(tier.entries) == {0, 1, 2, 3}        # whole pieces go, least recently used first
        tier.check_memory(now=10.5)               # at most once a second
        assert tier.limit == int(1.5 * GiB)
        avail[0] = 16 * GiB                       # memory is back: grow to the configured size
        tier.check_memory(now=12.0)
        assert tier.limit == 4 * GiB
    assert "shrinking" in caplog.text and "growing" in caplog.text
    tier.add([M(100 + i) for i in range(4)], np.ones((4, 1, 1, 1, 1)), np.ones((4, 1, 1, 1, 1)), block)
    assert tier.used == 2 * GiB and len(tier) == 8       # grown back: nothing had to go
    assert HostTier(GiB, "off").resize == "off"
    with pytest.raises(ValueError, match="ram-resize"):
        HostTier(GiB, "sometimes")


@pytest.mark.extended
@pytest.mark.parametrize("decode_steps", [1, 3])
def test_hybrid_next_turn_resumes_from_a_state_snapshot(hybrid, decode_steps):
    rng = np.random.default_rng(5)
    prompt = list(map(int, rng.integers(10, 40000, 150)))
    eng = Engine(hybrid, max_num_seqs=2, max_num_batched_tokens=48, decode_steps=decode_steps)
    turn1 = run(eng, [prompt], n=9)[0]
    follow = prompt + turn1.token_ids + [21, 22, 23]
    turn2 = run(eng, [follow])[0]
    # the snapshot taken where turn 1 ended: with 3-step dispatches it ends inside one (at its
    # length limit), where the device stopped updating its state
    assert turn2.cached_tokens == 150 + 9 - 1
    other = prompt[:140] + [7, 7, 7]                  # diverges inside block 9: the 128-token snapshot
    third = run(eng, [other])[0]
    assert third.cached_tokens == 128
    assert [turn2.token_ids, third.token_ids] == uncached(hybrid, [follow, other])
    assert eng.bm.num_free == eng.bm.num_blocks


@pytest.mark.extended
def test_hybrid_reply_ending_on_a_stop_token_inside_a_dispatch_leaves_its_snapshot(hybrid):
    rng = np.random.default_rng(7)
    prompt = list(map(int, rng.integers(10, 40000, 150)))
    ref = uncached(hybrid, [prompt], n=12)[0]
    # a stop token that ends the reply inside a 3-token dispatch (token 1 comes from the prefill)
    i = next(i for i in range(4, 11) if ref[i] not in ref[:i] and (i + 1) % 3 != 1)
    eng = Engine(hybrid, max_num_seqs=2, max_num_batched_tokens=48, decode_steps=3)
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[ref[i]])
    turn1 = eng.generate([Request(prompt, p)])[0]
    assert turn1.token_ids == ref[:i + 1] and turn1.finish_reason == "stop"
    follow = prompt + turn1.token_ids + [21, 22, 23]
    turn2 = run(eng, [follow])[0]
    assert turn2.cached_tokens == 150 + i      # resumed where the stop token ended turn 1
    assert turn2.token_ids == uncached(hybrid, [follow])[0]


@pytest.mark.extended
def test_hybrid_snapshot_comes_back_from_the_ssd_tier(hybrid, tmp_path):
    from infernix_jax.cache.ssd_tier import SNAP
    rng = np.random.default_rng(6)
    prompt = list(map(int, rng.integers(10, 40000, 150)))
    eng = Engine(hybrid, max_num_seqs=2, max_num_batched_tokens=48, decode_steps=1, state_snapshots=2,
                 ssd_context_gib=0.01, ssd_context_dir=str(tmp_path))
    turn1 = run(eng, [prompt], n=9)[0]
    for _ in range(2):                      # their snapshots push turn 1's out of RAM, onto the SSD
        run(eng, [list(map(int, rng.integers(10, 40000, 140)))], n=2)
    eng.cache.ssd.flush()
    assert sum(1 for k in eng.cache.ssd.index if k & SNAP) >= 3
    follow = prompt + turn1.token_ids + [21, 22, 23]
    eng.cache.costs.read_bps, eng.cache.costs.prefill_tps = 1e3, 1e6   # a slow disk: the snapshot is still worth it
    turn2 = run(eng, [follow])[0]
    assert turn2.cached_tokens == 150 + 9 - 1     # the snapshot taken where turn 1 ended, read back
    assert turn2.token_ids == uncached(hybrid, [follow])[0]
    eng.close()


def test_server_reports_cached_prompt_tokens(server_url):
    """The second turn of a conversation over the real server: the SDKs see the cached tokens."""
    import anthropic
    import httpx
    import openai
    oa = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    msgs = [{"role": "system", "content": "You are a terse assistant who answers about geography. " * 6},
            {"role": "user", "content": "Name a river in Spain."}]
    first = oa.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=8)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And one in Portugal?"}]
    second = oa.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 16 <= cached < second.usage.prompt_tokens
    claude = anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0, timeout=300)
    m = claude.messages.create(model="m", max_tokens=4, system=msgs[0]["content"], messages=msgs[1:2],
                               extra_body={"temperature": 0})
    assert m.usage.cache_read_input_tokens >= first.usage.prompt_tokens - 16
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == first.usage.prompt_tokens
    # Completions with two prompts: cached tokens are summed over the prompts, streamed or not
    two = ["The Tagus flows through Toledo and Lisbon. " * 12, "The Douro rises in Soria. " * 12]
    oa.completions.create(model="m", prompt=two, max_tokens=2, temperature=0)
    again = oa.completions.create(model="m", prompt=two, max_tokens=2, temperature=0)
    chunks = list(oa.completions.create(model="m", prompt=two, max_tokens=2, temperature=0, stream=True,
                                        stream_options={"include_usage": True}))
    streamed = chunks[-1].usage
    assert streamed.prompt_tokens == again.usage.prompt_tokens > 64
    assert streamed.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens \
        >= again.usage.prompt_tokens - 32
    metrics = httpx.get(server_url + "/metrics", timeout=30).text
    hits = float(re.search(r"^infernix_prefix_cache_hit_tokens_total (\S+)$", metrics, re.M).group(1))
    assert hits >= cached + m.usage.cache_read_input_tokens


# ---- SSD tier and the cache file ---------------------------------------------------------------
class Blk:
    def __init__(self, key, parent=0, tokens=(1, 2), seed=0):
        rng = np.random.default_rng(seed)
        self.key, self.parent, self.tokens = key, parent, tokens
        self.k, self.v = rng.standard_normal((2, 3, 4, 8)).astype(np.float32), rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
        self.nbytes = self.k.nbytes + self.v.nbytes

    def arrays(self):
        return self.k, self.v


def ssd_tier(tmp_path, gib=1.0, per_hour=8.0, clock=None):
    from infernix_jax.cache.ssd_tier import SSDTier
    kw = {"clock": clock} if clock else {}
    return SSDTier(str(tmp_path), int(gib * GiB), per_hour, block_shape=(2, 3, 4, 8), dtype=np.float32, **kw)


def test_ssd_records_round_trip_and_a_corrupt_one_is_a_miss(tmp_path):
    ssd = ssd_tier(tmp_path)
    blocks = [Blk(i + 1, seed=i) for i in range(5)]
    for b in blocks:
        ssd.put(b)
    got = ssd.get(3)                               # races its write: waits for it
    np.testing.assert_array_equal(got.arrays()[0], blocks[2].k)
    ssd.flush()
    for b in blocks:
        k, v = ssd.get(b.key).arrays()
        np.testing.assert_array_equal(k, b.k)
        np.testing.assert_array_equal(v, b.v)
    from infernix_jax.cache.ssd_tier import HEADER
    where = {4: lambda n: n // 2,                  # inside the compressed payload
             2: lambda n: HEADER.size + 1,         # a token
             1: lambda n: n - 1}                   # the payload's checksum itself
    for key, at in where.items():
        off, n = ssd.index[key]
        with open(ssd.path, "r+b") as f:           # flip one byte of the record
            f.seek(off + at(n))
            byte = f.read(1)
            f.seek(off + at(n))
            f.write(bytes([byte[0] ^ 0xFF]))
    for key in where:
        assert ssd.get(key) is None and key not in ssd
    assert ssd.corrupt == 3
    assert ssd.get(5) is not None                  # its neighbours are fine
    ssd.close()


def test_ssd_write_budget_holds_and_the_ring_wraps(tmp_path):
    now = [0.0]
    rec = len(ssd_tier(tmp_path / "probe")._record(Blk(1)))
    # 8.5 records' worth of budget per 5 minutes (the bucket), a ring of 6.5 records (same-size records)
    per_hour = 8.5 * rec * 12 / GiB
    ssd = ssd_tier(tmp_path, gib=6.5 * rec / GiB, per_hour=per_hour, clock=lambda: now[0])
    for i in range(12):
        ssd.put(Blk(100 + i))
    ssd.flush()
    assert ssd.written_bytes <= 8 * rec and ssd.dropped == 4
    assert len(ssd.index) == 6                     # the ring holds 6: the first two were overwritten
    assert 100 not in ssd and 101 not in ssd and ssd.get(107) is not None
    now[0] += 300                                  # five minutes later the budget is back
    ssd.put(Blk(200))
    ssd.flush()
    assert 200 in ssd and ssd.get(200) is not None
    ssd.close()


@pytest.mark.extended
@pytest.mark.parametrize("disk,kv_dtype", [("fast", ""), ("slow", ""), ("fast", "int8"), ("fast", "k8v4")])
def test_evicted_blocks_come_back_from_the_ssd_tier(tiny, texts, tmp_path, disk, kv_dtype):
    from infernix_jax.models.kv_pool import kv_bytes_per_block
    system, prompts = texts
    per_block = kv_bytes_per_block(tiny.cfg, tiny.dtype, kv_dtype, 16)
    eng = Engine(tiny, max_num_seqs=1, max_num_batched_tokens=64, decode_steps=2, max_model_len=128,
                 kv_cache_gib=10 * per_block / GiB, prefix_cache_ram_gib=2 * per_block / GiB, ram_resize="off",
                 ssd_context_gib=0.01, ssd_context_dir=str(tmp_path), kv_dtype=kv_dtype)
    want = uncached(tiny, prompts[:2], kv_dtype=kv_dtype)
    assert run(eng, prompts[:1])[0].token_ids == want[0]
    rng = np.random.default_rng(9)
    for _ in range(3):                             # device -> RAM (2 blocks) -> SSD
        run(eng, [list(map(int, rng.integers(10, 40000, 100)))], n=2)
    eng.cache.ssd.flush()
    assert eng.cache.ssd.written_bytes > 0
    assert all(p._np is None for p in eng.cache.host.pieces.values())     # numpy copies only while writing
    if disk == "slow":      # measured: reading the SSD is slower than prefilling: compute instead
        eng.cache.costs.read_bps, eng.cache.costs.prefill_tps = 1e3, 1e6
    got = run(eng, prompts[1:2])[0]
    assert got.token_ids == want[1]
    if disk == "fast":
        assert got.cached_tokens == 70 and eng.cache.stats["ssd"] > 0
        assert eng.cache.costs.read_bps > 0
    else:
        assert got.cached_tokens < 70 and eng.cache.stats["ssd"] == 0 and eng.cache.stats["ssd_skipped"] > 0
    eng.close()


@pytest.mark.extended
def test_ssd_read_runs_while_others_decode(tiny, texts, tmp_path):
    import threading
    system, prompts = texts
    per_block = 2 * tiny.cfg.num_layers * tiny.cfg.num_kv_heads * tiny.cfg.head_dim * 4 * 16
    eng = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, decode_steps=1, max_model_len=128,
                 kv_cache_gib=12 * per_block / GiB, prefix_cache_ram_gib=2 * per_block / GiB, ram_resize="off",
                 ssd_context_gib=0.01, ssd_context_dir=str(tmp_path))
    want = uncached(tiny, prompts[1:2])[0]
    run(eng, prompts[:1])
    rng = np.random.default_rng(9)
    for _ in range(3):                             # the system prompt's blocks go down to the SSD
        run(eng, [list(map(int, rng.integers(10, 40000, 100)))], n=2)
    eng.cache.ssd.flush()
    gate, read = threading.Event(), eng.cache.ssd.get_many
    eng.cache.ssd.get_many = lambda keys: (gate.wait(30), read(keys))[1]      # a slow disk
    other = eng.add(Request([5, 6, 7], greedy(30)))
    eng.step()
    seq = eng.add(Request(prompts[1], greedy()))
    for _ in range(5):
        eng.step()
    assert seq.fetching is not None and not seq.admitted      # waiting for its read ...
    assert len(other.out_ids) >= 5                            # ... while the other one decodes
    gate.set()
    seq.fetching.result(timeout=30)
    eng.step()
    assert seq.admitted and seq.num_cached == 70
    while seq.status.name == "RUNNING" or other.status.name == "RUNNING":
        eng.step()
    assert seq.out_ids == want
    eng.close()


def test_costs_read_the_disk_only_when_it_beats_computing():
    from infernix_jax.cache.prefix_cache import Costs
    now = [0.0]
    c = Costs(retry_s=600, clock=lambda: now[0])
    assert c.disk_pays(10 ** 9, 1000)              # nothing measured yet: read
    c.disk_read(10 ** 9, 1.0)                      # 1 GB/s
    c.prefill(100, 1.0)                            # too short a step to count
    assert c.prefill_tps is None
    c.prefill(10_000, 1.0)                         # 10K tokens/s
    assert not c.disk_pays(10 ** 9, 1000)          # 1 s to read vs 0.1 s to compute
    assert c.disk_pays(10 ** 8, 10_000)            # 0.1 s to read vs 1 s to compute
    now[0] = 601.0                                 # long since the last read: measure again
    assert c.disk_pays(10 ** 9, 1000)


@pytest.mark.extended
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cache_file_resumes_after_a_restart(tiny, texts, tmp_path, caplog, kv_dtype):
    _, prompts = texts
    path = str(tmp_path / "cache.npz")
    eng = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, decode_steps=2, prefix_cache_file=path,
                 kv_dtype=kv_dtype)
    first = run(eng, prompts[2:3])[0]
    eng.close()
    again = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, decode_steps=2, prefix_cache_file=path,
                   kv_dtype=kv_dtype)
    assert len(again.cache.host) > 0
    got = run(again, prompts[2:3])[0]
    assert got.token_ids == first.token_ids and got.cached_tokens == len(prompts[2]) - 1
    again.close()
    if kv_dtype:                 # the file of one KV format is not read as another's
        with caplog.at_level(logging.WARNING, logger="infernix.cache"):
            plain = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, prefix_cache_file=path)
            assert len(plain.cache.host) == 0 and "ignored" in caplog.text
        return
    with caplog.at_level(logging.WARNING, logger="infernix.cache"):
        other = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, block_size=8, prefix_cache_file=path)
        assert len(other.cache.host) == 0 and "ignored" in caplog.text          # stale: another block size
        with open(path, "r+b") as f:
            f.truncate(100)
        caplog.clear()
        broken = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=64, prefix_cache_file=path)
        assert len(broken.cache.host) == 0 and "cannot be read" in caplog.text
    assert run(broken, prompts[2:3])[0].token_ids == first.token_ids


@pytest.mark.extended
@pytest.mark.parametrize("turn", [0.0, 1.0])
def test_requests_take_turns_under_kv_pressure(tiny, turn):
    """Four requests that need 10 blocks each in a pool of 20: with fair turns every request makes
    progress within a bounded number of steps; without, the last ones wait for the first to end.
    The clock is the engine's step count (a turn: 4 steps of output)."""
    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(10, 40000, 60))) for _ in range(4)]
    per_block = 2 * tiny.cfg.num_layers * tiny.cfg.num_kv_heads * tiny.cfg.head_dim * 4 * 16
    eng = Engine(tiny, max_num_seqs=4, max_num_batched_tokens=64, decode_steps=2, max_model_len=176,
                 kv_cache_gib=20 * per_block / GiB, fair_turn_s=turn)
    steps = [0]
    eng.scheduler.clock = lambda: steps[0] / 4
    last = [0] * 4
    silent = [0] * 4
    seqs = [eng.add(Request(p, greedy(100))) for p in prompts]
    while any(s.finish_reason is None for s in seqs):
        before = [len(s.out_ids) for s in seqs]
        eng.step()
        steps[0] += 1
        for i, s in enumerate(seqs):
            if len(s.out_ids) > before[i] or s.finish_reason is not None:
                last[i] = steps[0]
            elif any(len(t.out_ids) > b for t, b in zip(seqs, before)):
                silent[i] = max(silent[i], steps[0] - last[i])    # silent while another one progresses
    assert [s.out_ids for s in seqs] == uncached(tiny, prompts, 100)
    if turn:
        assert eng.scheduler.num_rotations > 0 and max(silent) <= 16     # measured: 9 each
    else:
        assert max(silent) > 60                       # the last requests waited for the first to finish (81)
    assert eng.bm.num_free == eng.bm.num_blocks


def test_a_block_copy_sees_the_upload_before_it(tiny):
    """In one schedule the RAM tier's uploads run before the device tier's block copies, both
    through the runner, which owns the pool: a copy of a block just uploaded copies what came in."""
    eng = Engine(tiny, max_num_seqs=1, max_model_len=64)
    (k, v, _, _), = eng.runner.read_blocks([0])                         # one block's layout, [1, L, nKV, bs, hd]
    eng.runner.write_rows(np.ones_like(k), np.full_like(v, 2.0), [0], [1])
    eng.runner.copy_blocks([(1, 2)])
    kv = eng.runner.kv
    assert all(bool((x[:, 2] == 1.0).all()) for x in kv.k) and all(bool((x[:, 2] == 2.0).all()) for x in kv.v)
