"""infernix-convert: the real SmolLM2 into converted checkpoints and back (exact round trips, with
and without quantized projections), a converted model served over HTTP, and clear errors for
damaged, incomplete or mismatched checkpoints."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from infernix_jax.loader import load_model
from infernix_jax.quant.formats import QTensor
from infernix_jax.weights import ModelLoadError
from scripts.convert import main as convert_main


def leaves(params):
    return jax.tree.leaves(params)


@pytest.fixture(scope="module")
def converted(smollm, tmp_path_factory):
    """SmolLM2 converted as float32 with nothing quantized, and with nvfp4 projections (served with
    K8V4 KV by default)."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for name, extra in (("plain", []), ("nvfp4", ["--weights", "nvfp4", "--kv-dtype", "k8v4"])):
        assert convert_main([str(smollm.path), str(root / name), "--dtype", "float32", *extra]) == 0
        out[name] = root / name
    return out


def test_round_trip_is_exact_and_keeps_the_tokenizer(smollm, converted):
    m = load_model(str(converted["plain"]))
    assert m.cfg == smollm.cfg and m.weights_format == ""
    for a, b in zip(leaves(m.params), leaves(smollm.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    chat = [{"role": "user", "content": "Hi there, what is 2+2?"}]
    assert m.tokenizer.encode_chat(chat) == smollm.tokenizer.encode_chat(chat)
    assert m.tokenizer.eos_ids == smollm.tokenizer.eos_ids
    man = json.loads((converted["plain"] / "infernix.json").read_text())
    assert man["total_bytes"] == sum(np.asarray(x).nbytes for x in leaves(smollm.params))


@pytest.mark.extended
def test_quantized_round_trip_keeps_the_format(smollm, converted):
    """A converted nvfp4 checkpoint loads as `--weights nvfp4` quantizes at load: part by part (each
    with its tensor scale, so these parts stay apart: models/fuse.py)."""
    from infernix_jax.models.fuse import fuse_params
    from infernix_jax.quant.apply import quantize_params
    m = load_model(str(converted["nvfp4"]))
    assert m.weights_format == "nvfp4"
    parts = load_model(str(smollm.path), with_tokenizer=False, fuse=False).params
    want = fuse_params(quantize_params(parts, "nvfp4", progress=False))
    assert isinstance(m.params["layers"][3]["w_up"], QTensor)
    assert jax.tree.structure(m.params) == jax.tree.structure(want)
    for a, b in zip(leaves(m.params), leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ModelLoadError, match="holds nvfp4 weights; --weights int8 would round them twice"):
        load_model(str(converted["nvfp4"]), weights="int8")
    assert load_model(str(converted["nvfp4"]), weights="nvfp4").weights_format == "nvfp4"


@pytest.mark.extended
@pytest.mark.parametrize("fmt", ["mxfp8", "int4"])
def test_every_quantized_array_kind_survives(smollm, tmp_path, fmt):
    """e8m0 scales (mxfp8) and integer zero points (int4) come back bit for bit."""
    from infernix_jax.quant.apply import quantize_layer
    assert convert_main([str(smollm.path), str(tmp_path / fmt), "--dtype", "float32", "--weights", fmt]) == 0
    got = load_model(str(tmp_path / fmt), with_tokenizer=False).params["layers"][5]
    want = quantize_layer(smollm.params["layers"][5], fmt)
    for a, b in zip(leaves(got), leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_default_kv_dtype_of_a_checkpoint(converted):
    import argparse
    from scripts._common import add_engine_args, add_model_args, apply_route
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_engine_args(p)
    route = lambda *args: (apply_route(a := p.parse_args(["--model", str(converted["nvfp4"]), *args])), a)[1]  # noqa: E731
    assert route().kv_dtype == "k8v4"                                   # the manifest's default
    assert route("--kv-dtype", "int8").kv_dtype == "int8"              # the flag wins
    assert route("--kv-dtype", "model").kv_dtype == ""                 # ... also back to exact KV
    assert not route("--lossless").kv_dtype                             # lossless keeps KV exact
    with pytest.raises(ValueError, match="--lossless keeps K and V in float32"):
        route("--lossless", "--kv-dtype", "fp8")
    plain = p.parse_args(["--model", str(converted["plain"])])
    apply_route(plain)
    assert plain.kv_dtype is None


@pytest.mark.extended
def test_a_converted_model_serves_and_answers(converted, tmp_path_factory):
    import openai
    from conftest import start_server
    for url in start_server(tmp_path_factory, "--model", str(converted["nvfp4"]), "--max-batch", "2"):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert r.choices[0].message.content.strip()
        assert r.usage.completion_tokens > 0


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def _biggest_file(d: Path) -> Path:
    return max((f for f in d.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def test_damaged_incomplete_and_mismatched_checkpoints_are_clear_errors(converted, tmp_path):
    src = converted["nvfp4"]
    bad = _copy(src, tmp_path / "a")                     # flipped bytes inside a layer's data
    f = _biggest_file(bad / "params" / "layer_003")
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="damaged"):
        load_model(str(bad))
    gone = _copy(src, tmp_path / "b")                    # a part missing
    shutil.rmtree(gone / "params" / "layer_007")
    with pytest.raises(ModelLoadError, match="params/layer_007 is missing"):
        load_model(str(gone))
    odd = _copy(src, tmp_path / "c")                     # the manifest and the data disagree
    man = json.loads((odd / "infernix.json").read_text())
    man["tensors"]["final_norm"]["shape"] = [577]
    (odd / "infernix.json").write_text(json.dumps(man))
    with pytest.raises(ModelLoadError, match="does not match its manifest"):
        load_model(str(odd))
    man["tensors"]["final_norm"]["shape"] = [576]
    man["tensors"]["embed"]["blake2b"] = "0" * 32          # data readable, digest wrong
    (odd / "infernix.json").write_text(json.dumps(man))
    with pytest.raises(ModelLoadError, match="tensor embed fails its checksum"):
        load_model(str(odd))
    man["config"]["rope_theta"] = 1.0                       # an edited config
    (odd / "infernix.json").write_text(json.dumps(man))
    with pytest.raises(ModelLoadError, match="config fails its checksum"):
        load_model(str(odd))
    man["config"]["rope_theta"] = 100000.0
    man["kv_dtype"] = "int3"
    (odd / "infernix.json").write_text(json.dumps(man))
    with pytest.raises(ModelLoadError, match="unknown default KV dtype 'int3'"):
        load_model(str(odd))
    man["version"] = 99
    (odd / "infernix.json").write_text(json.dumps(man))
    with pytest.raises(ModelLoadError, match="not an infernix-orbax v1 checkpoint"):
        load_model(str(odd))
    (odd / "infernix.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot be read"):
        load_model(str(odd))


def test_convert_cli_errors_are_one_line(smollm, converted, tmp_path, capsys):
    assert convert_main([str(smollm.path), str(converted["plain"])]) == 2          # exists, not empty
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert convert_main([str(tmp_path / "nothing-here"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "infernix-convert: error:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert not [f for f in tmp_path.iterdir() if "partial" in f.name]      # nothing left behind


@pytest.mark.extended
def test_relative_paths_convert_and_load(smollm, tmp_path, monkeypatch):
    """Orbax's default layout wants absolute paths: both ends make them so."""
    monkeypatch.chdir(tmp_path)
    assert convert_main([str(smollm.path), "rel", "--weights", "int8"]) == 0
    m = load_model("rel", with_tokenizer=False)
    assert m.weights_format == "int8" and isinstance(m.params["layers"][0]["wqkv"], QTensor)


def test_packed_matrices_without_escapes_are_stored(tmp_path):
    """Orbax refuses empty arrays: a packed matrix with no escapes keeps them in the manifest only."""
    import jax.numpy as jnp
    from infernix_jax.quant.packed import pack
    from infernix_jax.weights.converted import _check, _ckpt, write_part
    p = pack(jnp.full((16, 32), 0.5, jnp.bfloat16))
    assert p.esc_idx.shape == (0,)
    _, ck = _ckpt()
    entries = write_part(ck, tmp_path, "top", {"w": p})
    ck.close()
    e = entries["w"]["arrays"]["w.esc_idx"]
    assert e["shape"] == [0] and _check(tmp_path, "w.esc_idx", None, e).shape == (0,)


@pytest.mark.extended
def test_bf16p_converts_and_loads_bit_for_bit(smollm, tmp_path):
    from infernix_jax.quant.packed import Packed12, unpack
    assert convert_main([str(smollm.path), str(tmp_path / "p"), "--weights", "bf16p"]) == 0
    m = load_model(str(tmp_path / "p"), dtype="bfloat16", with_tokenizer=False)
    assert m.weights_format == "bf16p" and isinstance(m.params["layers"][2]["wo"], Packed12)
    assert all(isinstance(p["wqkv"], Packed12) and isinstance(p["w_gate_up"], Packed12) for p in m.params["layers"])
    apart = load_model(str(tmp_path / "p"), dtype="bfloat16", with_tokenizer=False, fuse=False).params["layers"][2]
    parts = load_model(str(smollm.path), with_tokenizer=False, fuse=False).params["layers"][2]
    assert {n for n, w in apart.items() if isinstance(w, Packed12)} >= {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    for name, w in apart.items():
        if isinstance(w, Packed12):
            want = np.asarray(parts[name].astype("bfloat16"))
            np.testing.assert_array_equal(np.asarray(unpack(w)).view(np.uint16), want.view(np.uint16))
    assert convert_main([str(smollm.path), str(tmp_path / "q"), "--weights", "bf16p", "--dtype", "float32"]) == 2
