"""What the two paged attention kernels (paged_decode_attention.py, ragged_paged_attention.py) share:
a block of the online softmax over KV blocks (attend_block, with the tiles of plain, quantized and
bf16p pools), the pools' BlockSpecs and extra operands, the checks of the pools against the queries,
and how many KV blocks fit in shared memory."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = 1.4426950408889634   # softmax in base 2: exp2 is one instruction, exp is exp2 plus a multiply


def fit_pages(bs: int, hd: int, dtype, stages: int, smem_budget: int = 160 * 1024) -> int:
    """Most KV blocks per iteration whose K and V tiles, pipelined `stages` deep, fit in shared
    memory (f32 tiles are twice the bf16 ones; Hopper has ~227 KiB per block)."""
    per_page = 2 * bs * hd * jnp.dtype(dtype).itemsize * max(stages, 1)
    return max(1, 1 << max(0, (smem_budget // per_page).bit_length() - 1))


def _dot_nt(a, b):
    """a [m, d] x b [n, d] -> [m, n] f32 (lax.dot_general: portable across Pallas versions)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    """a [m, k] x b [k, n] -> [m, n] f32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _tile(c, fmt: str, dtype) -> list:
    """A tile of codes [rows, hd'] as its values in dtype: a plain pool's tile itself; quantized, the
    codes' integers / e4m3 values (exact in bf16), int4 as two half-width tiles (low nibbles: the
    row's first half, high nibbles: its second half; kv_quant's layout)."""
    if not fmt:
        return [c]
    if fmt == "int4":
        return [((x.astype(jnp.int32) - 8).astype(jnp.float32)).astype(dtype) for x in (c & 0xF, c >> 4)]
    # (through f32: casting int8 / e4m3 straight to bf16 was up to 1.4x slower on the H200,
    # docs/bench/2026-12-04-kv-decode-cast-experiment.json)
    return [c.astype(jnp.float32).astype(dtype)]


def _bf16p_tile(ref, base_ref, esc_ref, pages):
    """Blocks `pages` [ppb] of one head's bf16p pool (kv_bf16p) -> their exact bf16 values
    [ppb * bs, hd]: sign|mantissa bytes, exponents as distances below each row's base (two a byte,
    interleaved), patched by the block's escapes (a compare and select per escape slot)."""
    ppb, bs, hd = pages.shape[0], ref.shape[1], ref.shape[2] * 2 // 3
    rows = ppb * bs
    sm = ref[pages, :, pl.ds(0, hd)].reshape(rows, hd).astype(jnp.int32)
    nb = ref[pages, :, pl.ds(hd, hd // 2)].reshape(rows, hd // 2)
    nib = jnp.stack([nb & 0xF, nb >> 4], axis=-1).reshape(rows, hd).astype(jnp.int32)
    base = base_ref[pages].reshape(rows, 1).astype(jnp.int32)
    e = jnp.where(nib == 15, 0, base - nib)
    pos = (jnp.arange(rows) % bs)[:, None] * hd + jnp.arange(hd)[None, :]          # place in the block
    for i in range(esc_ref.shape[-1]):
        r = jnp.broadcast_to(esc_ref[pages, pl.ds(i, 1)], (ppb, bs)).reshape(rows, 1)
        e = jnp.where((r != 0) & (pos == (r & 0xFFFF) - 1), r >> 16, e)
    bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _load(ref, scale_ref, pages, fmt: str, dtype, esc_ref=None):
    """Blocks `pages` [ppb] of one head's pool ref [P, bs, hd'] -> (tiles [block_k, hd / parts] (see
    _tile), row scales [block_k] f32 or None for a plain pool or a lossless bf16p one)."""
    if fmt == "bf16p":
        return [_bf16p_tile(ref, scale_ref, esc_ref, pages)], None
    c = ref[pages]
    ppb, bs = c.shape[0], c.shape[1]
    tiles = _tile(c.reshape(ppb * bs, c.shape[2]), fmt, dtype)
    return tiles, (scale_ref[pages].reshape(ppb * bs) if fmt else None)


def attend_block(q, o, m, l, k_ref, v_ref, ks_ref, vs_ref, pages, mask, scale: float, fmts, ke_ref=None,
                 ve_ref=None):
    """One online-softmax step over KV blocks `pages` for query rows q [R, hd] (shared by the
    decode and ragged kernels): o is a tuple of output parts [R, hd / parts] f32, m, l [R];
    mask(s) masks the scores [R, block_k]. Quantized keys scale each score column by its key's
    scale, quantized values each probability column by its value's scale: no per-element work."""
    fk, fv = fmts
    (k,), ks = _load(k_ref, ks_ref, pages, fk, q.dtype, ke_ref)
    s = _dot_nt(q, k)
    s = mask((s if ks is None else s * ks[None, :]) * scale)                  # [R, block_k], log2 units
    m_new = jnp.maximum(m, s.max(axis=-1))
    corr = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * corr + p.sum(axis=-1)
    vt, vs = _load(v_ref, vs_ref, pages, fv, q.dtype, ve_ref)
    pv = p if vs is None else p * vs[None, :]
    o = tuple(oi * corr[:, None] + _dot_nn(pv.astype(v.dtype), v) for oi, v in zip(o, vt))
    return o, m_new, l


def split_refs(refs, fmts):
    """A kernel's refs after the pools -> (k scales, v scales, k escapes, v escapes, outputs)."""
    n = {"": 0, "bf16p": 4}.get(fmts[0], 2)
    extra = list(refs[:n]) + [None] * (4 - n)
    return (*extra, refs[n:])


def value_parts(fmts) -> int:
    """How many half tiles a value row loads as (int4 values: 2)."""
    return 2 if fmts[1] == "int4" else 1


def check_pools(q, k_pool, v_pool, k_scale, v_scale, fmts, k_esc=None, v_esc=None):
    """-> (fmts as a pair, parts); clear errors for pools that do not match q or each other."""
    nH, hd = q.shape[-2:]
    fmts = tuple(fmts or ("", ""))
    nKV, P, bs = k_pool.shape[:3]
    if "bf16p" in fmts:
        if fmts != ("bf16p", "bf16p") or q.dtype != jnp.bfloat16:
            raise ValueError(f"bf16p pools hold bfloat16 keys and values (formats {fmts}, queries {q.dtype})")
        from .kv_bf16p import code_dims as packed_dims
        rows, E = (nKV, P, bs), (k_esc.shape[-1] if k_esc is not None else 0)
        if (k_pool.shape[3], v_pool.shape[3]) != (packed_dims(hd),) * 2 or v_pool.shape[:3] != rows \
                or k_pool.dtype != jnp.uint8 or nH % nKV:
            raise ValueError(f"shape mismatch: q {q.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}, formats {fmts}")
        if any(a is None for a in (k_scale, v_scale, k_esc, v_esc)) or k_scale.shape != rows \
                or v_scale.shape != rows or k_esc.shape != (nKV, P, E) or v_esc.shape != (nKV, P, E):
            raise ValueError(f"bf16p pools need row bases {rows} and escapes {(nKV, P, E)} for keys and values")
        return fmts, 1
    want = [code_dims(f, hd) for f in fmts]
    if (k_pool.shape[3], v_pool.shape[3]) != tuple(want) or v_pool.shape[:3] != (nKV, P, bs) or nH % nKV:
        raise ValueError(f"shape mismatch: q {q.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}, formats {fmts}")
    if fmts[0] == "int4" or bool(fmts[0]) != bool(fmts[1]):
        raise ValueError(f"unsupported KV formats {fmts}: keys int8/fp8 with values int8/fp8/int4, or neither")
    if not fmts[0]:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale / v_scale given for pools in the model dtype: pass fmts too")
        return fmts, 1
    from .kv_quant import code_dtype
    if (k_pool.dtype, v_pool.dtype) != tuple(jnp.dtype(code_dtype(f)) for f in fmts):
        raise ValueError(f"pools of {k_pool.dtype} / {v_pool.dtype} do not hold {fmts} codes")
    if k_scale is None or v_scale is None or k_scale.shape != (nKV, P, bs) or v_scale.shape != (nKV, P, bs):
        raise ValueError(f"quantized pools need k_scale and v_scale of shape {(nKV, P, bs)}")
    return fmts, value_parts(fmts)


def code_dims(fmt: str, hd: int) -> int:
    from .kv_bf16p import code_dims as packed_dims
    from .kv_quant import code_dims
    return packed_dims(hd) if fmt == "bf16p" else code_dims(fmt, hd) if fmt else hd


def pool_specs(P: int, bs: int, hd: int, fmts, head_of, escapes: int = 0) -> list:
    """BlockSpecs of one KV head's pools (and, quantized, its scales; bf16p, its row bases and
    escapes); head_of(*grid) -> the head."""
    dims = [code_dims(f, hd) for f in fmts]
    specs = [pl.BlockSpec((None, P, bs, d), lambda *g: (head_of(*g), 0, 0, 0)) for d in dims]
    if fmts[0]:
        specs += [pl.BlockSpec((None, P, bs), lambda *g: (head_of(*g), 0, 0))] * 2
    if fmts[0] == "bf16p":
        specs += [pl.BlockSpec((None, P, escapes), lambda *g: (head_of(*g), 0, 0))] * 2
    return specs


def extra_operands(fmts, k_scale, v_scale, k_esc, v_esc) -> tuple:
    """The operands after the pools, in pool_specs' order."""
    return () if not fmts[0] else (k_scale, v_scale, k_esc, v_esc) if fmts[0] == "bf16p" else (k_scale, v_scale)


def tile_dtype(fmts, pool_dtype, q_dtype):
    """The dtype of the K/V tiles a kernel holds, for sizing them (bf16p: rebuilt bf16; also keeps
    its tiling, hence its arithmetic, that of a BF16 pool)."""
    return q_dtype if fmts[0] == "bf16p" else pool_dtype
