"""GPU only: an engine on quantized KV (--kv-dtype) with the compiled Pallas attention kernels gives
the same greedy tokens as the jnp reference attention on the same quantized pools, for a dense
model and a hybrid. No torch and no downloaded model here, so it runs on a bare GPU machine."""
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


def small(shape: str):
    base = PRESETS[shape]
    n = 4
    hybrid = dict(layer_types=base.layer_types[:n], lin_k_heads=2,
                  lin_v_heads=2 * (base.lin_v_heads // base.lin_k_heads)) if base.layer_types else {}
    cfg = dataclasses.replace(base, hidden_size=256, intermediate_size=512, num_layers=n, num_heads=8, num_kv_heads=2,
                              head_dim=64, vocab_size=4096, **hybrid)
    return LoadedModel(name=shape, path="", cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0), scale=0.5),
                       tokenizer=IdsTokenizer(), dtype=jnp.float32)


@pytest.mark.parametrize("shape,kv_dtype", [("qwen3-8b", "int8"), ("qwen3-8b", "fp8"), ("qwen3-8b", "k8v4"),
                                            ("qwen3.5-27b", "k8v4")])     # (a hybrid compiles for minutes)
def test_compiled_kernels_on_quantized_kv_match_the_reference(shape, kv_dtype):
    model = small(shape)
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(1, 4000, n))) for n in (1, 9, 64, 130, 47, 200)]
    outs = {}
    for impl in ("reference", "pallas"):
        eng = Engine(model, max_num_seqs=8, max_num_batched_tokens=96, decode_steps=4, attn_impl=impl,
                     max_model_len=512, kv_cache_gib=0.25, kv_dtype=kv_dtype)
        res = eng.generate([Request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for p in prompts])
        outs[impl] = [r.token_ids for r in res]
        del eng
    assert outs["pallas"] == outs["reference"]
