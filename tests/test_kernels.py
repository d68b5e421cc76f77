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


@pytest.mark.parametrize("case", range(len(RAGGED_CASES)))
def test_ragged_reference_in_query_tiles_matches_one_pass(case, monkeypatch):
    """A wide pass (a long prompt's) goes a few queries at a time through the reference, each over the
    keys it sees a block at a time (an online softmax), so its scores stay bounded: the tiles give
    what one pass gives (draft trees too: every query's own bits)."""
    from pallas_kernels import paged_attention as pa
    q, k, v, bt, kv_lens, cu = ragged_inputs(case, jnp.float32, 70 + case)
    N = q.shape[0]
    anc = jnp.asarray(np.random.default_rng(case).integers(0, 2 ** 8, N), jnp.int32)
    lo = jnp.maximum(kv_lens - 3, 0)
    whole = [pa.ragged_paged_attention_reference(q, k, v, bt, kv_lens, cu, tree_lo=t, anc=a)
             for t, a in ((None, None), (lo, anc))]
    monkeypatch.setattr(pa, "SCORES_PER_TILE", 1)          # (the smallest tiles: one query,
    monkeypatch.setattr(pa, "KEY_BLOCK", 16)               # keys 16 at a time)
    for want, (t, a) in zip(whole, ((None, None), (lo, anc))):
        # (traced afresh: the jitted function's cache holds the one-pass form)
        got = pa.ragged_paged_attention_reference.__wrapped__(q, k, v, bt, kv_lens, cu, tree_lo=t, anc=a)
        check(got, want, jnp.float32)


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


TREE_CASES = [  # (nH, nKV, hd, bs, [(tokens before the tree in the row's chunk, tree nodes)], context, M)
    (8, 2, 64, 16, [(1, 7), (3, 12)], [40, 5], 8),
    (4, 4, 128, 8, [(2, 31), (1, 1)], [100, 9], 32),
]


def random_tree(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A random draft tree of n nodes in topological order: parents [n] (-1: a child of the root)
    and each node's ancestor bits [n] (its own included)."""
    parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, n)], np.int32)
    anc = np.zeros(n, np.int64)
    for i, p in enumerate(parents):
        anc[i] = (1 << i) | (anc[p] if p >= 0 else 0)
    return parents, anc.astype(np.uint32).view(np.int32)


def dense_tree_attention(q, k, v, bt, kv_lens, cu, tree_lo, anc):
    """The tree mask written out: each query over the slots it may see, one at a time (numpy, f32)."""
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    nKV, bs, hd = k.shape[0], k.shape[2], k.shape[3]
    G = q.shape[1] // nKV
    out = np.zeros_like(q)
    for b in range(len(kv_lens)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        for t in range(lo, hi):
            pos = int(kv_lens[b]) - (hi - lo) + (t - lo)
            seen = [s for s in range(pos + 1) if s < tree_lo[b] or (int(anc[t]) >> (s - tree_lo[b])) & 1]
            blocks = np.asarray(bt[b])[np.asarray(seen) // bs]
            for h in range(q.shape[1]):
                K = k[h // G, blocks, np.asarray(seen) % bs]                  # [S, hd]
                V = v[h // G, blocks, np.asarray(seen) % bs]
                s = K @ q[t, h] * hd ** -0.5
                p = np.exp(s - s.max())
                out[t, h] = p @ V / p.sum()
    return out


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(TREE_CASES)))
def test_ragged_attention_with_draft_trees(case, dtype, interpret):
    """Rows ending in a draft tree (speculative decoding): each node sees the context and its
    ancestors only. The reference (with and without multi_rows) and the kernel against the mask
    written out query by query; a row without a tree beside them keeps plain causal attention."""
    nH, nKV, hd, bs, rows, context, M = TREE_CASES[case]
    rng = np.random.default_rng(70 + case)
    B = len(rows) + 1                                           # + a plain chunk of 5 tokens
    q_lens = [a + n for a, n in rows] + [5]
    before = list(context) + [20]
    P = B * M + 1
    k, v = pool(rng, nKV, P, bs, hd, dtype)
    N = sum(q_lens) + 3
    q = jnp.asarray(rng.standard_normal((N, nH, hd)), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.asarray([a + b for a, b in zip(q_lens, before)], np.int32)
    bt = rng.permutation(P)[:B * M].reshape(B, M).astype(np.int32)
    tree_lo = np.full((B,), 2**30, np.int32)
    anc = np.zeros((N,), np.int32)
    for b, (a, n) in enumerate(rows):
        tree_lo[b] = before[b] + a
        anc[cu[b] + a:cu[b] + a + n] = random_tree(rng, n)[1]
    want = dense_tree_attention(q, k, v, bt, kv_lens, cu, tree_lo, anc)
    args = (q, k, v, jnp.asarray(bt), jnp.asarray(kv_lens), jnp.asarray(cu))
    tree = dict(tree_lo=jnp.asarray(tree_lo), anc=jnp.asarray(anc))
    check(rpa.ragged_paged_attention_reference(*args, **tree), want, dtype)
    check(rpa.ragged_paged_attention_reference(*args, **tree, multi_rows=jnp.arange(B, dtype=jnp.int32)), want, dtype)
    bsz = rpa.BlockSizes(block_rows=32, pages_per_compute_block=2) if interpret else rpa.BlockSizes()
    check(rpa.ragged_paged_attention(*args, **tree, block_sizes=bsz, interpret=interpret), want, dtype)
