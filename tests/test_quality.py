"""infernix-quality and the routes: the honest-rounding floor of each format, the statistics, and
the CLI against the real SmolLM2 (the lossless route of the model as loaded is the reference)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.quant.formats import E2M1, FORMATS, dequantize, quantize
from infernix_jax.quality import Stats, compare, honest_round, scored, windows


def weights(seed, shape=(40, 300)):
    return jax.random.t(jax.random.PRNGKey(seed), 5.0, shape) * 0.02


@pytest.mark.parametrize("fmt", FORMATS)
def test_honest_rounding_lands_on_the_format_grid_with_exact_scales(fmt):
    w = weights(1)
    h = np.asarray(honest_round(w, fmt))
    assert h.shape == w.shape and np.isfinite(h).all()
    np.testing.assert_allclose(np.asarray(honest_round(jnp.asarray(h), fmt)), h, rtol=1e-6, atol=1e-7)  # idempotent
    if fmt in ("int8", "fp8"):     # the formats that are already round-to-nearest with exact f32 scales
        np.testing.assert_allclose(h, np.asarray(dequantize(quantize(w, fmt))), rtol=1e-6, atol=1e-9)
    if fmt == "nvfp4":             # every group of 16 holds e2m1 values times one scale
        g = np.pad(h, ((0, 0), (0, -300 % 16))).reshape(40, -1, 16)
        s = np.abs(g).max(-1, keepdims=True) / 6
        ratio = np.divide(g, s, out=np.zeros_like(g), where=s > 0)
        assert np.isin(np.round(ratio, 4), np.round(E2M1, 4)).all()
    err = np.abs(h - np.asarray(w)).mean()
    ours = np.abs(np.asarray(dequantize(quantize(w, fmt))) - np.asarray(w)).mean()
    assert 0 < err <= ours * 1.6          # the same number of value bits: never far worse than the format


def test_statistics_of_identical_and_shifted_distributions():
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(0, 8, 20))]
    ref = [scored(np.log(rng.dirichlet(np.ones(8), 20)).astype(np.float32), ids[0])]
    same = compare(ref, ref, ids)
    assert isinstance(same, Stats) and same.mean_kl == 0 and same.same_top == 1 and same.ppl_ratio == 1
    assert same.tokens == 9                               # the second half of the window, last position excluded
    flat = [np.full_like(ref[0], -np.log(8))]
    st = compare(ref, flat, ids)
    assert st.mean_kl > 0 and st.p99_kl >= st.mean_kl and st.max_kl >= st.p999_kl
    assert windows(list(range(90)), 40, None) == [list(range(40)), list(range(40, 80))]   # 10 left: < half
    assert len(windows(list(range(100)), 40, None)) == 3
    assert windows(list(range(100)), 40, 60) == [list(range(40)), list(range(40, 60))]


@pytest.mark.extended
def test_quality_cli_measures_routes_and_floors(smollm, tmp_path, capsys):
    from scripts.quality import main
    text = tmp_path / "text.txt"
    text.write_text("The river Tagus rises in the mountains of eastern Spain and flows west through Toledo "
                    "before it reaches the Atlantic at Lisbon, where its estuary forms one of the largest "
                    "natural harbours of Europe. Its basin drains much of the central plateau.")
    out = tmp_path / "q.json"
    assert main(["--text", str(text), "--weights", "none,int8,nvfp4", "--route", "default,lossless",
                 "--kv-dtype", "none,k8v4", "--ctx", "32", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "honest rounding" in table and "x honest" in table
    res = json.loads(out.read_text())
    rows = {(r["route"], r["weights"]): r for r in res["rows"] if r["kv_dtype"] == "model"}
    kv = {(r["route"], r["weights"]): r for r in res["rows"] if r["kv_dtype"] == "k8v4"}
    assert res["windows"] >= 1 and res["scored_tokens"] > 10
    for route in ("default", "lossless"):
        assert rows[(route, "none")]["mean_kl"] == 0 and rows[(route, "none")]["same_top"] == 1
    # int8 per channel is itself round-to-nearest with exact scales: exactly its floor on the CPU
    assert rows[("lossless", "int8")]["of_honest"] == pytest.approx(1.0, abs=0.02)
    assert 0 < rows[("honest rounding", "int8")]["mean_kl"] < rows[("honest rounding", "nvfp4")]["mean_kl"]
    assert rows[("default", "nvfp4")]["of_honest"] > 0
    # k8v4 KV rounds each K/V row to nearest with an exact f32 scale: on the CPU (f32 arithmetic)
    # the default route is its own floor, and it costs something on top of the weights' rounding
    assert ("lossless", "none") not in kv                       # (that one *is* the floor row)
    assert kv[("default", "none")]["of_honest"] == pytest.approx(1.0, abs=1e-3)
    assert 0 < kv[("default", "none")]["mean_kl"] and kv[("lossless", "int8")]["mean_kl"] > rows[("lossless", "int8")]["mean_kl"]


@pytest.mark.parametrize("args, msg", [
    (["--text", "/nonexistent.txt"], "No such file"),
    (["--text", "README.md", "--weights", "int3"], "unknown --weights int3"),
    (["--text", "README.md", "--route", "fast"], "--route takes default and/or lossless"),
    (["--text", "README.md", "--kv-dtype", "int2"], "unknown --kv-dtype int2"),
    (["--text", "README.md", "--kv-dtype", "bf16p"], "bf16p is lossless"),
    (["--text", "README.md", "--ctx", "4"], "--ctx and --max-tokens must be >= 16"),
])
def test_quality_cli_bad_input_is_one_line(args, msg, capsys):
    from scripts.quality import main
    assert main(args) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_lossless_flag_checks_its_company():
    import argparse
    from scripts._common import add_model_args, apply_route
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--attn-impl", default=None)
    with pytest.raises(ValueError, match="--lossless computes in float32"):
        apply_route(p.parse_args(["--lossless", "--dtype", "bfloat16"]))
    with pytest.raises(ValueError, match="reference attention"):
        apply_route(p.parse_args(["--lossless", "--attn-impl", "pallas"]))
    before = jax.config.jax_default_matmul_precision
    try:
        a = p.parse_args(["--lossless"])
        apply_route(a)
        assert a.attn_impl == "reference" and jax.config.jax_default_matmul_precision == "highest"
    finally:
        jax.config.update("jax_default_matmul_precision", before)


def test_reference_log_probs_spill_to_disk_past_the_limit(tmp_path, monkeypatch):
    import scripts.quality as q
    monkeypatch.setattr(q, "SPILL_BYTES", 200)
    rng = np.random.default_rng(1)
    arrays = [rng.normal(size=(5, 8)).astype(np.float32) for _ in range(3)]
    kept = q.keep(iter(arrays), str(tmp_path))
    assert isinstance(kept[0], np.ndarray) and not isinstance(kept[0], np.memmap)     # 160 bytes: the first stays
    assert all(isinstance(k, np.memmap) for k in kept[1:]) and len(list(tmp_path.iterdir())) == 2
    for k, a in zip(kept, arrays):
        np.testing.assert_array_equal(k, a)


def test_scoring_in_pieces_gives_the_whole_window_s_log_probs(smollm):
    """Pieces of a few tokens continue the pool (and a hybrid's state) from the positions before."""
    from infernix_jax.quality import window_logprobs
    ids = smollm.tokenizer.encode("The river Tagus rises in the mountains of eastern Spain and flows west "
                                  "through Toledo before it reaches the Atlantic at Lisbon.")
    whole = window_logprobs(smollm.params, smollm.cfg, ids, smollm.dtype, "reference")
    pieces = window_logprobs(smollm.params, smollm.cfg, ids, smollm.dtype, "reference", chunk=7)
    assert pieces.shape == whole.shape == (len(ids), smollm.cfg.vocab_size)
    np.testing.assert_allclose(pieces, whole, atol=2e-4)
