"""The device KV pool the paged forwards read and write: its layout (PagedKV: one K and V pool per
attention layer, optional quantized codes and scales, the hybrids' state pools), its sizes in bytes,
and `paged_attend`, which writes a layer's K/V at their slots and attends over the pool. Both
forwards (llama/paged.py, qwen3_5/paged.py) build on it."""
from __future__ import annotations

import math
from functools import partial

import jax.numpy as jnp
from flax import struct

from pallas_kernels import kv_bf16p
from pallas_kernels import kv_quant as kq
from pallas_kernels import paged_attention as pa

from .. import choices
from ..config import ModelConfig
from ..sharding import on_heads
from ..route import Route


@struct.dataclass
class PagedKV:
    """The engine's device cache. k[j], v[j] [nKV, P, bs, hd]: one pair per attention layer (every
    layer, except in hybrids). Hybrids only, one per linear (Gated DeltaNet) layer, indexed by state
    slot (one per running sequence): conv[j] [S, K-1, C] in the model dtype, ssm[j] [S, Hv, dk, dv] fp32."""
    k: tuple
    v: tuple
    conv: tuple = ()
    ssm: tuple = ()
    # --kv-dtype (pallas_kernels/kv_quant.py): k[j], v[j] hold codes, k_scale[j], v_scale[j]
    # [nKV, P, bs] one f32 scale per head and token row; "" (the model dtype): no scales. Which
    # format the codes are in is the step's route's (route.py: Route.kv_dtype), not the pool's
    k_scale: tuple = ()
    v_scale: tuple = ()
    # bf16p (pallas_kernels/kv_bf16p.py): k_scale / v_scale hold each row's base exponent, k_esc[j],
    # v_esc[j] [nKV, P, E] int32 each block's escapes; lost [P] bool marks blocks a write could not
    # pack (sticky until the engine reads and clears it: their requests fail)
    k_esc: tuple = ()
    v_esc: tuple = ()
    lost: object = None

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[1]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]


def num_attention_layers(cfg: ModelConfig) -> int:
    """The model's own attention layers (the pool's first ones)."""
    return sum(not cfg.is_linear_layer(i) for i in range(cfg.num_layers))


def num_kv_layers(cfg: ModelConfig) -> int:
    """The pool's K/V layers: the model's attention layers, then its MTP head's (cfg.mtp_layers is 0
    unless the engine drafts with it: engine/spec/mtp.py)."""
    return num_attention_layers(cfg) + cfg.mtp_layers


# --kv-dtype -> (key format, value format) of kv_quant (bf16p: kv_bf16p, lossless)
KV_DTYPES = {"int8": ("int8", "int8"), "fp8": ("fp8", "fp8"), "k8v4": ("int8", "int4"), "bf16p": ("bf16p", "bf16p")}
assert tuple(KV_DTYPES) == choices.KV_DTYPES, "choices.KV_DTYPES is what --kv-dtype offers"


def check_kv_dtype(kv_dtype: str, head_dim: int | None = None, dtype=None) -> None:
    if kv_dtype and kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown --kv-dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "bf16p" and dtype is not None and jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"--kv-dtype bf16p packs bfloat16 K and V losslessly: the model runs in {jnp.dtype(dtype).name} "
                         f"(add --dtype bfloat16)")
    if kv_dtype == "bf16p" and head_dim is not None and head_dim % 2:
        raise ValueError(f"--kv-dtype bf16p packs two exponent codes a byte: head_dim {head_dim} is odd")
    if head_dim is not None and "int4" in KV_DTYPES.get(kv_dtype, ()) and head_dim % 2:
        raise ValueError(f"--kv-dtype {kv_dtype} packs two 4-bit values a byte: head_dim {head_dim} is odd")


def init_paged_kv(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, state_slots: int = 0,
                  kv_dtype: str = "") -> PagedKV:
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    n_attn = num_kv_layers(cfg)
    check_kv_dtype(kv_dtype, cfg.head_dim, dtype)
    if kv_dtype == "bf16p":
        kv_bf16p.check_block(block_size, cfg.head_dim)
    conv, ssm = (), ()
    if cfg.layer_types:
        from .qwen3_5.model import state_shapes
        (cs, cd), (ss, sd) = state_shapes(cfg, state_slots, dtype)
        n_lin = cfg.num_layers - num_attention_layers(cfg)
        conv = tuple(jnp.zeros(cs, cd) for _ in range(n_lin))
        ssm = tuple(jnp.zeros(ss, sd) for _ in range(n_lin))
    if kv_dtype == "bf16p":
        pools = lambda: tuple(jnp.zeros((*shape[:3], kv_bf16p.code_dims(shape[3])), jnp.uint8)  # noqa: E731
                              for _ in range(n_attn))
        rows = lambda: tuple(jnp.zeros(shape[:3], jnp.float32) for _ in range(n_attn))          # noqa: E731
        esc = lambda: tuple(jnp.zeros((*shape[:2], kv_bf16p.ESCAPES), jnp.int32) for _ in range(n_attn))  # noqa: E731
        return PagedKV(k=pools(), v=pools(), conv=conv, ssm=ssm, k_scale=rows(), v_scale=rows(),
                       k_esc=esc(), v_esc=esc(), lost=jnp.zeros((num_blocks,), bool))
    if kv_dtype:
        fk, fv = KV_DTYPES[kv_dtype]
        pool = lambda f: jnp.zeros((*shape[:3], kq.code_dims(f, shape[3])), kq.code_dtype(f))  # noqa: E731
        scales = lambda: tuple(jnp.zeros(shape[:3], jnp.float32) for _ in range(n_attn))      # noqa: E731
        return PagedKV(k=tuple(pool(fk) for _ in range(n_attn)), v=tuple(pool(fv) for _ in range(n_attn)),
                       conv=conv, ssm=ssm, k_scale=scales(), v_scale=scales())
    return PagedKV(k=tuple(jnp.zeros(shape, dtype) for _ in range(n_attn)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(n_attn)), conv=conv, ssm=ssm)


def kv_bytes_per_block(cfg: ModelConfig, dtype, kv_dtype: str = "", block_size: int = 16) -> int:
    """K and V bytes of one block of block_size tokens over all attention layers (quantized: codes
    plus the f32 scale of each row)."""
    check_kv_dtype(kv_dtype, cfg.head_dim, dtype)     # (the plan too refuses what the pool would)
    if kv_dtype == "bf16p":
        kv_bf16p.check_block(block_size, cfg.head_dim)
    per = num_kv_layers(cfg) * cfg.num_kv_heads
    if not kv_dtype:
        return 2 * per * block_size * cfg.head_dim * jnp.dtype(dtype).itemsize
    if kv_dtype == "bf16p":                 # codes, a base per row, the block's escapes
        return 2 * per * (block_size * (kv_bf16p.code_dims(cfg.head_dim) + 4) + 4 * kv_bf16p.ESCAPES)
    return per * block_size * sum(kq.code_dims(f, cfg.head_dim) * jnp.dtype(kq.code_dtype(f)).itemsize + 4
                     for f in KV_DTYPES[kv_dtype])


def kv_bytes_per_token(cfg: ModelConfig, dtype, kv_dtype: str = "", block_size: int = 16) -> float:
    """K and V bytes one token takes in the pool (quantized: with its scales)."""
    return kv_bytes_per_block(cfg, dtype, kv_dtype, block_size) / block_size


def state_bytes_per_seq(cfg: ModelConfig, dtype) -> int:
    """Hybrids: the conv and SSM states of one sequence over all linear layers (0 otherwise)."""
    if not cfg.layer_types:
        return 0
    from .qwen3_5.model import state_shapes
    n_lin = cfg.num_layers - num_attention_layers(cfg)
    return n_lin * sum(math.prod(s) * jnp.dtype(d).itemsize
                       for s, d in state_shapes(cfg, 1, dtype))


def move_slots(kv: PagedKV, src, dst) -> PagedKV:
    """Copy every layer's K/V rows (codes and scales alike) at flat slots src [S] to dst [S] (block
    * block_size + offset; a dst out of range is skipped): a draft tree's accepted nodes moved to the
    slots of their positions. All rows are read before any is written. Not for bf16p pools (their
    escapes are per block)."""
    assert not kv.k_esc, "bf16p pools cannot move rows"

    def mv(a):                      # [nKV, P, bs, ...] -> rows [nKV, P * bs, ...] (a free reshape)
        flat = a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])
        rows = flat[:, jnp.clip(src, 0, flat.shape[1] - 1)]
        return flat.at[:, dst].set(rows, mode="drop").reshape(a.shape)
    each = lambda t: tuple(mv(a) for a in t)  # noqa: E731
    return kv.replace(k=each(kv.k), v=each(kv.v), k_scale=each(kv.k_scale), v_scale=each(kv.v_scale))


def _attention_fns(route: Route):
    if route.pallas:
        from pallas_kernels import paged_decode_attention as pdk, ragged_paged_attention as rpk
        interpret = route.interpret
        # on a mesh each device runs the kernels on its own heads (a Pallas call is not split by XLA)
        return (on_heads(partial(pdk.paged_decode_attention, interpret=interpret)),
                on_heads(partial(rpk.ragged_paged_attention, interpret=interpret)))
    return pa.paged_decode_attention_reference, pa.ragged_paged_attention_reference


def paged_attend(kv: PagedKV, slots, block_tables, kv_lens, cu_q, route: Route, multi_rows=None, tree=None):
    """-> (attend, pools): attend(j, q, k, v) writes attention layer j's k/v [1, N, nKV, hd] into the
    pool (of the route's KV format) at their slots and attends q [1, N, nH, hd] (ragged with cu_q,
    one token per row without), with the route's kernels;
    pools() gives the updated k, v (and scales) as PagedKV fields. multi_rows: see
    ragged_paged_attention_reference (the kernels need no such hint). tree: None or (tree_lo [B],
    anc [N]), the draft trees of a verify step (pallas_kernels/paged_attention.py)."""
    decode_fn, ragged_fn = _attention_fns(route)
    if multi_rows is not None and ragged_fn is pa.ragged_paged_attention_reference:
        ragged_fn = partial(ragged_fn, multi_rows=multi_rows)
    if tree is not None:
        ragged_fn = partial(ragged_fn, tree_lo=tree[0], anc=tree[1])
    k_pool, v_pool, k_scale, v_scale = list(kv.k), list(kv.v), list(kv.k_scale), list(kv.v_scale)
    k_esc, v_esc, lost = list(kv.k_esc), list(kv.v_esc), [kv.lost]

    def attend(j, q, k, v):
        if route.kv_dtype == "bf16p":
            k_pool[j], k_scale[j], k_esc[j], lk = kv_bf16p.write(k_pool[j], k_scale[j], k_esc[j], k[0], slots)
            v_pool[j], v_scale[j], v_esc[j], lv = kv_bf16p.write(v_pool[j], v_scale[j], v_esc[j], v[0], slots)
            bs = k_pool[j].shape[2]
            lost[0] = lost[0].at[slots // bs].max(lk | lv, mode="drop")
            extra = dict(k_scale=k_scale[j], v_scale=v_scale[j], k_esc=k_esc[j], v_esc=v_esc[j],
                         fmts=("bf16p", "bf16p"))
        elif route.kv_dtype:
            fk, fv = KV_DTYPES[route.kv_dtype]
            k_pool[j], k_scale[j] = kq.write(k_pool[j], k_scale[j], k[0], slots, fk)
            v_pool[j], v_scale[j] = kq.write(v_pool[j], v_scale[j], v[0], slots, fv)
            extra = dict(k_scale=k_scale[j], v_scale=v_scale[j], fmts=(fk, fv))
        else:
            k_pool[j], v_pool[j] = pa.write_kv(k_pool[j], v_pool[j], k[0], v[0], slots)
            extra = {}
        if cu_q is None:
            o = decode_fn(q[0], k_pool[j], v_pool[j], block_tables, kv_lens, **extra)
        else:
            o = ragged_fn(q[0], k_pool[j], v_pool[j], block_tables, kv_lens, cu_q, **extra)
        return o[None]

    def pools() -> dict:
        return dict(k=tuple(k_pool), v=tuple(v_pool), k_scale=tuple(k_scale), v_scale=tuple(v_scale),
                    k_esc=tuple(k_esc), v_esc=tuple(v_esc), lost=lost[0])
    return attend, pools

