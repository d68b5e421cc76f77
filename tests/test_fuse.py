"""Projections fused at load (models/fuse.py): q/k/v and gate/up become one matrix each, stored
as the parts were (plain, quantized, 12-bit packed), and the model's output does not change."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.loader import load_model
from infernix_jax.models.fuse import concat_rows, fuse_layer
from infernix_jax.quant.formats import QTensor, dequantize, quantize
from infernix_jax.quant.packed import Packed12, pack, unpack
from test_models import CASES, make_hf_model, ours_full


def _save(case: str, d) -> str:
    family, over = CASES[case]
    make_hf_model(family, **over).save_pretrained(d)
    return str(d)


def _parts(seed: int, rows=(64, 16, 16), cols: int = 256, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), len(rows))
    return [(jax.random.normal(k, (r, cols), jnp.float32) * 0.05).astype(dtype) for k, r in zip(ks, rows)]


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8b", "mxfp8", "int4"])
def test_quantized_parts_fuse_into_the_quantized_whole(fmt):
    """Formats whose scales belong to output rows (or 128-row blocks) fuse by concatenation: the
    same arrays, bit for bit, as quantizing the concatenated matrix."""
    rows = (256, 128, 128) if fmt == "fp8b" else (64, 16, 16)
    parts = _parts(1, rows)
    fused = concat_rows([quantize(w, fmt) for w in parts])
    whole = quantize(jnp.concatenate(parts), fmt)
    assert isinstance(fused, QTensor) and fused.shape == whole.shape and fused.fmt == fmt
    for a, b in zip(fused.arrays, whole.arrays):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_parts_that_cannot_share_storage_stay_apart():
    """nvfp4 parts each have a tensor scale; fp8b needs whole 128-row blocks; mixed formats and
    mixed kinds have no one storage: fuse_layer leaves such parts as they are."""
    parts = _parts(2)
    assert concat_rows([quantize(w, "nvfp4") for w in parts]) is None
    assert concat_rows([quantize(w, "fp8b") for w in parts]) is None          # 16-row k and v
    assert concat_rows([quantize(parts[0], "int8"), quantize(parts[1], "int4"), quantize(parts[2], "int8")]) is None
    assert concat_rows([parts[0], quantize(parts[1], "int8"), parts[2]]) is None
    layer = {"wq": quantize(parts[0], "int8"), "wk": quantize(parts[1], "int8"), "wv": quantize(parts[2], "int4"),
             "w_gate": parts[0], "w_up": parts[0] * 2, "w_down": parts[0].T}
    fused = fuse_layer(layer)
    assert {"wq", "wk", "wv", "w_gate_up"} <= fused.keys() and "wqkv" not in fused and "w_gate" not in fused


def test_packed_parts_fuse_bit_for_bit():
    """12-bit packed parts fuse whatever their exponent windows (escapes re-indexed; one base per
    row where the parts' windows differ), so a bf16p model multiplies the plain one's shapes."""
    parts = _parts(3, dtype=jnp.bfloat16)
    parts[1] = parts[1].at[3, 5].set(1e-30)                 # an escape in a later part
    parts[2] = (parts[2].astype(jnp.float32) * 2.0 ** 20).astype(jnp.bfloat16)     # a window of its own
    packed = [pack(w) for w in parts]
    assert int(packed[0].base) == int(packed[1].base) != int(packed[2].base) and packed[1].esc_idx.shape[0] >= 1
    for group in (packed[:2], packed):
        fused = concat_rows(group)
        assert isinstance(fused, Packed12) and fused.base.ndim == (0 if len(group) == 2 else 2)
        want = np.asarray(jnp.concatenate(parts[:len(group)])).view(np.uint16)
        np.testing.assert_array_equal(np.asarray(unpack(fused)).view(np.uint16), want)


@pytest.mark.parametrize("case", ["qwen2-bias-gqa4", "qwen3moe-norm", "qwen3next-moe-shared", "qwen3_5-dense"])
def test_fused_model_gives_the_unfused_logits(case, tmp_path):
    """Each family (biases, MoE, a hybrid's gated attention and shared expert) loads fused, and its
    logits match the same checkpoint loaded with its projections apart."""
    path = _save(case, tmp_path)
    fused, apart = load_model(path, with_tokenizer=False), load_model(path, with_tokenizer=False, fuse=False)
    names = set().union(*(p.keys() for p in fused.params["layers"]))
    assert "wqkv" in names and not {"wq", "wk", "wv", "w_gate", "w_up", "s_gate", "s_up"} & names
    assert ("w_gate_up" in names) == ("w_down" in names) and ("s_gate_up" in names) == ("s_down" in names)
    assert "wqkv" not in set().union(*(p.keys() for p in apart.params["layers"]))
    tokens = np.random.default_rng(0).integers(0, fused.cfg.vocab_size, (2, 9))
    a, b = ours_full(fused, tokens), ours_full(apart, tokens)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_quantized_fused_model_computes_as_its_dequantized_weights(tmp_path):
    """--weights int8 on a fused model quantizes the fused matrices, each row as its part's row."""
    path = _save("qwen3-qknorm", tmp_path)
    q = load_model(path, with_tokenizer=False, weights="int8")
    apart = load_model(path, with_tokenizer=False, weights="int8", fuse=False)
    lq, la = q.params["layers"][0], apart.params["layers"][0]
    np.testing.assert_array_equal(np.asarray(dequantize(lq["wqkv"])),
                                  np.concatenate([np.asarray(dequantize(la[n])) for n in ("wq", "wk", "wv")]))
