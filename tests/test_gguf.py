"""GGUF loading: tiny files written the way llama.cpp writes them (q/k row permutation for llama,
quantized types), compared with transformers given exactly the stored weights; and the real
SmolLM2 GGUF compared with transformers loading the same file."""
import gguf
import numpy as np
import pytest

from hf_reference import hf_logits, load_into, make_hf_model, write_gguf, write_hybrid_gguf
from infernix_jax.loader import load_model
from infernix_jax.weights import ModelLoadError
from test_models import RTOL, ours_full, ours_prefill_decode, rel_err

Q = gguf.GGMLQuantizationType
CASES = {
    "llama": ("llama", dict(tie_word_embeddings=True)),
    "llama-bias": ("llama", dict(attention_bias=True, num_key_value_heads=1)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3moe": ("qwen3_moe", dict(norm_topk_prob=True, hidden_size=64, moe_intermediate_size=32)),
}


def mixed_quant(name, arr):
    """Several block types across the file, where the row length allows them."""
    cols = arr.shape[-1]
    if cols % 32:
        return None
    choices = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16]
    return choices[sum(map(ord, name)) % len(choices)]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("quant", [False, True], ids=["f32", "quantized"])
def test_tiny_gguf_matches_transformers(case, quant, tmp_path):
    family, overrides = CASES[case]
    hf = make_hf_model(family, seed=7, **overrides)
    stored = write_gguf(hf, tmp_path / "m.gguf", family, mixed_quant if quant else (lambda n, a: None))
    load_into(hf, stored)
    m = load_model(str(tmp_path / "m.gguf"), with_tokenizer=False)
    assert m.cfg.family == family
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, 9))
    ref = hf_logits(hf, tokens)
    assert rel_err(ours_full(m, tokens), ref) <= RTOL
    assert rel_err(ours_prefill_decode(m, tokens, 4), ref) <= RTOL


def test_dequantize_k_and_iq_types_through_loader(tmp_path):
    """K-quants and IQ types cannot be written by gguf-py, so the file holds random blocks of those
    types; what we load must equal gguf's own dequantization, row order and shape intact."""
    rng = np.random.default_rng(0)
    hf = make_hf_model("qwen2", seed=1, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=64)
    path = tmp_path / "k.gguf"
    kinds = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]
    raw = {}

    def quant(name, arr):
        if arr.shape[-1] != 256 or arr.ndim != 2 or "token_embd" in name:
            return None
        return kinds[len(raw) % len(kinds)] if raw.setdefault(name, True) else None

    import gguf.quants as gq
    orig_quantize = gq.quantize

    def fake_quantize(a, qtype):  # random bytes of the right block layout, scales kept finite
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (a.shape[0], a.shape[1] // block * nbytes), dtype=np.uint8)
        with np.errstate(all="ignore"):
            back = gq.dequantize(data, qtype)
        bad = ~np.isfinite(back).all(axis=1)
        data[bad] = 0
        return data

    gq.quantize = fake_quantize
    try:
        stored = write_gguf(hf, path, "qwen2", quant)
    finally:
        gq.quantize = orig_quantize
    m = load_model(str(path), with_tokenizer=False, fuse=False)          # each tensor as the file names it
    got = {
        "model.layers.0.self_attn.q_proj.weight": m.params["layers"][0]["wq"],
        "model.layers.0.mlp.gate_proj.weight": m.params["layers"][0]["w_gate"],
        "model.layers.1.self_attn.o_proj.weight": m.params["layers"][1]["wo"],
    }
    for name, arr in got.items():
        np.testing.assert_array_equal(np.asarray(arr), stored[name].astype(np.float32))


@pytest.mark.extended
@pytest.mark.slow
def test_smollm2_gguf_logits_match_transformers_loading_the_same_file(smollm):
    import torch
    import transformers
    path = smollm.path
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    ids = smollm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    tokens = np.asarray([ids])
    ref = hf_logits(hf, tokens)
    ours = ours_full(smollm, tokens)
    assert rel_err(ours, ref) <= RTOL
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.99


def test_load_errors_are_one_line_and_actionable(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model"):
        load_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))
    hf = make_hf_model("qwen3", seed=2)
    write_gguf(hf, tmp_path / "ok.gguf", "qwen3")
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(str(tmp_path / "cut.gguf"), with_tokenizer=False)
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + data[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_model(str(tmp_path / "bad.gguf"), with_tokenizer=False)
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'.*llama"):
        load_model(str(tmp_path / "mamba.gguf"), with_tokenizer=False)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'.*qwen3"):
        load_model(str(tmp_path / "cfg"))


# Hybrids: GGUF files record only full_attention_interval, so the layer pattern follows it.
HYBRID = {
    "qwen3next": ("qwen3_next", {}),
    "qwen35-tiled-v": ("qwen3_5", dict(tie_word_embeddings=True)),         # Hv = 2 Hk: value heads tiled
    "qwen35moe-tiled-v": ("qwen3_5_moe", dict(linear_num_value_heads=12)),  # Hv = 3 Hk
}


@pytest.mark.extended
@pytest.mark.parametrize("case", sorted(HYBRID))
def test_hybrid_gguf_as_llama_cpp_writes_it_matches_transformers(case, tmp_path):
    """Written with llama.cpp's conversions (norms as 1 + w, ssm_a = -exp(A_log), qkvz split, value
    heads tiled), loaded back: the same logits as transformers on the original weights."""
    family, overrides = HYBRID[case]
    hf = make_hf_model(family, seed=13, num_hidden_layers=4,
                        layer_types=["linear_attention", "full_attention"] * 2, **overrides)
    write_hybrid_gguf(hf, tmp_path / "m.gguf", family, mtp_blocks=1 if family == "qwen3_5" else 0)
    m = load_model(str(tmp_path / "m.gguf"), with_tokenizer=False)
    assert m.cfg.family == family and m.cfg.num_layers == 4
    assert m.cfg.layer_types == ("linear_attention", "full_attention") * 2
    tokens = np.random.default_rng(3).integers(0, m.cfg.vocab_size, (2, 11))
    ref = hf_logits(hf, tokens)
    assert rel_err(ours_full(m, tokens), ref) <= RTOL
    assert rel_err(ours_prefill_decode(m, tokens, 6), ref) <= RTOL


def test_hybrid_gguf_missing_ssm_key_is_a_clear_error(tmp_path):
    hf = make_hf_model("qwen3_5", seed=1, layer_types=["linear_attention", "full_attention"])
    write_hybrid_gguf(hf, tmp_path / "m.gguf", "qwen3_5")
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen35")
    for key, field in r.fields.items():
        if key.startswith("qwen35.") and key != "qwen35.ssm.group_count":
            w.add_key_value(key, field.contents(), field.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="ssm.group_count is missing"):
        load_model(str(tmp_path / "bad.gguf"), with_tokenizer=False)


def _same_as_gguf_reader(path, nested=()):
    """Our header reader (weights/gguf_header.py) against the gguf package's GGUFReader: every key's
    value, every tensor's name, type, dims, offset and data. nested: keys of arrays of arrays, which
    GGUFReader flattens (its FIXME) and we keep nested."""
    from infernix_jax.weights.gguf_header import Header
    ours, ref = Header(path), gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    for k in nested:
        assert [x for a in ours.fields[k] for x in a] == want[k]
    assert {k: v for k, v in ours.fields.items() if k not in nested} == {k: v for k, v in want.items()
                                                                         if k not in nested}
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_bytes, b.data_offset), a.name
        np.testing.assert_array_equal(a.shape, b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        np.testing.assert_array_equal(a.data, b.data)


def test_header_reader_reads_what_gguf_reads(tmp_path):
    """Every value type (scalars, strings, arrays of numbers, strings, bools and arrays), plain and
    quantized tensors, a non-default alignment; a truncated file is a clear error."""
    from infernix_jax.weights.gguf_header import Header
    from infernix_jax.weights.gguf_io import open_gguf
    rng = np.random.default_rng(5)
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -5), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -7), w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60), w.add_int64("t.i64", -2**40), w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True), w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ü" * 300] * 50)
    w.add_array("t.ints", [int(x) for x in rng.integers(-1000, 1000, 5000)])
    w.add_array("t.floats", [float(x) for x in rng.standard_normal(100)])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3, 4]])
    w.add_custom_alignment(64)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    w.add_tensor("i32", rng.integers(0, 9, (7,)).astype(np.int32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    _same_as_gguf_reader(path, nested=("t.nested",))
    assert Header(path).fields["t.nested"] == [[1, 2], [3, 4]]
    data = path.read_bytes()
    for cut in (100, len(data) - 200):        # in the header; in the last tensor
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated"):
            open_gguf(tmp_path / "cut.gguf")


@pytest.mark.slow
def test_header_reader_reads_the_default_model_as_gguf_does(smollm):
    _same_as_gguf_reader(smollm.path)
