"""GGUF blocks kept quantized on the device (`--weights gguf`, infernix_jax/quant/ggml.py): the
repacked blocks decode bit-identically to gguf-py's own dequantization; the fused matmul kernel
reads them (interpret mode on the CPU, compiled on the GPU, lowered to Triton from the CPU) as the
reference does; a GGUF file of mixed block types served on its blocks matches transformers given
the stored weights; the real SmolLM2 file gives the very logits of dequantizing at load."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.loader import load_model
from infernix_jax.route import Route, use
from infernix_jax.quant.formats import dequantize, nominal_bits
from infernix_jax.quant.ggml import GGML_FORMATS, from_blocks, random_blocks
from infernix_jax.weights import ModelLoadError
from pallas_kernels.quant_matmul import BlockSizes, unsupported

Q = gguf.GGMLQuantizationType
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
CASES = [  # (M, N, K, block sizes): a decode row, odd rows with a K split, many rows in one K step
    (1, 192, 512, None),
    (37, 64, 768, BlockSizes(bm=16, bn=32, bk=128, split=3)),
    (130, 32, 256, BlockSizes(bm=64, bn=32, bk=256, split=1)),
    (2, 64, 512, BlockSizes(bm=16, bn=32, bk=256, split=2)),               # two blocks per K step
    (3, 32, 512, BlockSizes(bm=16, bn=32, bk=64, split=2)),                # a step inside one block
]


# (transformers and torch are imported by the tests that use them: the GPU machine runs this file
# without them)


def blocks(seed: int, fmt: str, rows: int, cols: int):
    return random_blocks(np.random.default_rng(seed), fmt, rows, cols)


@pytest.mark.parametrize("fmt", GGML_FORMATS)
def test_repacked_blocks_decode_bit_identically_to_gguf(fmt):
    for seed, (rows, cols) in enumerate([(8, 256), (48, 1024)]):
        raw = blocks(seed, fmt, rows, cols)
        want = gguf.quants.dequantize(raw, Q[fmt.upper()])
        q = from_blocks(fmt, raw, (rows, cols))
        got = np.asarray(dequantize(jax.tree.map(jnp.asarray, q)))
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        np.testing.assert_array_equal(got, want)
        # the repacked arrays take (about) the file's bytes, as --plan counts them
        assert q.nbytes <= 1.05 * raw.nbytes
        assert q.nbytes * 8 == nominal_bits(fmt) * rows * cols


def test_repacking_rejects_blocks_of_the_wrong_size():
    raw = blocks(0, "q4_k", 8, 256)
    with pytest.raises(ValueError, match="do not hold"):
        from_blocks("q4_k", raw, (8, 512))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("fmt", GGML_FORMATS)
def test_quant_matmul_reads_gguf_blocks_as_the_reference(fmt, case, dtype, interpret):
    from test_quant_kernels import assert_matches_reference
    M, N, K, bs = CASES[case]
    q = jax.tree.map(jnp.asarray, from_blocks(fmt, blocks(10 + case, fmt, N, K), (N, K)))
    assert_matches_reference(q, M, dtype, bs, interpret, seed=100 + case)


@pytest.mark.parametrize("fmt", GGML_FORMATS)
def test_quant_matmul_on_gguf_blocks_lowers_to_triton(fmt):
    from test_quant_kernels import assert_lowers_to_triton
    assert_lowers_to_triton(jax.tree.map(jnp.asarray, from_blocks(fmt, blocks(3, fmt, 512, 2048), (512, 2048))),
                            (1, 64))


def test_k_quants_need_whole_super_blocks():
    assert unsupported("q4_k", (64, 384), jnp.float32)            # 384 is not a multiple of 256
    assert unsupported("q4_0", (64, 384), jnp.float32) is None


# one block type per projection, cycling; Q5_0 has no kernel and is dequantized at load
TYPES = [Q.Q4_K, Q.Q6_K, Q.IQ4_XS, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0]


def test_a_gguf_of_mixed_blocks_served_on_its_blocks_matches_transformers(tmp_path, monkeypatch):
    """llama (its q/k rows permuted in the file: the blocks move as whole rows) with every kept
    type and one without a kernel; transformers gets exactly the stored weights."""
    from hf_reference import hf_logits, load_into, make_hf_model, write_gguf
    from test_models import RTOL, ours_full, rel_err
    hf = make_hf_model("llama", seed=3, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64)
    picked = {}

    def qtype_for(name, arr):
        if arr.ndim != 2 or "token_embd" in name or "output" == name.split(".")[0]:
            return None
        return picked.setdefault(name, TYPES[len(picked) % len(TYPES)])

    real = gguf.quants.quantize
    rng = np.random.default_rng(5)

    def quantize(a, qtype):        # gguf-py writes the simple types; K and IQ blocks are random
        if qtype in (Q.Q4_K, Q.Q6_K, Q.IQ4_XS):
            return random_blocks(rng, qtype.name.lower(), *a.shape)
        return real(a, qtype)

    monkeypatch.setattr(gguf.quants, "quantize", quantize)
    stored = write_gguf(hf, tmp_path / "mixed.gguf", "llama", qtype_for)
    monkeypatch.undo()
    load_into(hf, stored)
    m = load_model(str(tmp_path / "mixed.gguf"), with_tokenizer=False, weights="gguf")
    assert m.weights_format == "gguf"
    got = {getattr(v, "fmt", "dequantized") for p in m.params["layers"] for k, v in p.items() if k.startswith("w")}
    assert got == {*GGML_FORMATS, "dequantized"}
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, 9))
    ref = hf_logits(hf, tokens)
    assert rel_err(ours_full(m, tokens), ref) <= RTOL
    with use(Route.named("pallas_interpret")):            # linear's kernels (interpret mode)
        assert rel_err(ours_full(m, tokens), ref) <= RTOL
    # infernix-convert keeps the blocks too: every array of every type comes back bit for bit
    from scripts.convert import main as convert_main
    assert convert_main([str(tmp_path / "mixed.gguf"), str(tmp_path / "conv"), "--weights", "gguf",
                         "--dtype", "float32"]) == 0
    c = load_model(str(tmp_path / "conv"), with_tokenizer=False)
    assert c.weights_format == "gguf"
    for a, b in zip(jax.tree.leaves(c.params), jax.tree.leaves(m.params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # --plan's count of both is the bytes they load into
    from infernix_jax.engine.plan import params_bytes
    from infernix_jax.loader import planned_gguf_bytes
    assert planned_gguf_bytes(str(tmp_path / "mixed.gguf"), jnp.float32) == params_bytes(m.params)
    assert planned_gguf_bytes(str(tmp_path / "conv"), jnp.float32) == params_bytes(c.params)
    # a checkpoint converted without the blocks has none to keep: a clear error, not a crash
    assert convert_main([str(tmp_path / "mixed.gguf"), str(tmp_path / "plain"), "--dtype", "float32"]) == 0
    with pytest.raises(ModelLoadError, match="without GGUF blocks"):
        load_model(str(tmp_path / "plain"), with_tokenizer=False, weights="gguf")
    with pytest.raises(ModelLoadError, match="without GGUF blocks"):
        planned_gguf_bytes(str(tmp_path / "plain"), jnp.float32)


@pytest.mark.extended
def test_smollm2_on_its_q4_1_blocks_gives_the_logits_of_dequantizing_at_load(smollm, smollm_engine):
    from infernix_jax.engine import Engine, Request, SamplingParams
    from infernix_jax.engine.plan import params_bytes
    from infernix_jax.loader import planned_gguf_bytes
    from test_models import ours_full
    m = load_model("smollm2-135m-instruct", dtype="float32", weights="gguf")
    assert {p["wqkv"].fmt for p in m.params["layers"]} == {"q4_1"}          # q, k and v fused in their blocks
    assert params_bytes(m.params) < 0.4 * params_bytes(smollm.params)
    assert planned_gguf_bytes("smollm2-135m-instruct", jnp.float32) == params_bytes(m.params)
    ids = smollm.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    np.testing.assert_array_equal(ours_full(m, np.asarray([ids])), ours_full(smollm, np.asarray([ids])))
    # the engine serves it: the same greedy reply as the model dequantized at load
    p = SamplingParams(max_tokens=8, temperature=0)
    got = Engine(m, max_num_seqs=1, max_model_len=128).generate([Request(ids, p)])
    assert got[0].token_ids == smollm_engine.generate([Request(ids, p)])[0].token_ids


def test_gguf_blocks_need_a_gguf_file(tmp_path, capsys):
    from hf_reference import make_hf_model
    from scripts.convert import main as convert_main
    hf = make_hf_model("qwen2", seed=1)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        load_model(str(tmp_path / "hf"), with_tokenizer=False, weights="gguf")
    capsys.readouterr()                                   # (transformers' progress bars)
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "out"), "--weights", "gguf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a .gguf file" in err[0] and not (tmp_path / "out").exists()


def test_the_iq4nl_quartic_gives_every_grid_value():
    from pallas_kernels.ggml_blocks import IQ4NL, iq4nl
    assert [int(v) for v in iq4nl(jnp.arange(16, dtype=jnp.uint8))] == list(IQ4NL)


def test_moe_experts_stay_in_their_gguf_blocks(tmp_path):
    """--weights gguf keeps the routed experts' stacks [E, O, I] in their blocks too; they compute
    as gguf-py's dequantization of the same file, in the jnp paths and in the grouped expert
    kernel (interpret mode), and a converted checkpoint keeps them bit for bit."""
    from hf_reference import hf_logits, load_into, make_hf_model, write_gguf
    from infernix_jax.models.moe import moe_mlp
    from infernix_jax.quant.formats import QTensor, dequantize
    from test_models import RTOL, ours_full, rel_err
    hf = make_hf_model("qwen3_moe", seed=7, norm_topk_prob=True, hidden_size=64, moe_intermediate_size=32)

    def qtype_for(name, arr):
        return (Q.Q8_0 if "down" in name else Q.Q4_0) if "_exps" in name else None
    stored = write_gguf(hf, tmp_path / "moe.gguf", "qwen3_moe", qtype_for)
    load_into(hf, stored)
    m = load_model(str(tmp_path / "moe.gguf"), with_tokenizer=False, weights="gguf")
    layer = m.params["layers"][0]
    assert {n: (type(layer[n]).__name__, getattr(layer[n], "fmt", "")) for n in ("e_up", "e_down")} == \
        {"e_up": ("QTensor", "q4_0"), "e_down": ("QTensor", "q8_0")}
    assert layer["e_up"].data.shape[0] == m.cfg.num_experts
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (1, 9))
    assert rel_err(ours_full(m, tokens), hf_logits(hf, tokens)) <= RTOL
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 9, m.cfg.hidden_size)), jnp.float32)
    k = m.cfg.num_experts_per_tok
    plain = {**layer, **{n: dequantize(layer[n]) for n in ("e_gate", "e_up", "e_down")}}
    want = np.asarray(moe_mlp(x, plain, k, True, "silu", gather=False))
    got = moe_mlp(x, layer, k, True, "silu", route=Route.named("pallas_interpret"))
    assert isinstance(layer["e_gate"], QTensor) and rel_err(got, want) < 1e-5
    from infernix_jax.engine.plan import params_bytes
    from infernix_jax.loader import planned_gguf_bytes
    assert planned_gguf_bytes(str(tmp_path / "moe.gguf"), jnp.float32) == params_bytes(m.params)
    from scripts.convert import main as convert_main
    assert convert_main([str(tmp_path / "moe.gguf"), str(tmp_path / "conv"), "--weights", "gguf",
                         "--dtype", "float32"]) == 0
    c = load_model(str(tmp_path / "conv"), with_tokenizer=False)
    for a, b in zip(jax.tree.leaves(c.params), jax.tree.leaves(m.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
