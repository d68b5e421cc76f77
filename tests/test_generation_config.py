"""A model's sampling defaults: generation_config.json, GGUF general.sampling.* keys, overrides."""
import json

import pytest

from infernix_jax import generation_config as gc


def test_hf_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "eos_token_id": [1, 2], "temperature": 0.6, "top_k": 20, "top_p": 0.95,
        "max_new_tokens": 512, "transformers_version": "4.51.0"}))
    assert gc.from_hf_dir(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 512}
    assert gc.from_hf_dir(tmp_path / "missing") == {}
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="temperature must be in"):
        gc.from_hf_dir(tmp_path)


def test_gguf_sampling_keys():
    kv = {"general.sampling.temp": 0.7, "general.sampling.top_k": 0, "general.sampling.min_p": 0.05,
          "general.sampling.penalty_repeat": 1.05, "general.sampling.mirostat": 0, "general.name": "x"}
    assert gc.from_gguf(kv) == {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.05}


@pytest.mark.parametrize("d,msg", [({"temp": 1}, "unknown field 'temp'"), ({"top_k": 1.5}, "integer"),
                                   ({"top_p": 0}, "top_p must be in"), ({"temperature": True}, "number"),
                                   ([], "JSON object")])
def test_override_is_checked(d, msg):
    with pytest.raises(ValueError, match=msg):
        gc.check(d, "--override-generation-config")


def test_an_alias_without_defaults_in_its_file_takes_its_cards():
    """The default model's GGUF has no general.sampling.* keys: its card's temperature 0.2 / top_p 0.9
    apply, said with their source; a file's own defaults win; a local path gets none."""
    from infernix_jax.loader import _with_alias_defaults
    gen, source = _with_alias_defaults("smollm2-135m-instruct", {})
    assert gen == {"temperature": 0.2, "top_p": 0.9} and "model card" in source
    assert _with_alias_defaults("smollm2-135m-instruct", {"temperature": 0.7}) == ({"temperature": 0.7},
                                                                                   "the model's own")
    assert _with_alias_defaults("/models/x.gguf", {}) == ({}, "")
    gc.check(gen, "alias")                   # in range, as a file's would be
