"""Measuring what a route costs in output (infernix-quality): next-token distributions of a text
through the served path (paged prefill, the route's kernels and dtypes), compared with the exact
route of the unquantized model by llama.cpp's statistics, and the honest-rounding floor of each
weight format.

Routes. "lossless": float32 activations, every matmul in full f32 (no TF32), the jnp reference
attention and dequantize-then-multiply: the reference. "default": what `infernix-serve` runs with
the same flags (the model dtype asked for, the Pallas kernels on a GPU).

Honest rounding of a format: the reference's weights (the same matrices the format quantizes)
rounded to nearest onto the format's value grid (int8, e4m3, 16 levels from the group's minimum to
its maximum for int4, e2m1) with an exact f32 scale (and int4's exact offset) per the format's
group and nothing else changed: no scale rounding (e8m0, e4m3), no integer zero points, f32
arithmetic. Its KL is what rounding to that many bits costs by itself; a route's KL over it is
what the format's own choices and the route's arithmetic add."""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .quant.apply import quantized_names
from .quant.formats import F8, F8_MAX, E2M1_MAX, _e2m1_codes, E2M1

# value grid and group of each format's honest rounding: (grid, group along the input axis, tile
# rows: 128 for fp8b's 128 x 128 tiles, 1 otherwise); group 0 means one scale per output channel.
# uint4: 16 evenly spaced levels from the group's minimum to its maximum (exact scale and offset)
HONEST = {"int8": ("int8", 0, 1), "fp8": ("e4m3", 0, 1), "fp8b": ("e4m3", 128, 128), "mxfp8": ("e4m3", 32, 1),
          "int4": ("uint4", 128, 1), "nvfp4": ("e2m1", 16, 1)}
GRID_MAX = {"int8": 127.0, "e4m3": F8_MAX, "e2m1": E2M1_MAX}


def _round_grid(x, grid: str):
    if grid == "int8":
        return jnp.round(x)
    if grid == "e4m3":
        return x.astype(F8).astype(jnp.float32)
    return jnp.asarray(E2M1)[_e2m1_codes(x)]


@partial(jax.jit, static_argnums=1)
def honest_round(w, fmt: str):
    """w [..., O, I] -> w rounded as described in the module doc (f32)."""
    grid, g, rows = HONEST[fmt]
    w = w.astype(jnp.float32)
    O, I = w.shape[-2:]
    gi = I if g == 0 else g
    pad_i, pad_o = -I % gi, -O % rows
    t = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, pad_o), (0, pad_i)])
    t = t.reshape(*t.shape[:-2], t.shape[-2] // rows, rows, t.shape[-1] // gi, gi)   # [..., nO, r, nI, g]
    if grid == "uint4":
        lo, hi = jnp.min(t, axis=(-3, -1), keepdims=True), jnp.max(t, axis=(-3, -1), keepdims=True)
        s = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0)
        q = lo + jnp.round((t - lo) / s) * s
    else:
        amax = jnp.max(jnp.abs(t), axis=(-3, -1), keepdims=True)
        s = jnp.where(amax > 0, amax / GRID_MAX[grid], 1.0)
        q = _round_grid(t / s, grid) * s
    q = q.reshape(*q.shape[:-4], O + pad_o, I + pad_i)
    return q[..., :O, :I]


def honest_params(params: dict, fmt: str) -> dict:
    """The reference's params with the matrices that `fmt` quantizes honestly rounded."""
    layers = []
    for p in params["layers"]:
        names = quantized_names(p, fmt)
        layers.append({k: (honest_round(v, fmt).astype(v.dtype) if k in names else v) for k, v in p.items()})
    return {**params, "layers": layers}


def windows(ids: list[int], ctx: int, max_tokens: int | None) -> list[list[int]]:
    """Non-overlapping windows of ctx tokens (the last one may be shorter, if at least half); a
    text shorter than that is one window if it has at least 8 tokens."""
    ids = ids[:max_tokens] if max_tokens else ids
    out = [ids[i:i + ctx] for i in range(0, len(ids), ctx)]
    return [w for w in out if len(w) >= max(8, ctx // 2)] or ([ids] if len(ids) >= 8 else [])


def window_logprobs(params, cfg, ids: list[int], dtype, attn_impl: str, block_size: int = 16,
                    chunk: int = 0, kv_dtype: str = ""):
    """Log-probabilities [T, V] (numpy f32) of the next token at every position of ids, through the
    paged path the server runs (a fresh pool): one prefill, or pieces of `chunk` tokens (few rows
    run the fused quantized matmul, as decode does; a whole window runs prefill's XLA route)."""
    from types import SimpleNamespace
    from .engine.runner import Runner
    from .route import Route
    T = len(ids)
    runner = Runner(SimpleNamespace(cfg=cfg, params=params, dtype=dtype), -(-T // block_size) + 1, block_size,
                    Route.named(attn_impl, kv_dtype), state_slots=1)
    step = chunk or T
    return np.concatenate([np.asarray(runner.score(jnp.asarray(ids[lo:lo + step], jnp.int32), lo), np.float32)
                           for lo in range(0, T, step)])


@dataclasses.dataclass
class Stats:
    mean_kl: float
    p99_kl: float
    p999_kl: float
    max_kl: float
    same_top: float
    ppl: float
    ppl_ratio: float
    tokens: int

    def row(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


def scored(lp, ids: list[int]):
    """The rows of a window's log-probs [T, V] that are scored: the second half of the window (every
    position then has at least half a window of context), less the last (its next token is unknown)."""
    return lp[len(ids) // 2:len(ids) - 1]


def compare(ref, got, targets: list) -> Stats:
    """llama.cpp's KL statistics of got against ref, each an iterable of the windows' scored()
    log-probs (got may be a generator: one window is in memory at a time). targets: each window's
    ids (the text's real next tokens give the perplexities)."""
    kls, same, nll_ref, nll_got = [], [], [], []
    for r, g, ids in zip(ref, got, targets):
        lo = len(ids) // 2
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        nxt = np.asarray(ids[lo + 1:])
        kls.append(np.maximum((np.exp(r) * (r - g)).sum(-1), 0.0))
        same.append(r.argmax(-1) == g.argmax(-1))
        nll_ref.append(-r[np.arange(len(nxt)), nxt])
        nll_got.append(-g[np.arange(len(nxt)), nxt])
    kl, same = np.concatenate(kls), np.concatenate(same)
    ppl_ref, ppl = float(np.exp(np.concatenate(nll_ref).mean())), float(np.exp(np.concatenate(nll_got).mean()))
    return Stats(mean_kl=float(kl.mean()), p99_kl=float(np.percentile(kl, 99)), p999_kl=float(np.percentile(kl, 99.9)),
                 max_kl=float(kl.max()), same_top=float(same.mean()), ppl=ppl, ppl_ratio=ppl / ppl_ref,
                 tokens=int(kl.size))


__all__ = ["HONEST", "Stats", "compare", "honest_params", "honest_round", "scored", "window_logprobs", "windows"]
