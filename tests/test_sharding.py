"""Several devices through JAX sharding (infernix_jax/sharding.py), on the CPU's fake devices
(conftest asks for 8): each weight and the KV pool placed as the rules say, greedy tokens identical
to one device for a dense, an MoE and a hybrid tiny model at tensor parallel 4 and 8 (and expert
parallel), quantized weights split array by array, per-device planning, and clear errors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from infernix_jax import sharding
from infernix_jax.engine import Engine, Request, SamplingParams
from infernix_jax.engine.plan import make_plan
from infernix_jax.loader import LoadedModel
from infernix_jax.models import init_params
from infernix_jax.sharding import Parallel

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (conftest asks the CPU for 8)")


def tiny(smollm, seed=0, **kw) -> LoadedModel:
    """A small random Llama (8 query heads, 4 KV heads) with SmolLM2's vocabulary and tokenizer, f32."""
    cfg = dataclasses.replace(smollm.cfg, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                              num_kv_heads=4, head_dim=16, max_position_embeddings=256, **kw)
    return LoadedModel(name="tiny-tp", path=smollm.path, cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(seed),
                       scale=0.5), tokenizer=smollm.tokenizer, dtype=jnp.float32)


def tokens(model, prompts, parallel=None, n=8, **kw):
    eng = Engine(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, parallel=parallel, **kw)
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [r.token_ids for r in eng.generate([Request(q, p) for q in prompts])], eng


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(10, 49000, n))) for n in (3, 40, 90)]     # decode, one and two chunks


@pytest.fixture(scope="module")
def dense(smollm):
    return tiny(smollm)


def spec_of(a):
    """a's PartitionSpec without trailing Nones (jit writes outputs' specs short)."""
    s = list(a.sharding.spec) if hasattr(a.sharding, "spec") else []
    while s and s[-1] is None:
        s.pop()
    return P(*s)


def test_each_weight_and_the_kv_pool_are_placed_as_the_rules_say(dense, prompts):
    _, eng = tokens(dense, prompts[:1], Parallel(4), n=2)
    par, kv = eng.runner.params, eng.runner.kv
    layer = par["layers"][0]
    want = {"wq": P("tensor"), "wk": P("tensor"), "wv": P("tensor"), "wo": P(None, "tensor"),
            "w_gate": P("tensor"), "w_up": P("tensor"), "w_down": P(None, "tensor"),
            "attn_norm": P(), "mlp_norm": P()}
    for name, s in want.items():
        assert spec_of(layer[name]) == s, name
        assert len(layer[name].sharding.device_set) == 4
    assert spec_of(par["embed"]) == P("tensor")           # vocab-parallel (tied LM head)
    assert spec_of(kv.k[0]) == P("tensor") and spec_of(kv.v[1]) == P("tensor")
    # one shard holds a quarter: 4 KV heads over 4 devices, 8 query heads' rows, the FFN's columns
    assert layer["wq"].addressable_shards[0].data.shape == (32, 64)
    assert layer["w_down"].addressable_shards[0].data.shape == (64, 32)
    assert kv.k[0].addressable_shards[0].data.shape[0] == 1

    # 8 devices, 4 KV heads: KV heads (weights and pool) replicated, query heads split
    _, eng8 = tokens(dense, prompts[:1], Parallel(8), n=2)
    l8 = eng8.runner.params["layers"][0]
    assert spec_of(l8["wq"]) == P("tensor") and spec_of(l8["wk"]) == P()
    assert spec_of(eng8.runner.kv.k[0]) == P()


@pytest.mark.parametrize("par", [Parallel(4), Parallel(8)], ids=["tp4", "tp8"])
def test_dense_greedy_tokens_match_one_device(dense, prompts, par):
    one, _ = tokens(dense, prompts)
    assert tokens(dense, prompts, par)[0] == one


@pytest.mark.extended
def test_attention_kernels_run_on_each_device_s_heads(dense, prompts, monkeypatch):
    """The Pallas attention kernels (interpreted) on a mesh: each device runs them on its own query
    and KV heads (sharding.on_heads), with the pool's shards as they are: the tokens of one device."""
    from infernix_jax import sharding as sh
    calls = []
    real = jax.shard_map
    monkeypatch.setattr(sh.jax, "shard_map", lambda *a, **k: calls.append(k["in_specs"]) or real(*a, **k))
    one, _ = tokens(dense, prompts, attn_impl="pallas_interpret")
    assert not calls
    assert tokens(dense, prompts, Parallel(4), attn_impl="pallas_interpret")[0] == one
    assert calls and calls[0][1] == P("tensor")           # the pools went in split by KV head


@pytest.mark.extended
def test_moe_greedy_tokens_match_one_device_with_expert_parallel(smollm, prompts):
    moe = tiny(smollm, seed=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
               decoder_sparse_step=1)
    one, _ = tokens(moe, prompts)
    for par in (Parallel(4), Parallel(2, 4), Parallel(4, 2)):
        got, eng = tokens(moe, prompts, par)
        assert got == one, par
    e_gate = eng.runner.params["layers"][0]["e_gate"]                 # [E, I, H]: experts x FFN
    assert spec_of(e_gate) == P("expert", "tensor")
    assert e_gate.addressable_shards[0].data.shape == (4, 8, 64)


@pytest.mark.extended
def test_hybrid_greedy_tokens_match_one_device(smollm, prompts):
    from test_engine_hybrid import tiny_hybrid
    model = tiny_hybrid("qwen3_5", smollm.tokenizer, smollm.cfg.vocab_size)
    one, _ = tokens(model, prompts)
    for par in (Parallel(4), Parallel(8)):
        assert tokens(model, prompts, par)[0] == one, par


@pytest.mark.extended
def test_quantized_weights_split_array_by_array(dense, prompts, monkeypatch):
    """Quantized weights split with all their arrays (codes, scales, zero points); on the mesh the
    dequantizing kernel (interpreted) runs on each device's shard: column-parallel q/k/v and gate/up,
    row-parallel o and down (partial products summed); the tokens of one device."""
    from infernix_jax import sharding as sh
    from infernix_jax.quant.apply import quantize_params
    calls = []
    real = jax.shard_map
    monkeypatch.setattr(sh.jax, "shard_map", lambda *a, **k: calls.append(k["out_specs"]) or real(*a, **k))
    for fmt in ("int8", "int4", "nvfp4"):
        q = dataclasses.replace(dense, params=quantize_params(dense.params, fmt, progress=False), weights_format=fmt)
        one, _ = tokens(q, prompts[:2])
        got, eng = tokens(q, prompts[:2], Parallel(4))
        assert got == one, fmt
        wo = eng.runner.params["layers"][0]["wo"]                      # row-parallel: codes split along K
        assert spec_of(wo.data) == P(None, "tensor"), fmt
        wq = eng.runner.params["layers"][0]["wq"]                      # column-parallel: codes and scales by row
        assert spec_of(wq.data) == P("tensor") and spec_of(wq.scale)[0] == "tensor", fmt
        assert wq.split == ("tensor", None) and wo.split == (None, "tensor"), fmt
        calls.clear()
        assert tokens(q, prompts[:2], Parallel(4), attn_impl="pallas_interpret")[0] == one, fmt
        assert P(None, "tensor") in calls and P() in calls, fmt       # column- and row-parallel products


def test_plan_is_per_device(smollm):
    from infernix_jax.config import PRESETS
    cfg = PRESETS["qwen3-8b"]
    one = make_plan(cfg, jnp.bfloat16, max_model_len=4096, max_num_seqs=4, kv_cache_gib=4.0)
    four = make_plan(cfg, jnp.bfloat16, max_model_len=4096, max_num_seqs=4, kv_cache_gib=4.0, parallel=Parallel(4))
    # everything big splits 4 ways (the norms stay whole): a quarter of the weights and a quarter of
    # each KV block, so the same 4 GiB a device holds 4x the blocks
    assert 0.25 < four.weights_bytes / one.weights_bytes < 0.26
    assert four.block_bytes * 4 == one.block_bytes and 0 <= four.num_blocks - 4 * one.num_blocks < 4
    assert "tensor parallel 4" in four.describe()
    # 16 devices over 8 KV heads: the pool's heads stay whole
    assert make_plan(cfg, jnp.bfloat16, max_model_len=4096, max_num_seqs=4, kv_cache_gib=4.0,
                     parallel=Parallel(16)).block_bytes == one.block_bytes


def test_clear_errors(dense):
    with pytest.raises(ValueError, match="needs 16 devices; 8 visible"):
        sharding.make_mesh(Parallel(16))
    with pytest.raises(ValueError, match="must be >= 1"):
        sharding.make_mesh(Parallel(0))
    from infernix_jax.models.fuse import fuse_params
    fused = dataclasses.replace(dense, params=fuse_params(dense.params))
    with pytest.raises(ValueError, match="fuse=False"):
        Engine(fused, max_num_seqs=1, max_model_len=64, parallel=Parallel(2))


@pytest.mark.extended
def test_prefix_cache_tiers_and_snapshots_on_a_mesh(dense, smollm):
    """Blocks split by KV head go to the RAM tier and come back into their shards (the pool keeps
    its sharding), and a hybrid's state snapshot resumes a cached prefix: the same tokens as one
    device without any cache."""
    from infernix_jax.cache.host_tier import GiB
    from infernix_jax.models.kv_pool import kv_bytes_per_block
    from test_engine_hybrid import tiny_hybrid
    rng = np.random.default_rng(3)
    system = list(map(int, rng.integers(10, 49000, 64)))
    prompts = [system + list(map(int, rng.integers(10, 49000, 6))) for _ in range(2)]
    per_block = kv_bytes_per_block(dense.cfg, dense.dtype, "", 16) // 4          # one device's share
    eng = Engine(dense, max_num_seqs=1, max_num_batched_tokens=64, decode_steps=2, max_model_len=128,
                 kv_cache_gib=10 * per_block / GiB, prefix_cache_ram_gib=64 * per_block / GiB, parallel=Parallel(4),
                 ram_resize="off")
    assert eng.bm.num_blocks == 10
    want = tokens(dense, prompts, n=4)[0]
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert eng.generate([Request(prompts[0], p)])[0].token_ids == want[0]
    for _ in range(3):                             # unrelated prompts push the system prompt off the device
        eng.generate([Request(list(map(int, rng.integers(10, 49000, 100))), SamplingParams(max_tokens=2))])
    got = eng.generate([Request(prompts[1], p)])[0]
    assert got.token_ids == want[1] and got.cached_tokens == 64 and eng.cache.stats["ram"] >= 64
    assert spec_of(eng.runner.kv.k[0]) == P("tensor")

    hybrid = tiny_hybrid("qwen3_5", smollm.tokenizer, smollm.cfg.vocab_size)
    want = tokens(hybrid, prompts, n=4, prefix_cache=False)[0]
    eng = Engine(hybrid, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128, parallel=Parallel(4))
    assert [eng.generate([Request(q, p)])[0] for q in prompts][1].cached_tokens == 64
    assert [r.token_ids for r in eng.generate([Request(q, p) for q in prompts])] == want


@pytest.mark.extended
def test_the_loader_puts_each_tensor_straight_into_its_shards(smollm, prompts):
    """load_model(parallel=...): the real model's tensors split as they load (SmolLM2: 9 heads and 3
    KV heads over 3 devices; the FFN and vocabulary too), not fused, the same tokens as one device."""
    from infernix_jax.loader import load_model
    split = load_model("smollm2-135m-instruct", parallel=Parallel(3))
    layer = split.params["layers"][0]
    assert "wqkv" not in layer and spec_of(layer["wq"]) == P("tensor") and spec_of(layer["wk"]) == P("tensor")
    assert spec_of(layer["w_down"]) == P(None, "tensor") and spec_of(split.params["embed"]) == P("tensor")
    assert len(layer["wq"].sharding.device_set) == 3
    short = [p[:20] for p in prompts[:2]]
    assert tokens(split, short, Parallel(3), n=4)[0] == tokens(smollm, short, n=4)[0]


@pytest.mark.extended
def test_the_scaling_bench_runs_each_tensor_parallel_size(tmp_path, monkeypatch):
    """`infernix-bench shapes --tp 1,2` (here on CPU devices, where the numbers mean nothing): each
    size decodes and prefills, and its efficiency is reported against the first."""
    from scripts import bench_shapes
    monkeypatch.setattr(bench_shapes, "copy_bandwidth", lambda: 1e11)     # (the roofline's inputs: slow on
    monkeypatch.setattr(bench_shapes, "matmul_flops", lambda: 1e12)       # a CPU, unused here)
    rows = bench_shapes.scaling("smollm2-135m", str(tmp_path), [2], [32], [64], "reference", 2, [1, 2])
    assert [(r["tensor_parallel"], r["kind"]) for r in rows] == [(1, "decode"), (1, "prefill"), (2, "decode"),
                                                                  (2, "prefill")]
    assert all(r["tok_s"] > 0 for r in rows) and rows[0]["efficiency"] == 1.0
    assert rows[2]["efficiency"] == round(rows[2]["tok_s"] / rows[0]["tok_s"] / 2, 3)
    assert (tmp_path / "scaling-smollm2-135m.json").exists()
