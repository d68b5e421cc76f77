"""Our tokenizers and chat templates against transformers' on SmolLM2 (GGUF metadata) and Qwen3
(tokenizer.json + tokenizer_config.json)."""
import json

import pytest

from infernix_jax.engine.stops import TextTracker
from infernix_jax.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "Hello world!",
    "  leading spaces and trailing  ",
    "Ünïcödé, emoji 🤖🎉 and CJK 你好，世界",
    "def f(x):\n    return x ** 2  # comment\n\n\ttabs",
    "<|im_start|>user\nhi<|im_end|>\n",
    "I'm sure they've said it's fine; we'll see.",
    "Numbers 1234567 and 3.14159, dates 2026-12-02",
]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "multi-turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Tell me a joke."}],
}

QWEN_TOOL_CHAT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": json.dumps({"temp_c": 18})},
    {"role": "assistant", "content": "It is 18 °C in Paris.", "reasoning_content": "Report it."},
    {"role": "user", "content": "And in Rome?"},
]


@pytest.fixture(scope="module")
def smol_pair(smollm):
    import transformers
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm.path.parent), gguf_file=smollm.path.name)
    return smollm.tokenizer, hf


@pytest.fixture(scope="module")
def qwen_pair(qwen3_tokenizer_dir):
    import transformers
    return Tokenizer.from_hf_dir(qwen3_tokenizer_dir), transformers.AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encodings_match_transformers(smol_pair, text):
    ours, hf = smol_pair
    assert ours.encode(text) == hf.encode(text)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_smollm2_splits_digits_one_by_one(smollm):
    # SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split every digit.
    tok = smollm.tokenizer
    ids = tok.encode("2026")
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "6"]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_chat_template_matches_transformers(smol_pair, name, gen):
    ours, hf = smol_pair
    msgs = CONVERSATIONS[name]
    assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
        hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert ours.encode_chat(msgs, add_generation_prompt=gen) == \
        hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)


@pytest.mark.parametrize("text", TEXTS)
def test_qwen3_encodings_match_transformers(qwen_pair, text):
    ours, hf = qwen_pair
    assert ours.encode(text) == hf.encode(text)
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS) + ["tools"])
@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_chat_template_matches_transformers(qwen_pair, name, thinking):
    ours, hf = qwen_pair
    msgs = QWEN_TOOL_CHAT if name == "tools" else CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if name == "tools" else None
    mine = ours.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, enable_thinking=thinking)
    ref = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                 enable_thinking=thinking)
    assert mine == ref
    if name == "tools":
        assert "<tools>" in mine and "<tool_call>" in mine and "<tool_response>" in mine
    if not thinking:
        assert mine.endswith("<think>\n\n</think>\n\n")
    assert ours.encode(mine, add_special_tokens=False) == hf.encode(ref, add_special_tokens=False)


def test_qwen3_special_tokens(qwen_pair):
    ours, _ = qwen_pair
    assert ours.token_to_id("<|im_end|>") in ours.eos_ids
    assert len(ours.encode("<think>")) == 1


def test_template_errors_surface_as_template_errors(qwen_pair):
    import jinja2
    from infernix_jax.tokenizer import render_template
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        render_template("{{ raise_exception('bad role') }}", messages=[])


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoding_never_splits_characters(qwen_pair, text):
    ours, _ = qwen_pair
    dec = IncrementalDecoder(ours)
    parts = [dec.push(t) for t in ours.encode(text)] + [dec.flush()]
    assert "".join(parts) == ours.decode(ours.encode(text))
    assert not any("\ufffd" in p for p in parts)


def test_stop_strings_are_cut_and_never_leak_partially(qwen_pair):
    ours, _ = qwen_pair
    tr = TextTracker(ours, ("STOP here",))
    out = []
    for t in ours.encode("Some answer. STOP here and more text"):
        out.append(tr.push(t))
        assert "STOP" not in "".join(out)
        if tr.stopped:
            break
    assert tr.stopped and "".join(out) + tr.finish() == "Some answer. "
