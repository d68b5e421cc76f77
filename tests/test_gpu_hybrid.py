"""GPU only: the hybrid engine with the compiled Pallas kernels (Gated DeltaNet decode, paged and
ragged attention) gives the same greedy tokens as the jnp reference path. No torch and no
downloaded model here, so it runs on a bare GPU machine."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.config import PRESETS
from infernix_jax.engine import Engine, Request, SamplingParams
from infernix_jax.loader import LoadedModel
from infernix_jax.models import init_params
from scripts.bench_prefix import IdsTokenizer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", ["qwen3.5-27b", "qwen3.5-35b-a3b"])
def test_compiled_kernels_in_the_hybrid_engine_match_the_reference(shape):
    base = PRESETS[shape]
    cfg = dataclasses.replace(base, hidden_size=256, intermediate_size=512, num_layers=4,
                              layer_types=base.layer_types[:4], num_heads=4, num_kv_heads=2, head_dim=64,
                              lin_k_heads=2, lin_v_heads=2 * (base.lin_v_heads // base.lin_k_heads), vocab_size=4096,
                              num_experts=min(base.num_experts, 16), moe_intermediate_size=64,
                              shared_expert_intermediate_size=base.shared_expert_intermediate_size and 64)
    model = LoadedModel(name=shape, path="", cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0), scale=0.5),
                        tokenizer=IdsTokenizer(), dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 4000, n))) for n in (1, 9, 64, 130, 47, 200)]
    outs = {}
    for impl in ("reference", "pallas"):
        eng = Engine(model, max_num_seqs=8, max_num_batched_tokens=96, decode_steps=4, attn_impl=impl,
                     max_model_len=512, kv_cache_gib=0.25)
        res = eng.generate([Request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for p in prompts])
        outs[impl] = [r.token_ids for r in res]
        del eng
    assert outs["pallas"] == outs["reference"]
