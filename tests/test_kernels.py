"""Pallas attention kernels against their jnp references on fresh random inputs: interpret mode on
the CPU, compiled on the GPU (marked gpu). Tolerances are keyed by dtype."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_quant as kq
from pallas_kernels import paged_decode_attention as pda
from pallas_kernels import ragged_paged_attention as rpa

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]


def pool(rng, nKV, P, bs, hd, dtype):
    return (jnp.asarray(rng.standard_normal((nKV, P, bs, hd)), dtype),
            jnp.asarray(rng.standard_normal((nKV, P, bs, hd)), dtype))


KV_FORMATS = {"int8": ("int8", "int8"), "fp8": ("fp8", "fp8"), "k8v4": ("int8", "int4")}


def quantized_pool(rng, nKV, P, bs, hd, kv_dtype):
    """-> (k codes, v codes, {k_scale, v_scale, fmts}) of random rows whose magnitudes vary by row."""
    out, scales = [], []
    for f in KV_FORMATS[kv_dtype]:
        x = jnp.asarray(rng.standard_normal((nKV, P, bs, hd)) * rng.uniform(0.1, 4, (nKV, P, bs, 1)), jnp.float32)
        s = kq.row_scale(x, f)
        out.append(kq.encode(x, s, f))
        scales.append(s)
    return (*out, dict(k_scale=scales[0], v_scale=scales[1], fmts=KV_FORMATS[kv_dtype]))


def check(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    err = np.max(np.abs(out - ref)) / max(1.0, np.max(np.abs(ref)))
    assert err <= TOL[dtype], err


DECODE_CASES = [  # (nH, nKV, hd, bs, lengths, M)
    (8, 2, 64, 16, [1, 70, 128], 8),
    (4, 4, 128, 16, [33, 200], 16),
    (16, 2, 128, 16, [1000, 7], 64),       # several splits
    (8, 1, 256, 8, [31, 32, 33], 8),
]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_paged_decode_attention(case, dtype, interpret):
    nH, nKV, hd, bs, lengths, M = DECODE_CASES[case]
    if interpret and M == 64:
        pytest.skip("long case: compiled only (interpret mode is slow)")
    rng = np.random.default_rng(case)
    B = len(lengths)
    P = B * M + 3
    k, v = pool(rng, nKV, P, bs, hd, dtype)
    q = jnp.asarray(rng.standard_normal((B, nH, hd)), dtype)
    bt = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
    lens = jnp.asarray(lengths, jnp.int32)
    bsz = pda.BlockSizes(pages_per_compute_block=2, pages_per_split=4) if interpret else pda.BlockSizes()
    out = pda.paged_decode_attention(q, k, v, bt, lens, block_sizes=bsz, interpret=interpret)
    check(out, pda.paged_decode_attention_reference(q, k, v, bt, lens), dtype)


def test_split_pages_fills_the_gpu_at_small_batches():
    bs = pda.BlockSizes()                                     # 128 blocks a split, >= 264 programs
    assert pda.split_pages(64, 8, 256, bs) == 128             # a big batch: the fixed split
    assert pda.split_pages(1, 8, 64, bs) == 4                 # batch 1, 1K context: 16 splits of 4 blocks
    assert pda.split_pages(1, 8, 2048, bs) == 64              # batch 1, 32K: 32 splits
    assert pda.split_pages(4, 8, 256, bs) == 32               # 4 x 8 x 8 splits = 256 programs
    assert pda.split_pages(1, 8, 64, pda.BlockSizes(min_programs=0)) == 64
    assert pda.split_pages(1, 8, 1, bs) == 1


def test_small_splits_match_the_reference():
    """Splits shrunk to fill the GPU (min_programs) give the reference's result (interpret mode)."""
    nH, nKV, hd, bs, lengths, M = DECODE_CASES[0]
    rng = np.random.default_rng(7)
    P = len(lengths) * M + 3
    k, v = pool(rng, nKV, P, bs, hd, jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(lengths), nH, hd)), jnp.float32)
    bt = jnp.asarray(rng.permutation(P)[:len(lengths) * M].reshape(len(lengths), M), jnp.int32)
    lens = jnp.asarray(lengths, jnp.int32)
    bsz = pda.BlockSizes(pages_per_compute_block=2, pages_per_split=64, min_programs=64, min_pages_per_split=2)
    assert pda.split_pages(len(lengths), nKV, M, bsz) == 2    # 4 splits of 2 blocks
    out = pda.paged_decode_attention(q, k, v, bt, lens, block_sizes=bsz, interpret=True)
    check(out, pda.paged_decode_attention_reference(q, k, v, bt, lens), jnp.float32)


RAGGED_CASES = [  # (nH, nKV, hd, bs, q_lens, ctx_before, M, N)
    (6, 2, 32, 16, [5, 1, 37, 1], [0, 20, 11, 60], 8, 64),
    (8, 8, 64, 16, [16, 17], [0, 100], 16, 48),
    (4, 1, 128, 8, [70], [3], 16, 128),
    (16, 4, 256, 16, [1, 1, 1], [5, 16, 99], 8, 16),
]


def ragged_inputs(case: int, dtype, seed: int):
    """RAGGED_CASES[case] as fresh random inputs: q, k and v pools, block tables, kv_lens, cu_q."""
    nH, nKV, hd, bs, q_lens, before, M, N = RAGGED_CASES[case]
    rng = np.random.default_rng(seed)
    B = len(q_lens)
    P = B * M + 1
    k, v = pool(rng, nKV, P, bs, hd, dtype)
    q = jnp.asarray(rng.standard_normal((N, nH, hd)), dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    kv_lens = jnp.asarray([a + b for a, b in zip(q_lens, before)], jnp.int32)
    bt = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
    return q, k, v, bt, kv_lens, cu


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(RAGGED_CASES)))
def test_ragged_paged_attention(case, dtype, interpret):
    q, k, v, bt, kv_lens, cu = ragged_inputs(case, dtype, 10 + case)
    bsz = rpa.BlockSizes(block_rows=32, pages_per_compute_block=2) if interpret else rpa.BlockSizes()
    out = rpa.ragged_paged_attention(q, k, v, bt, kv_lens, cu, block_sizes=bsz, interpret=interpret)
    ref = rpa.ragged_paged_attention_reference(q, k, v, bt, kv_lens, cu)
    check(out, ref, dtype)
    assert not np.asarray(out[int(cu[-1]):], np.float32).any()   # padding rows stay zero


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(RAGGED_CASES)))
def test_ragged_reference_with_multi_rows_matches_the_full_one(case, dtype):
    """multi_rows (the rows that may hold several queries, padded with B) gives the same result as
    giving every row all N query slots: single-query rows attend as decodes, rows named but holding
    one query are not counted twice, and an empty multi_rows serves a step of decodes only."""
    q_lens = RAGGED_CASES[case][4]
    B = len(q_lens)
    q, k, v, bt, kv_lens, cu = ragged_inputs(case, dtype, 40 + case)
    full = rpa.ragged_paged_attention_reference(q, k, v, bt, kv_lens, cu)
    several = [b for b, n in enumerate(q_lens) if n > 1]
    for rows in (several, several + [B, B], list(range(B)) + [B]):   # exact, padded, every row named
        if not rows and B > 1:
            rows = [B]
        got = rpa.ragged_paged_attention_reference(q, k, v, bt, kv_lens, cu, multi_rows=jnp.asarray(rows, jnp.int32))
        check(got, full, dtype)
    if not several:
        got = rpa.ragged_paged_attention_reference(q, k, v, bt, kv_lens, cu, multi_rows=jnp.zeros((0,), jnp.int32))
        check(got, full, dtype)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_dtype", list(KV_FORMATS))
@pytest.mark.parametrize("case", [0, 3])
def test_paged_decode_attention_on_quantized_kv(case, kv_dtype, dtype, interpret):
    nH, nKV, hd, bs, lengths, M = DECODE_CASES[case]
    rng = np.random.default_rng(20 + case)
    B = len(lengths)
    P = B * M + 3
    k, v, quant = quantized_pool(rng, nKV, P, bs, hd, kv_dtype)
    q = jnp.asarray(rng.standard_normal((B, nH, hd)), dtype)
    bt = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
    lens = jnp.asarray(lengths, jnp.int32)
    bsz = pda.BlockSizes(pages_per_compute_block=2, pages_per_split=4) if interpret else pda.BlockSizes()
    out = pda.paged_decode_attention(q, k, v, bt, lens, block_sizes=bsz, interpret=interpret, **quant)
    ref = pda.paged_decode_attention_reference(q, k, v, bt, lens, **quant)
    check(out, ref, dtype)
    # and the reference is attention over the dequantized pools
    fk, fv = KV_FORMATS[kv_dtype]
    plain = pda.paged_decode_attention_reference(q, kq.decode(k, quant["k_scale"], fk).astype(dtype),
                                                 kq.decode(v, quant["v_scale"], fv).astype(dtype), bt, lens)
    check(ref, plain, dtype)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_dtype", list(KV_FORMATS))
@pytest.mark.parametrize("case", [0, 2])
def test_ragged_paged_attention_on_quantized_kv(case, kv_dtype, dtype, interpret):
    nH, nKV, hd, bs, q_lens, before, M, N = RAGGED_CASES[case]
    rng = np.random.default_rng(30 + case)
    B = len(q_lens)
    P = B * M + 1
    k, v, quant = quantized_pool(rng, nKV, P, bs, hd, kv_dtype)
    q = jnp.asarray(rng.standard_normal((N, nH, hd)), dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    kv_lens = jnp.asarray([a + b for a, b in zip(q_lens, before)], jnp.int32)
    bt = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
    bsz = rpa.BlockSizes(block_rows=32, pages_per_compute_block=2) if interpret else rpa.BlockSizes()
    out = rpa.ragged_paged_attention(q, k, v, bt, kv_lens, cu, block_sizes=bsz, interpret=interpret, **quant)
    ref = rpa.ragged_paged_attention_reference(q, k, v, bt, kv_lens, cu, **quant)
    check(out, ref, dtype)
    assert not np.asarray(out[int(cu[-1]):], np.float32).any()
    fk, fv = KV_FORMATS[kv_dtype]
    plain = rpa.ragged_paged_attention_reference(q, kq.decode(k, quant["k_scale"], fk).astype(dtype),
                                                 kq.decode(v, quant["v_scale"], fv).astype(dtype), bt, kv_lens, cu)
    check(ref, plain, dtype)


def test_kernels_validate_shapes():
    q = jnp.zeros((2, 8, 64))
    k = jnp.zeros((2, 4, 16, 32))
    with pytest.raises(ValueError, match="shape mismatch"):
        pda.paged_decode_attention(q, k, k, jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="do not match batch"):
        rpa.ragged_paged_attention(jnp.zeros((4, 8, 32)), k, k, jnp.zeros((2, 2), jnp.int32),
                                   jnp.ones((3,), jnp.int32), jnp.zeros((3,), jnp.int32), interpret=True)
    codes = jnp.zeros((2, 4, 16, 64), jnp.int8)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        pda.paged_decode_attention(q, codes, codes, jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32),
                                   fmts=("int8", "int8"), interpret=True)
    with pytest.raises(ValueError, match="do not hold"):          # bf16 pools read as codes
        pda.paged_decode_attention(q, codes.astype(jnp.bfloat16), codes.astype(jnp.bfloat16), jnp.zeros((2, 2), jnp.int32),
                                   jnp.ones((2,), jnp.int32), fmts=("int8", "int8"), interpret=True,
                                   k_scale=jnp.ones((2, 4, 16)), v_scale=jnp.ones((2, 4, 16)))
    with pytest.raises(ValueError, match="shape mismatch"):      # int4 values take hd / 2 bytes a row
        pda.paged_decode_attention(q, codes, codes, jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32),
                                   fmts=("int8", "int4"), interpret=True)
