"""`infernix-bench moe`: one MoE layer at a real shape's expert stack (random weights, GPU), the
grouped expert kernel (pallas_kernels/grouped_matmul.py) against the jnp paths measured in the same
run: the per-token gather of the chosen experts (N * k <= E) or every expert on every token.
Optionally with the experts quantized (--weights FMT). Warm-up calls precede every timing (the
first call of a process also warms the GPU's clocks)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

SHAPES = {  # hidden, experts, moe intermediate, top-k
    "qwen3-30b-a3b": (2048, 128, 768, 8),
    "qwen3.5-35b-a3b": (2048, 256, 512, 8),
}


def _ms(f, x, reps: int = 20, warm_s: float = 0.5) -> float:
    f(x).block_until_ready()
    t = time.perf_counter()
    while time.perf_counter() - t < warm_s:            # clocks up before the timing
        f(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        y = f(x)
    y.block_until_ready()
    return (time.perf_counter() - t) / reps * 1e3


def run(shape: str, tokens: list[int], weights: str | None, out: str) -> list[dict]:
    from infernix_jax.models.moe import _grouped_moe, moe_mlp
    if jax.default_backend() != "gpu":
        raise ValueError("infernix-bench moe times the compiled Pallas kernel: it needs a GPU")
    H, E, I, k = SHAPES[shape]
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    p = {"router": jax.random.normal(ks[0], (E, H), jnp.bfloat16) * 0.02,
         "e_gate": jax.random.normal(ks[1], (E, I, H), jnp.bfloat16) * 0.02,
         "e_up": jax.random.normal(ks[2], (E, I, H), jnp.bfloat16) * 0.02,
         "e_down": jax.random.normal(ks[3], (E, H, I), jnp.bfloat16) * 0.02}
    if weights:
        from infernix_jax.quant.formats import quantize
        p.update({n: quantize(p[n], weights) for n in ("e_gate", "e_up", "e_down")})
    rows = []
    for T in tokens:
        x = jax.random.normal(ks[4], (1, T, H), jnp.bfloat16)
        grouped = jax.jit(lambda x: _grouped_moe(x[0], p, k, True, "silu", interpret=False))   # whatever T
        plain = jax.jit(lambda x: moe_mlp(x, p, k, True, "silu"))
        g, j = _ms(grouped, x), _ms(plain, x)
        rows.append({"shape": shape, "weights": weights or "bf16", "tokens": T,
                     "jnp_path": "gather" if T * k <= E else "all experts", "grouped_ms": round(g, 3),
                     "jnp_ms": round(j, 3), "speedup": round(j / g, 2), "device": jax.devices()[0].device_kind})
        print(json.dumps(rows[-1]), flush=True)
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"bench-moe-{shape}{'-' + weights if weights else ''}.json").write_text(json.dumps(rows, indent=1))
    return rows


__all__ = ["SHAPES", "run"]
