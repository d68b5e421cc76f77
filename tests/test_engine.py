"""The contiguous-cache engine on the real model: batching invariance, stops, cancellation and a
bounded number of compilations."""
import threading

from infernix_jax.engine import Request, SamplingParams
from infernix_jax.engine import steps


def chat(tok, text):
    return tok.encode_chat([{"role": "user", "content": text}])


def test_batched_greedy_equals_alone(smollm_engine, smollm):
    tok = smollm.tokenizer
    prompts = [chat(tok, q) for q in ("What is the capital of France?", "Name a color.", "Count to three.")]
    alone = [smollm_engine.generate([Request(p, SamplingParams(max_tokens=12, temperature=0))])[0] for p in prompts]
    together = smollm_engine.generate([Request(p, SamplingParams(max_tokens=12, temperature=0)) for p in prompts])
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert "Paris" in alone[0].text


def test_stop_token_ids_and_ignore_eos(smollm_engine, smollm):
    p = chat(smollm.tokenizer, "What is the capital of France?")
    r = smollm_engine.generate([Request(p, SamplingParams(max_tokens=40, temperature=0))])[0]
    assert r.finish_reason == "stop" and r.token_ids[-1] in smollm.tokenizer.eos_ids
    forced = smollm_engine.generate([Request(p, SamplingParams(max_tokens=len(r.token_ids) + 3, temperature=0,
                                                               ignore_eos=True))])[0]
    assert forced.finish_reason == "length" and len(forced.token_ids) == len(r.token_ids) + 3
    second = r.token_ids[1]
    r2 = smollm_engine.generate([Request(p, SamplingParams(max_tokens=40, temperature=0,
                                                           stop_token_ids=(second,)))])[0]
    assert r2.finish_reason == "stop" and r2.token_ids == r.token_ids[:2]


def test_top_k_1_is_greedy_and_events_stream(smollm_engine, smollm):
    p = chat(smollm.tokenizer, "Name three fruits.")
    events = []
    g = smollm_engine.generate([Request(p, SamplingParams(max_tokens=10, temperature=0))])[0]
    k1 = smollm_engine.generate([Request(p, SamplingParams(max_tokens=10, temperature=0.9, top_k=1, seed=3),
                                         on_event=events.append)])[0]
    assert k1.token_ids == g.token_ids
    assert "".join(e.text for e in events if e.kind == "delta") == k1.text
    assert events[-1].kind == "done" and events[-1].completion_tokens == 10


def test_cancelled_request_stops_and_others_continue(smollm_engine, smollm):
    p = chat(smollm.tokenizer, "Tell me a long story.")
    victim = Request(p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    seen = []

    def on_event(ev):
        seen.append(ev)
        if len(seen) == 3:
            victim.cancel()
    victim.on_event = on_event
    other = Request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    rv, ro = smollm_engine.generate([victim, other])
    assert rv.finish_reason == "abort" and len(rv.token_ids) < 10
    assert ro.finish_reason == "length" and len(ro.token_ids) == 20


def test_prompt_lengths_in_one_bucket_compile_once(smollm_engine):
    def n():
        return steps.prefill._cache_size(), steps.decode._cache_size()
    smollm_engine.generate([Request([5] * 20, SamplingParams(max_tokens=2, temperature=0))])
    before = n()
    for L in (17, 23, 29, 32):
        smollm_engine.generate([Request([5] * L, SamplingParams(max_tokens=3, temperature=0))])
    assert n() == before


def test_device_thread_serves_queued_requests(smollm_engine, smollm):
    from infernix_jax.engine import Engine
    eng = Engine(smollm, max_batch=2)
    eng.start(warmup=False)
    done = threading.Event()
    got = []

    def on_event(ev):
        got.append(ev)
        if ev.kind == "done":
            done.set()
    eng.submit(Request(chat(smollm.tokenizer, "Hi"), SamplingParams(max_tokens=4, temperature=0), on_event=on_event))
    assert done.wait(120)
    eng.stop()
    assert got[-1].finish_reason in ("stop", "length")


def test_bucket():
    assert [steps.bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
