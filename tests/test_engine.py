"""The paged engine: equality with the single-request path under continuous batching, chunked
prefill, preemption and cancellation; seeds; block accounting; a bounded number of compilations."""
import threading

import jax
import numpy as np
import pytest

from infernix_jax.engine import Engine, Request, SamplingParams
from infernix_jax.engine import steps
from infernix_jax.loader import LoadedModel
from infernix_jax.models import init_params


def chat(tok, text):
    return tok.encode_chat([{"role": "user", "content": text}])


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, **kw)


@pytest.fixture(scope="module")
def tiny(smollm):
    """A small random Llama with SmolLM2's vocabulary and tokenizer: fast to compile, so that
    engine behaviour can be checked at many shapes."""
    import dataclasses
    cfg = dataclasses.replace(smollm.cfg, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.5)
    return LoadedModel(name="tiny", path=smollm.path, cfg=cfg, params=params, tokenizer=smollm.tokenizer,
                       dtype=smollm.dtype)


def alone(model, prompts, n, **engine_kw):
    """The single-request path: each prompt on its own engine step sequence, no chunking."""
    eng = Engine(model, max_num_seqs=1, max_num_batched_tokens=256, chunked_prefill=False, decode_steps=1,
                 **engine_kw)
    return [eng.generate([Request(p, greedy(n, ignore_eos=True))])[0].token_ids for p in prompts]


def random_prompts(rng, count, lo=3, hi=120, vocab=49152):
    return [list(map(int, rng.integers(10, vocab - 10, rng.integers(lo, hi)))) for _ in range(count)]


@pytest.mark.parametrize("chunked", [True, False])
def test_16_concurrent_requests_equal_the_single_request_path(tiny, chunked):
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, 16)
    ref = alone(tiny, prompts, 12)
    eng = Engine(tiny, max_num_seqs=6, max_num_batched_tokens=48, chunked_prefill=chunked, decode_steps=3)
    got = eng.generate([Request(p, greedy(12, ignore_eos=True)) for p in prompts])
    assert [r.token_ids for r in got] == ref
    assert eng.bm.num_free == eng.bm.num_blocks


def test_preemption_under_a_small_pool_keeps_outputs(tiny):
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, 8, 40, 90)
    ref = alone(tiny, prompts, 20)
    eng = Engine(tiny, max_num_seqs=8, max_num_batched_tokens=64, decode_steps=2,
                 kv_cache_gib=20 * 16 * 2 * 2 * 2 * 16 * 4 / 2**30)   # 20 blocks: forces preemption
    got = eng.generate([Request(p, greedy(20, ignore_eos=True)) for p in prompts])
    assert eng.scheduler.num_preemptions > 0
    assert [r.token_ids for r in got] == ref
    assert eng.bm.num_free == eng.bm.num_blocks


def test_cancelled_requests_free_blocks_and_others_are_unharmed(tiny):
    rng = np.random.default_rng(2)
    prompts = random_prompts(rng, 10)
    ref = alone(tiny, prompts, 16)
    eng = Engine(tiny, max_num_seqs=4, max_num_batched_tokens=32, decode_steps=2)
    reqs = [Request(p, greedy(16, ignore_eos=True)) for p in prompts]
    counts = {}

    def canceller(r):
        def on_event(ev):
            counts[r.id] = counts.get(r.id, 0) + 1
            if counts[r.id] == 3:
                r.cancel()
        return on_event
    for r in reqs[::3]:
        r.on_event = canceller(r)
    reqs[1].cancel()  # cancelled before it ever runs
    got = eng.generate(reqs)
    for i, (r, g) in enumerate(zip(reqs, got)):
        if r.cancelled.is_set():
            assert g.finish_reason == "abort" and len(g.token_ids) < 16
        else:
            assert g.token_ids == ref[i] and g.finish_reason == "length"
    assert eng.bm.num_free == eng.bm.num_blocks and not eng.scheduler.has_work()


def test_same_seed_same_text_alone_or_in_a_batch_of_8(tiny):
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, 8)
    sp = dict(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    eng = Engine(tiny, max_num_seqs=8, max_num_batched_tokens=64, decode_steps=4)
    solo = Engine(tiny, max_num_seqs=1, decode_steps=1).generate([Request(prompts[5], SamplingParams(seed=42, **sp))])
    batch = eng.generate([Request(p, SamplingParams(seed=42 if i == 5 else i, **sp)) for i, p in enumerate(prompts)])
    assert batch[5].token_ids == solo[0].token_ids
    assert len({tuple(r.token_ids) for r in batch}) > 1


def test_logprobs_and_top_logprobs(tiny):
    eng = Engine(tiny, max_num_seqs=2, decode_steps=2)
    r = eng.generate([Request([5, 6, 7, 8], greedy(5, ignore_eos=True, logprobs=True, top_logprobs=3))])[0]
    assert len(r.logprobs) == 5
    for tok, lp, alts in r.logprobs:
        assert len(alts) == 3 and alts[0][0] == tok and abs(alts[0][1] - lp) < 1e-5  # greedy: top-1
        assert lp <= 0 and alts[0][1] >= alts[1][1] >= alts[2][1]


@pytest.mark.extended
def test_prompt_logprobs_match_a_full_forward(tiny):
    """prompt_logprobs: each prompt token's logprob after the tokens before it (and the best
    alternatives there), equal to a whole-sequence forward's, whether the prompt is prefilled in one
    piece or in chunks, and a prompt whose blocks sit in the prefix cache is computed all the same."""
    import jax.numpy as jnp
    from infernix_jax.engine.steps import full_logprobs
    from infernix_jax.models import init_cache
    prompt = random_prompts(np.random.default_rng(5), 1, 70, 71)[0]
    want = np.asarray(full_logprobs(tiny.params, tiny.cfg, jnp.asarray([prompt], jnp.int32),
                                    init_cache(tiny.cfg, 1, 80, tiny.dtype)))[0]          # [T, V]
    for chunk in (256, 16):
        eng = Engine(tiny, max_num_seqs=2, max_num_batched_tokens=chunk)
        for again in (False, True):          # (the second run: the prompt's blocks are cached)
            r = eng.generate([Request(prompt, greedy(2, prompt_logprobs=3))])[0]
            assert r.cached_tokens == 0 and [e[0] for e in r.prompt_logprobs] == prompt[1:]
            got = np.asarray([e[1] for e in r.prompt_logprobs])
            assert np.allclose(got, want[np.arange(69), prompt[1:]], atol=2e-4), (chunk, again)
            for p, (_, _, alts) in enumerate(r.prompt_logprobs):
                assert [a for a, _ in alts] == list(np.argsort(-want[p], kind="stable")[:3])
    assert eng.generate([Request(prompt, greedy(2))])[0].cached_tokens > 0    # (others still hit)


def test_min_p_one_is_greedy(tiny):
    eng = Engine(tiny, max_num_seqs=2)
    g = eng.generate([Request([9, 8, 7], greedy(8, ignore_eos=True))])[0]
    m = eng.generate([Request([9, 8, 7], SamplingParams(max_tokens=8, temperature=1.5, min_p=1.0, seed=1,
                                                        ignore_eos=True))])[0]
    assert m.token_ids == g.token_ids


def test_after_warmup_50_random_requests_compile_nothing(tiny):
    from conftest import compiles
    # (speculation off: verify steps are not warmed up yet; their shapes compile on first use)
    eng = Engine(tiny, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, decode_steps=4,
                 speculative="off")
    assert eng.warmup() > 0
    before = compiles()
    rng = np.random.default_rng(4)
    reqs = []
    for p in random_prompts(rng, 50, 1, 50):
        reqs.append(Request(p, SamplingParams(max_tokens=int(rng.integers(1, 64 - len(p) + 1)),
                                              temperature=float(rng.choice([0.0, 0.7])), ignore_eos=True)))
    eng.generate(reqs)
    assert compiles() == before
    assert eng.bm.num_free == eng.bm.num_blocks


def test_real_model_batched_greedy_equals_alone(smollm_engine, smollm):
    tok = smollm.tokenizer
    prompts = [chat(tok, q) for q in ("What is the capital of France?", "Name a color.", "Count to three.")]
    solo = [smollm_engine.generate([Request(p, greedy(12))])[0] for p in prompts]
    together = smollm_engine.generate([Request(p, greedy(12)) for p in prompts])
    assert [r.token_ids for r in together] == [r.token_ids for r in solo]
    assert "Paris" in solo[0].text


def test_stop_token_ids_and_ignore_eos(smollm_engine, smollm):
    p = chat(smollm.tokenizer, "What is the capital of France?")
    r = smollm_engine.generate([Request(p, greedy(40))])[0]
    assert r.finish_reason == "stop" and r.token_ids[-1] in smollm.tokenizer.eos_ids
    forced = smollm_engine.generate([Request(p, greedy(len(r.token_ids) + 3, ignore_eos=True))])[0]
    assert forced.finish_reason == "length" and len(forced.token_ids) == len(r.token_ids) + 3
    r2 = smollm_engine.generate([Request(p, greedy(40, stop_token_ids=(r.token_ids[1],)))])[0]
    assert r2.finish_reason == "stop" and r2.token_ids == r.token_ids[:2]


def test_events_stream_the_text(smollm_engine, smollm):
    p = chat(smollm.tokenizer, "Name three fruits.")
    events = []
    r = smollm_engine.generate([Request(p, SamplingParams(max_tokens=10, temperature=0.9, top_k=1, seed=3,
                                                          ignore_eos=True), on_event=events.append)])[0]
    assert r.token_ids == smollm_engine.generate([Request(p, greedy(10, ignore_eos=True))])[0].token_ids
    assert "".join(e.text for e in events if e.kind == "delta") == r.text
    assert events[-1].kind == "done" and events[-1].completion_tokens == 10


def test_device_thread_serves_queued_requests(tiny):
    eng = Engine(tiny, max_num_seqs=2)
    eng.start(warmup=False)
    done = threading.Event()
    got = []

    def on_event(ev):
        got.append(ev)
        if ev.kind == "done":
            done.set()
    eng.submit(Request([1, 2, 3], greedy(4), on_event=on_event))
    assert done.wait(120)
    eng.stop()
    assert got[-1].finish_reason in ("stop", "length")


def test_request_too_long_is_refused(tiny):
    eng = Engine(tiny, max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="context is 64 tokens"):
        eng.add(Request([1] * 60, greedy(10)))
    with pytest.raises(ValueError, match="top_p"):
        eng.add(Request([1, 2], SamplingParams(top_p=0)))


def greedy_by_impl(model, prompts) -> dict:
    """impl -> the greedy tokens of prompts, with the reference path and the Pallas kernels
    (interpret mode), on engines small enough to chunk prefills and batch decodes."""
    outs = {}
    for impl in ("reference", "pallas_interpret"):
        eng = Engine(model, max_num_seqs=3, max_num_batched_tokens=32, decode_steps=2, attn_impl=impl)
        outs[impl] = [r.token_ids for r in eng.generate([Request(p, greedy(4, ignore_eos=True)) for p in prompts])]
    return outs


@pytest.mark.extended
def test_pallas_kernels_in_the_engine_match_the_reference_path(tiny):
    """The engine with the Pallas kernels (interpret mode here) gives the reference path's tokens."""
    outs = greedy_by_impl(tiny, random_prompts(np.random.default_rng(5), 3, 5, 40))
    assert outs["pallas_interpret"] == outs["reference"]


@pytest.mark.extended
def test_grouped_expert_kernel_in_the_engine_matches_the_reference_path(tiny):
    """A tiny MoE model (8 experts, top-2, quantized experts too) in the engine: prefill chunks and
    decode steps through the grouped expert kernel (interpret mode) give the jnp paths' tokens."""
    import dataclasses

    from infernix_jax.quant.apply import quantize_params
    cfg = dataclasses.replace(tiny.cfg, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, decoder_sparse_step=1)
    moe = dataclasses.replace(tiny, cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(1), scale=0.5))
    prompts = random_prompts(np.random.default_rng(6), 3, 5, 40)
    for model in (moe, dataclasses.replace(moe, params=quantize_params(moe.params, "int8", progress=False))):
        outs = greedy_by_impl(model, prompts)
        assert outs["pallas_interpret"] == outs["reference"]


def test_no_kv_is_written_past_a_stop_token(tiny):
    """A multi-step decode dispatch goes on past a row's stop token; the row's later steps write no
    K/V (junk the host drops: with --kv-dtype bf16p it could overflow a block's escapes and fail a
    finished request). Fresh pools are zeros: only the prompt and the first output token's rows
    may hold K/V afterwards."""
    prompt = random_prompts(np.random.default_rng(8), 1, 20, 21)[0]
    free = Engine(tiny, max_num_seqs=1, decode_steps=4).generate([Request(prompt, greedy(6, ignore_eos=True))])[0]
    assert free.token_ids[1] != free.token_ids[0]
    eng = Engine(tiny, max_num_seqs=1, decode_steps=4)
    res = eng.generate([Request(prompt, greedy(6, stop_token_ids=(free.token_ids[1],)))])[0]
    assert res.token_ids == free.token_ids[:2] and res.finish_reason == "stop"
    written = sum(np.asarray(k).any(axis=(0, 3)) for k in eng.runner.kv.k)          # [P, bs] per layer
    assert int((written > 0).sum()) == len(prompt) + 1


def test_penalties_match_a_numpy_reference():
    from infernix_jax.engine.sampler import Penalties, apply_penalties
    rng = np.random.default_rng(6)
    B, V = 3, 50
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    outs = [[1, 1, 7], [], [3, 4, 3, 3]]
    prompts = [[2, 9], [5], [3]]
    pres, freq, rep = np.array([0.5, 0, -1.0], np.float32), np.array([0.3, 0, 0.2], np.float32), \
        np.array([1.3, 2.0, 0.8], np.float32)
    ref = logits.copy()
    for b in range(B):
        for t in set(outs[b]) | set(prompts[b]):
            ref[b, t] = ref[b, t] / rep[b] if ref[b, t] > 0 else ref[b, t] * rep[b]
        for t in set(outs[b]):
            ref[b, t] -= freq[b] * outs[b].count(t) + pres[b]
    L = 8
    out_ids = np.full((B, L), V, np.int32)
    out_counts = np.zeros((B, L), np.int32)
    seen_ids = np.full((B, L), V, np.int32)
    for b in range(B):
        ids, cnt = np.unique(outs[b], return_counts=True)
        out_ids[b, :len(ids)], out_counts[b, :len(ids)] = ids, cnt
        allid = np.unique(outs[b] + prompts[b])
        seen_ids[b, :len(allid)] = allid
    pen = Penalties(out_ids, out_counts, seen_ids, pres, freq, rep)
    got = apply_penalties(logits, *pen.dense(B, V), pen)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=1e-6)


def test_penalties_same_in_one_step_and_multi_step_decode(tiny):
    rng = np.random.default_rng(7)
    prompts = random_prompts(rng, 4, 5, 30)
    kw = dict(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.7,
              presence_penalty=0.3)
    outs = []
    for k in (1, 4):
        eng = Engine(tiny, max_num_seqs=4, decode_steps=k)
        outs.append([r.token_ids for r in eng.generate([Request(p, SamplingParams(**kw)) for p in prompts])])
    assert outs[0] == outs[1]


@pytest.mark.extended
def test_penalties_curb_repetition_on_the_real_model(smollm_engine, smollm):
    p = smollm.tokenizer.encode("cat cat cat cat cat cat cat cat")
    plain = smollm_engine.generate([Request(p, greedy(30, ignore_eos=True))])[0]
    pen = smollm_engine.generate([Request(p, greedy(30, ignore_eos=True, frequency_penalty=1.5,
                                                    presence_penalty=1.0))])[0]
    top = lambda ids: max(np.unique(ids, return_counts=True)[1])  # noqa: E731
    assert top(plain.token_ids) >= 10          # the model does repeat itself here
    assert top(pen.token_ids) < top(plain.token_ids) / 2


def test_bucket():
    assert [steps.bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]


def test_chained_block_keys_follow_the_prefix():
    from infernix_jax.cache.block_manager import BlockManager
    from infernix_jax.engine.sequence import Sequence
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(Request(list(range(10)), greedy(4)), None, set())
    b = Sequence(Request(list(range(8)) + [99, 98], greedy(4)), None, set())
    for s in (a, b):
        bm.grow(s, 10)
        s.num_computed = 6
        bm.seal_full_blocks(s)                     # one full block so far
        assert s.num_sealed == 1
        s.out_ids.append(5)
        s.num_computed = 11                        # two more full blocks, sealed incrementally
        bm.seal_full_blocks(s)
        assert s.tokens(8, 11) == s.all_ids[8:11]
    assert a.block_keys[:2] == b.block_keys[:2]    # same first 8 tokens, same chain
    assert [bm.by_key[k] for k in a.block_keys[:2]] == a.block_ids[:2]    # a sealed them first: its blocks
    bm.grow(a, 12)
    a.out_ids.append(7)
    a.num_computed = 12
    bm.seal_full_blocks(a)
    assert len(a.block_keys) == 3 and len(b.block_keys) == 2
    bm.release(a)
    bm.release(b)       # b's copies of a's two blocks are not kept; its partial last block (3 tokens) is
    assert bm.num_free == 8 and bm.num_cached == 3 + 1 and len(bm.lru) == 4
    bm.clear_cache()
    assert bm.num_free == 8 and bm.num_cached == 0 and len(bm.free) == 8


def test_think_guard_bans_ending_inside_thinking():
    import jax.numpy as jnp
    import numpy as np
    from infernix_jax.engine.sampler import SamplingArrays, ThinkGuard, sample
    V, EOS, CALL, START, END = 32, 5, 7, 3, 4
    logits = np.zeros((3, V), np.float32)
    logits[:, EOS], logits[:, CALL], logits[:, 9] = 9.0, 8.0, 1.0        # EOS, then <tool_call>, then 9
    guard = ThinkGuard(open=np.array([True, False, True]), enabled=np.array([True, True, False]),
                       banned=np.array([EOS, CALL], np.int32), start=np.int32(START), end=np.int32(END))
    tok, _ = sample(jnp.asarray(logits), np.zeros(3, np.int32), SamplingArrays.greedy(3), guard=guard)
    assert list(np.asarray(tok)) == [9, EOS, 9]                            # open rows cannot end
    nxt = guard.after(jnp.asarray([END, START, 9]))
    assert list(np.asarray(nxt.open)) == [False, True, False]             # </think> closes, <think> opens
    allowed = np.zeros((3, 1), np.int32)
    allowed[:, 0] = 1 << 2                                                 # only token 2
    tok, _ = sample(jnp.asarray(logits), np.zeros(3, np.int32), SamplingArrays.greedy(3), allowed=allowed)
    assert list(np.asarray(tok)) == [2, 2, 2]


def test_loop_guard_detects_repeats_and_closes_thinking(smollm_engine):
    from infernix_jax.engine import engine as eng
    assert eng.repeats([1, 2] * 3 + list(range(10, 19)) * 4)
    assert not eng.repeats(list(range(10, 19)) * 3)                        # three times is not yet a loop
    assert not eng.repeats(list(range(100)))

    class Seq:   # the fields _track_thinking reads
        def __init__(self):
            self.out_ids, self.thinking, self.think_from, self.id = [], False, 0, 0
            self.params = SamplingParams(max_tokens=1000)
    e = smollm_engine
    saved = e.think_ids
    e.think_ids = (900, 901, (2,))
    try:
        seq = Seq()
        injected = []
        for t in [900] + list(range(10, 18)) * 6:
            seq.out_ids.append(t)
            injected.append(e._track_thinking(seq, t))
            if injected[-1]:
                break                                                      # the engine stops there too
        assert seq.thinking is False and seq.out_ids[-1] == 901 and injected.count(True) == 1
        assert len(injected) >= 1 + 8 * 4                                  # not before four repeats
        # a run-on of hyphen-joined words: not periodic, closed all the same
        words = "so-then-we-should-look-at-what-the-user-asked-and-maybe-check-each-file-once-more-before-we-" \
                "answer-because-the-result-might-change-if-anything-else-was-edited-meanwhile-or-later-on"
        assert eng.runs_on(words) and not eng.runs_on(words + " and then we stop.")
        assert not eng.runs_on("id 123e4567-e89b-12d3-a456-426614174000, a well-known state-of-the-art x-y-z")
        seq = Seq()
        ids = [900] + e.tokenizer.encode(words, add_special_tokens=False)
        for t in ids:
            seq.out_ids.append(t)
            if e._track_thinking(seq, t):
                break
        assert seq.out_ids[-1] == 901 and not seq.thinking and len(seq.out_ids) < len(ids) + 1
        assert not eng.repeats(ids[1:])
    finally:
        e.think_ids = saved


@pytest.mark.extended          # (two 66K-token prefills through the reference attention)
def test_a_prompt_pass_wider_than_65535_tokens(smollm):
    """A 66K-token prompt whose first prefill pass is 65,600 tokens wide (past every 16-bit index and
    65,535-wide grid dimension; the reference attention goes through it in tiles) gives the tokens
    and logprobs of the same prompt prefilled in passes of 32K."""
    import dataclasses
    cfg = dataclasses.replace(smollm.cfg, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                              num_kv_heads=1, head_dim=16, max_position_embeddings=131072)
    model = LoadedModel(name="tiny-long", path=smollm.path, cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(3)),
                        tokenizer=smollm.tokenizer, dtype=smollm.dtype)
    prompt = random_prompts(np.random.default_rng(9), 1, 66_000, 66_001)[0]
    out = {}
    for width in (65_600, 32_768):
        eng = Engine(model, max_num_seqs=1, max_model_len=66_016, max_num_batched_tokens=width, kv_cache_gib=0.05)
        out[width] = eng.generate([Request(prompt, greedy(4, ignore_eos=True, logprobs=True))])[0]
    a, b = out.values()
    assert a.token_ids == b.token_ids and a.prompt_tokens == 66_000
    assert np.allclose([x[1] for x in a.logprobs], [x[1] for x in b.logprobs], atol=1e-3)
