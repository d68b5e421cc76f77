"""Speculative decoding (engine/spec): drafts verified in one step change nothing of the output.

The drafts here come from an oracle that knows plain decoding's output (right, wrong at a chosen
place, always wrong, or a tree with a decoy branch), so every path of the verify step is walked
on purpose: greedy and seeded outputs equal plain decoding token for token, on a Llama and on both
hybrids (whose recurrent state must roll back exactly), beside plain rows, under a grammar, and
every block is released. The n-gram drafter and the policy are checked on their own."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from infernix_jax.engine import Engine, Request, SamplingParams
from infernix_jax.engine.spec import Draft
from infernix_jax.engine.spec import ngram
from infernix_jax.engine.spec.policy import SeqStats, Speculator
from infernix_jax.loader import LoadedModel
from infernix_jax.models import init_params
from test_engine_hybrid import tiny_hybrid

N_NEW = 24


@pytest.fixture(scope="module")
def llama(smollm):
    cfg = dataclasses.replace(smollm.cfg, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    return LoadedModel(name="tiny", path=smollm.path, cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0), scale=0.5),
                       tokenizer=smollm.tokenizer, dtype=smollm.dtype)


CASES = [  # (model, temperature): the quick suite checks a Llama seeded and a hybrid greedy
    ("llama", 0.9), ("qwen3_5", 0.0),
    *(pytest.param(c, marks=pytest.mark.extended) for c in (("llama", 0.0), ("qwen3_5", 0.9), ("qwen3_next", 0.0),
                                                            ("qwen3_next", 0.9)))]


@pytest.fixture(scope="module")
def models(llama, smollm):
    built = {"llama": llama}

    def get(name):
        if name not in built:
            built[name] = tiny_hybrid(name, smollm.tokenizer, smollm.cfg.vocab_size)
        return built[name]
    return get


def prompts(count=6, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(10, 49000, n))) for n in rng.integers(3, 80, count)]


def oracle(truth: dict, wrong=(), tree=False):
    """A drafter proposing plain decoding's next tokens (truth: prompt -> output), with the draft
    positions in `wrong` changed; tree: a decoy branch before the true chain."""
    def draft(seq, ids, k):
        toks = list(truth[tuple(seq.prompt_ids)][len(seq.out_ids):len(seq.out_ids) + k])
        for w in wrong:
            if w < len(toks):
                toks[w] = (toks[w] + 1) % 1000 + 10
        if not toks:
            return None
        if tree and len(toks) > 1:
            decoy = [(toks[0] + 7) % 1000 + 10, toks[1]]
            return Draft(decoy + toks, [-1, 0, -1] + list(range(2, len(toks) + 1)), "tree")
        return Draft.chain(toks)
    return draft


def generate(model, ps, mode="off", drafter=None, temperature=0.0, seqs=4, **kw):
    eng = Engine(model, max_num_seqs=seqs, max_num_batched_tokens=64, decode_steps=3, speculative=mode, **kw)
    if drafter is not None:
        eng.spec.drafter = drafter
    out = eng.generate([Request(p, SamplingParams(max_tokens=N_NEW, temperature=temperature, seed=i + 1,
                                                  ignore_eos=True)) for i, p in enumerate(ps)])
    assert eng.bm.num_free == eng.bm.num_blocks                    # every block released
    if eng.hybrid:
        assert sorted(eng.scheduler.free_slots) == list(range(eng.scheduler.max_num_seqs))
    return [r.token_ids for r in out], eng


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'seeded' if c[1] else 'greedy'}")
def test_drafts_right_wrong_or_branching_change_nothing(models, case):
    model, temperature = models(case[0]), case[1]
    ps = prompts()
    plain, _ = generate(model, ps, temperature=temperature)
    truth = {tuple(p): o for p, o in zip(ps, plain)}
    for wrong, tree, accepted in (((), False, "all"), ((2,), False, "some"), ((0,), False, "none"),
                                  ((), True, "all")):
        got, eng = generate(model, ps, "ngram", oracle(truth, wrong, tree), temperature)
        assert got == plain, (wrong, tree)
        st = eng.spec.stats["tree" if tree else "ngram"]
        assert st.rounds > 0
        if accepted == "all":
            assert st.accepted == st.drafted
        elif accepted == "none":
            assert st.accepted == 0
        else:
            assert 0 < st.accepted < st.drafted


@pytest.mark.extended
def test_a_batch_mixing_drafting_and_plain_rows(llama):
    """Half the requests draft (one of them a tree), half do not; a long prompt prefills in chunks
    beside them: every output is plain decoding's."""
    ps = prompts(8, seed=3) + [list(range(100, 400))]
    plain, _ = generate(llama, ps, seqs=8)
    truth = {tuple(p): o for p, o in zip(ps, plain)}
    chain, tree = oracle(truth), oracle(truth, tree=True)

    def some(seq, ids, k):
        i = [tuple(p) for p in ps].index(tuple(seq.prompt_ids))
        return None if i % 2 else (tree if i == 2 else chain)(seq, ids, k)
    got, eng = generate(llama, ps, "ngram", some, seqs=8)
    assert got == plain
    assert eng.spec.stats["ngram"].rounds and eng.spec.stats["tree"].rounds


@pytest.mark.extended
def test_grammar_constrained_output_under_speculation(smollm):
    """A JSON schema: each draft node's mask is the grammar's after the path to it; drafts that
    break the grammar are rejected, and the text is plain decoding's."""
    from infernix_jax.engine.constraints import grammar_from_json_schema
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    tok = smollm.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Give me a JSON object with a name and a number."}])

    def run(mode, drafter=None):
        eng = Engine(smollm, max_num_seqs=2, speculative=mode)
        if drafter is not None:
            eng.spec.drafter = drafter
        p = SamplingParams(max_tokens=40, temperature=0, grammar=grammar_from_json_schema(schema))
        return eng.generate([Request(prompt, p)])[0], eng
    plain, _ = run("off")
    truth = {tuple(prompt): plain.token_ids + [0] * 8}
    for wrong in ((), (1,)):
        got, eng = run("ngram", oracle(truth, wrong))
        assert got.token_ids == plain.token_ids and got.text == plain.text
        assert eng.spec.stats["ngram"].rounds > 0
    json.loads(plain.text)


def test_ngram_finds_the_longest_recurring_suffix():
    ids = np.asarray([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3], np.int32)
    n, ends = ngram.matches(ids, 2, 8)
    assert n == 3 and ends.tolist() == [3, 9]
    assert ngram.propose(ids, 4).tokens == [7, 8, 1, 2]               # the latest occurrence
    t = ngram.propose(ids, 3, tree_nodes=8)                             # both continuations, latest first
    assert t.tokens == [7, 8, 1, 4, 5, 9] and t.parents == [-1, 0, 1, -1, 3, 4]
    assert ngram.propose(np.asarray([1, 2, 3, 4], np.int32), 4) is None
    assert ngram.propose(ids, 3, tree_nodes=4).tokens == [7, 8, 1, 4]   # capped at 4 nodes


def test_draft_ancestors_and_depths():
    d = Draft([5, 6, 7, 8], [-1, 0, -1, 2], "tree")
    assert d.depths() == [1, 2, 1, 2]
    assert d.ancestors().tolist() == [0b1, 0b11, 0b100, 0b1100]
    assert d.path_tokens(3) == [7, 8] and not d.is_chain and Draft.chain([1, 2]).is_chain


def test_auto_drafts_only_where_a_round_pays():
    """The policy: with measured times where a verify step costs about a decode step (one stream
    on a GPU), a likely draft is taken deep; where it costs 4x (a big batch), an unlikely one is
    not; a sequence whose drafts held whole expects long rounds, one whose drafts fail expects none."""
    sp = Speculator("auto", 8)
    st = SeqStats()
    assert abs(st.expected("ngram", 2) - 1.75) < 1e-9                  # the prior: each depth 1/2
    sp.timings.decode = {1: 0.010}
    sp.timings.mixed = {4: 0.011, 8: 0.011, 16: 0.011}
    for _ in range(6):
        st.observe("ngram", 8, 8)
    assert sp._depth(st, "ngram", 8, 8, 1)[0] == 8 and st.expected("ngram", 8) > 7
    sp.timings.decode = {64: 0.010}
    sp.timings.mixed = {64: 0.035, 128: 0.040}
    for _ in range(10):
        st.observe("ngram", 8, 0)
    assert sp._depth(st, "ngram", 8, 8, 64)[0] == 0
    assert st.alpha("ngram") < 0.3 and st.expected("ngram", 8) < 2.5   # (deeper depths keep their record)


def test_auto_probes_free_text_ever_more_rarely():
    """A sequence auto declines to draft for gets a probe round now and then; probes that hold
    nothing come twice as far apart each time (up to a limit), one that holds brings them back."""
    import types
    sp = Speculator("auto", 8)
    sp.drafter = lambda seq, ids, k: Draft.chain([5] * k)
    sp.timings.decode = {1: 0.010}
    sp.timings.mixed = {4: 0.030, 8: 0.030, 16: 0.030}        # (a verify step costs 3 plain ones)
    seq = types.SimpleNamespace(spec=SeqStats(), out_ids=[], all_ids=[1, 2, 3], mtp_next=None)
    for _ in range(10):
        seq.spec.observe("ngram", 8, 0)                      # free text: drafts have failed
    probes = []
    for n in range(700):
        d = sp.propose(seq, 1, 1000)
        if d is not None:
            probes.append(n)
            sp.observe(seq, d, 5 if n > 500 else 0)          # late on, a copy starts: the probe holds
        seq.out_ids.append(0)
    gaps = np.diff(probes).tolist()
    assert gaps[:4] == [16, 32, 64, 128] and max(gaps) == 128
    late = [p for p in probes if p > 500]
    assert late[1] - late[0] <= 16                           # (it held: the next probe comes soon)


def test_verify_shapes_are_recorded_and_warmed_by_the_next_start(llama, tmp_path):
    """The verify steps a run met are saved with the other shapes; the next start of the same
    engine warms them, and the same drafted requests then compile nothing. One stream's usual
    verify steps (verify_keys) warm without error."""
    from conftest import compiles
    ps = prompts(3, seed=5)
    plain, _ = generate(llama, ps)
    truth = {tuple(p): o for p, o in zip(ps, plain)}
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, decode_steps=3, speculative="ngram", shapes_dir=str(tmp_path))
    reqs = lambda: [Request(p, SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)) for p in ps]  # noqa: E731
    a = Engine(llama, **kw)
    a.spec.drafter = oracle(truth, wrong=(3,))
    a.generate(reqs())
    met = [k for k in a.runner.shapes.counts if k[0] == "verify"]
    assert met
    a.close()
    b = Engine(llama, **kw)
    b.spec.drafter = oracle(truth, wrong=(3,))
    assert set(met) <= set(b.earlier_shapes)
    for key in b.earlier_shapes:
        b.runner.warm(key, run=False)
    for key in b.runner.verify_keys(b.spec_depth):
        b.runner.warm(key, run=True)
    before = compiles()
    assert [r.token_ids for r in b.generate(reqs())] == plain
    assert compiles() == before


# ---- device-side rounds (steps.spec_steps): n-gram drafts looked up and verified inside one dispatch

COPY = ("def area(r):\n    return 3.14159 * r * r\n\n\nclass Shape:\n    def __init__(self, name, sides):\n"
        "        self.name = name\n        self.sides = sides\n\n    def describe(self):\n"
        "        return f'{self.name} has {self.sides} sides'\n")


def copy_prompt(tok, text=COPY):
    return tok.encode_chat([{"role": "user", "content": f"Repeat this code exactly, nothing else:\n\n{text}"}])


def run_engine(model, reqs, mode, **kw):
    eng = Engine(model, max_num_seqs=4, max_model_len=1024, speculative=mode, device_rounds=True, **kw)
    out = eng.generate(reqs())
    assert eng.bm.num_free == eng.bm.num_blocks                    # every block released
    return out, eng


def test_device_ngram_lookup_is_the_host_one():
    """propose_device over padded histories drafts exactly what propose does (chains), whatever
    the history, its length, k and the match window."""
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    for _ in range(60):
        B, L = 4, 64
        hist = np.full((B, L), 7777, np.int32)
        lens = rng.integers(1, L, B)
        for r in range(B):
            hist[r, :lens[r]] = rng.integers(0, int(rng.integers(2, 6)), lens[r])
        k, lo = int(rng.integers(1, 9)), int(rng.integers(1, 3))
        hi = int(rng.integers(lo, 9))
        draft, n = ngram.propose_device(jnp.asarray(hist), jnp.asarray(lens, jnp.int32), k, lo, hi)
        for r in range(B):
            want = ngram.propose(hist[r, :lens[r]], k, lo, hi)
            assert [int(t) for t in np.asarray(draft[r]) if t >= 0] == (want.tokens if want else [])
            assert int(n[r]) == ngram.matches(hist[r, :lens[r]], lo, hi)[0]


def test_device_tree_lookup_is_the_host_one():
    """propose_tree_device builds the tree propose does (nodes, parents, depths, ancestor bits, in
    the same order) over padded histories: small alphabets, so occurrences share prefixes, differ
    and run past the row's end; node caps below and above the occurrences found."""
    import jax.numpy as jnp
    rng = np.random.default_rng(1)
    branched = 0
    # (each setting compiles once: a batch of 24 random rows under each)
    for k, nodes, lo, hi in ((1, 3, 1, 4), (4, 8, 2, 8), (7, 16, 1, 3), (7, 32, 2, 8), (8, 1, 2, 5), (3, 32, 1, 1)):
        B, L = 24, 80
        hist = np.full((B, L), 7777, np.int32)
        lens = rng.integers(1, L, B)
        for r in range(B):
            hist[r, :lens[r]] = rng.integers(0, int(rng.integers(2, 5)), lens[r])
        tok, par, dep, anc = (np.asarray(a) for a in jax.jit(ngram.propose_tree_device, static_argnums=(2, 3, 4, 5))(
            jnp.asarray(hist), jnp.asarray(lens, jnp.int32), k, nodes, lo, hi))
        for r in range(B):
            want = ngram.propose(hist[r, :lens[r]], k, lo, hi, tree_nodes=nodes)
            m = len(want) if want else 0
            assert tok[r, m:].tolist() == [-1] * (nodes - m) and par[r, m:].tolist() == [-2] * (nodes - m)
            if want:
                assert tok[r, :m].tolist() == want.tokens and par[r, :m].tolist() == want.parents
                assert dep[r, :m].tolist() == want.depths()
                assert anc[r, :m].tolist() == want.ancestors().tolist()
                branched += not want.is_chain
    assert branched > 20                     # (the trees compared branch: not chains only)


@pytest.mark.extended          # (~80 s: the real model, three times; the rounds are off on the CPU by default)
def test_device_rounds_change_nothing(smollm):
    """A batch decoding with ngram rounds on the device, chains and trees: greedy, seeded, a stop
    string, a length limit reached inside a round, logprobs: every output is plain decoding's, and
    copying is sped up (drafts held). One prompt holds two versions of the code and asks for the
    older: the trees accept branches other than their first, whose K/V the rounds move to where
    their positions belong (without the move the greedy output differs: checked by mutation). The
    rounds' shape is recorded for warm-up and warms again."""
    v2 = COPY.replace("Shape", "Figure").replace("sides", "edges").replace("name", "label")
    two = smollm.tokenizer.encode_chat([{"role": "user", "content": f"Version 1:\n\n{COPY}\nVersion 2:\n\n{v2}\n"
                                         "Repeat version 1 exactly, nothing else."}])
    p = copy_prompt(smollm.tokenizer)
    q = copy_prompt(smollm.tokenizer, COPY.replace("Shape", "Figure").replace("sides", "edges"))

    def reqs():
        return [Request(two, SamplingParams(max_tokens=64, temperature=0, logprobs=True, top_logprobs=3)),
                Request(q, SamplingParams(max_tokens=48, temperature=0.8, seed=7)),
                Request(p, SamplingParams(max_tokens=64, temperature=0, stop=("describe",))),
                Request(two, SamplingParams(max_tokens=13, temperature=0, ignore_eos=True))]
    plain, _ = run_engine(smollm, reqs, "off")
    for method, kw in (("ngram", {}), ("tree", dict(ngram_tree_nodes=16))):
        got, eng = run_engine(smollm, reqs, "ngram", **kw)
        for a, b in zip(plain, got):
            assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
        assert len(got[3].token_ids) == 13 and got[2].finish_reason == "stop"
        assert [x[0] for x in got[0].logprobs] == [x[0] for x in plain[0].logprobs]
        assert np.allclose([x[1] for x in got[0].logprobs], [x[1] for x in plain[0].logprobs], atol=2e-3)
        st = eng.spec.stats[method]
        assert st.rounds > 0 and st.accepted > 0.3 * st.drafted       # (the copies hold)
        keys = [k for k in eng.runner.shapes.counts if k[0] == "spec"]
        assert keys and keys[-1][-1] == kw.get("ngram_tree_nodes", 0)
        eng.runner.warm(keys[-1], run=True)          # (on padding: no request's blocks are touched)


@pytest.mark.extended
@pytest.mark.parametrize("nodes", [0, 16], ids=["chains", "trees"])
def test_device_rounds_keep_the_thinking_guard(smollm, nodes):
    """The end-in-thinking guard inside the rounds: a banned token (one the copy needs) never
    comes while the block is open, at the root or along a draft (a chain, or a tree's nodes),
    exactly as in plain decoding."""
    tok = smollm.tokenizer
    p = copy_prompt(tok)
    banned = tok.encode(" sides")[0]

    def run(mode):
        eng = Engine(smollm, max_num_seqs=2, max_model_len=1024, speculative=mode, device_rounds=True,
                     ngram_tree_nodes=nodes)
        eng.think_ids = eng.runner.think_ids = (tok.encode(" Shape")[0], tok.encode(" area")[0], (banned,))
        r = eng.generate([Request(p, SamplingParams(max_tokens=40, temperature=0, think_open=True,
                                                    think_guard=True))])[0]
        return r.token_ids, eng
    plain, _ = run("off")
    got, eng = run("ngram")
    assert got == plain and banned not in plain             # (unguarded, the copy has it: " sides")
    assert eng.spec.stats["tree" if nodes else "ngram"].rounds > 0


def test_auto_picks_rounds_or_plain_decoding_by_measured_speed():
    """auto: device-side rounds where they emitted tokens faster lately, else plain decode steps;
    the other one every few dispatches, so that a copy starting later is noticed."""
    sp = Speculator("auto", 8)
    sp.loop = sp.loop_settings(8)
    assert sp.loop is not None and Speculator("ngram", 8, tree_nodes=4).loop_settings(8).nodes == 4
    assert Speculator("mtp", 8).loop_settings(8) is None
    assert not sp.use_loop(1)                                # nothing measured: plain decoding first
    sp.timings.per_token[("plain", 1)] = 0.001
    assert sp.use_loop(1)                                    # then the rounds
    sp.timings.per_token[("loop", 1)] = 0.002
    picks = [sp.use_loop(1) for _ in range(120)]             # plain is faster: the rounds now and then,
    probes = [i for i, p in enumerate(picks) if p]           # ever more rarely (a round may cost several)
    gaps = np.diff(probes)
    assert len(probes) == 4 and all(gaps[1:] == 2 * gaps[:-1])
    sp.timings.per_token[("plain", 1)] = 0.004               # a copy began: the rounds win now
    picks = [sp.use_loop(1) for _ in range(16)]
    assert picks.count(False) == 1 and picks[0]              # (the pick changed: probed again soon)
    sp.drafter = lambda seq, ids, k: None                    # another drafter: host rounds only
    assert sp.loop is None and not sp.use_loop(1)


@pytest.mark.extended
def test_a_served_engine_warms_its_rounds_while_idle(llama):
    """Started (the server's way), an auto engine compiles the device-side rounds of one stream
    while idle after ready, and until then decodes plainly rather than compile on a request's path."""
    import time
    eng = Engine(llama, max_num_seqs=2, max_num_batched_tokens=64, decode_steps=3, speculative="auto",
                 device_rounds=True)
    assert eng.runner.spec_keys() and not eng.runner.compiled
    eng.start("basic")
    try:
        assert eng.ready.wait(300)
        t = time.monotonic()
        while eng._idle_keys and time.monotonic() - t < 300:
            time.sleep(0.2)
        assert set(eng.runner.spec_keys()) <= eng.runner.compiled
    finally:
        eng.stop()


def test_device_rounds_only_where_they_can_run(llama):
    """Rounds on the device need several decode steps a dispatch and n-gram drafts (chains or
    trees); on the CPU they are off unless asked for. A recorded rounds shape in an engine without them is skipped at
    warm-up (no failed dispatch, no pool reset)."""
    from infernix_jax.engine import shapes

    def loop(**kw):
        return Engine(llama, max_num_seqs=2, max_model_len=256, speculative="ngram", **kw).spec.loop
    assert loop(device_rounds=True) is not None
    assert loop(device_rounds=True, decode_steps=1) is None and loop(device_rounds=True, ngram_tree_nodes=4).nodes == 4
    assert loop() is None                                   # (the CPU's default: host rounds)
    eng = Engine(llama, max_num_seqs=2, max_model_len=256, speculative="ngram")
    kv = eng.runner.kv
    eng.runner.warm(shapes.spec(1, eng.runner.table_width(1), 4, 7, False), run=True)
    eng.runner.warm(("spec", 1, eng.runner.table_width(1), 4, 7, False), run=True)     # (an older record's form)
    assert eng.runner.kv is kv


def copier(model, strength=0.02):
    """The tiny hybrid with its layers' outputs scaled down and its head tied to the embeddings:
    greedy output runs one token several times, then moves on where the layers' part (the recurrent
    state's too) tips it, so n-gram drafts both hold and fail."""
    scaled = lambda k: "down" in k or k in ("lin_out", "wo")  # noqa: E731
    layers = [{k: v * strength if scaled(k) else v for k, v in p.items()} for p in model.params["layers"]]
    return dataclasses.replace(model, params={**model.params, "layers": layers, "lm_head": model.params["embed"]})


@pytest.mark.extended          # (~40 s a family)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_hybrid_device_rounds_change_nothing(models, family):
    """Device-side rounds on hybrids, whose recurrent state cannot drop a rejected token (each round
    feeds the last round's tokens again: steps.spec_steps): chains, trees and auto's switches
    between rounds and plain steps; greedy, seeded, a stop token, a length limit, then the
    conversations continued from the prefix cache: every output is plain decoding's, and drafts
    both hold and fail. (By mutation: keeping the state after the last node, feeding every known
    token again, or counting every emitted token as in the state each changes outputs.)"""
    model = copier(models(family))
    rng = np.random.default_rng(0)
    ps = [list(map(int, rng.integers(10, 49000, n))) for n in (20, 35, 50, 12)]

    def run(mode, stop=None, **kw):
        eng = Engine(model, max_num_seqs=4, max_model_len=512, speculative=mode, device_rounds=True, **kw)
        params = [dict(max_tokens=64, temperature=0), dict(max_tokens=64, temperature=0),
                  dict(max_tokens=64, temperature=0.9, seed=3), dict(max_tokens=13, temperature=0)]
        if stop is not None:
            params[1]["stop_token_ids"] = [stop]
        first = eng.generate([Request(p, SamplingParams(ignore_eos=True, **kw_)) for p, kw_ in zip(ps, params)])
        again = eng.generate([Request(p + r.token_ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                              for p, r in zip(ps[:2], first[:2])])
        assert eng.bm.num_free == eng.bm.num_blocks
        assert sorted(eng.scheduler.free_slots) == list(range(eng.scheduler.max_num_seqs))
        return [r.token_ids for r in first + again], eng, again

    stop = run("off")[0][1][40]
    plain, _, _ = run("off", stop)
    assert len(plain[1]) < 64 and len(plain[3]) == 13
    for mode, kw in (("ngram", {}), ("ngram", dict(ngram_tree_nodes=8)), ("auto", {})):
        got, eng, again = run(mode, stop, **kw)
        assert got == plain, (mode, kw)
        if mode == "ngram":
            st = eng.spec.stats["tree" if kw else "ngram"]
            assert st.rounds > 10 and 0 < st.accepted < st.drafted
            assert any(k[0] == "spec" for k in eng.runner.shapes.counts)
            assert all(r.cached_tokens > 0 for r in again)
