"""Tokenizer (`tokenizers`, from tokenizer.json or GGUF metadata), chat templates rendered with
jinja2 the way transformers renders them, and incremental detokenization for streaming."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from .errors import TokenizerError  # noqa: F401  (re-exported)
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) -> the split regex the vocabulary was trained with.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "llama3": _LLAMA3_SPLIT,
           "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}




def _pre_tokenizer(pre: str | None):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":
        # SmolLM2's tokenizer.json (and llama.cpp's "smollm"): every digit alone, then GPT-2 splitting.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


class Tokenizer:
    def __init__(self, tok: HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, special_tokens: dict[str, str] | None = None,
                 extra_eos: tuple[str, ...] = ()):
        self.tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.special_tokens_map = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.bos_id = tok.token_to_id(bos_token) if bos_token else None
        ids = [tok.token_to_id(t) for t in (eos_token, *extra_eos) if t]
        self.eos_ids = tuple(dict.fromkeys(i for i in ids if i is not None))
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    # ---- builders ------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, kv: dict[str, Any]) -> "Tokenizer":
        model = kv.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"GGUF tokenizer type {model!r} is not supported yet (only byte-level BPE, 'gpt2')")
        tokens = kv["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in kv.get("tokenizer.ggml.merges", [])]
        tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, ignore_merges=False))
        tok.pre_tokenizer = _pre_tokenizer(kv.get("tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
        types = kv.get("tokenizer.ggml.token_type") or []
        # 3 = CONTROL (special), 4 = USER_DEFINED (added but not special, e.g. <think>)
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types) if ty == 3])
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4])

        def name(key):
            i = kv.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = name("bos_token_id"), name("eos_token_id")
        if kv.get("tokenizer.ggml.add_bos_token", False) and bos:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
        special = {"bos_token": bos, "eos_token": eos, "unk_token": name("unknown_token_id"),
                   "pad_token": name("padding_token_id")}
        eot = name("eot_token_id")
        return cls(tok, bos_token=bos, eos_token=eos, chat_template=kv.get("tokenizer.chat_template"),
                   special_tokens=special, extra_eos=(eot,) if eot else ())

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        d = Path(path)
        if not (d / "tokenizer.json").exists():
            raise TokenizerError(f"{d} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        cfg = {}
        if (d / "tokenizer_config.json").exists():
            cfg = json.loads((d / "tokenizer_config.json").read_text())

        def tok_str(v):
            return v.get("content") if isinstance(v, dict) else v

        template = cfg.get("chat_template")
        if (d / "chat_template.jinja").exists():  # transformers: the .jinja file takes priority
            template = (d / "chat_template.jinja").read_text()
        if isinstance(template, list):            # [{name, template}]: use "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        special = {k: tok_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        extra = ()
        gen = d / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
            extra = tuple(t for t in (tok.id_to_token(i) for i in ids) if t)
        return cls(tok, bos_token=special["bos_token"], eos_token=special["eos_token"],
                   chat_template=template, special_tokens=special, extra_eos=extra)

    # ---- encode / decode -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    # ---- chat templates ------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, documents=None, **kwargs) -> str:
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; use the completions-style prompt instead")
        msgs = [_alias_reasoning(dict(m)) for m in messages]
        return render_template(self.chat_template, messages=msgs, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt,
                               **{**self.special_tokens_map, **kwargs})

    def encode_chat(self, messages, tools=None, add_generation_prompt=True, **kwargs) -> list[int]:
        text = self.apply_chat_template(messages, tools, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _alias_reasoning(m: dict) -> dict:
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_template(template: str, **context) -> str:
    return _compile(template).render(**context)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 sequences or
    byte-level merges: text is only released once the decoded tail is stable (the vLLM/TGI scheme)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = dec(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """What remains at the end (e.g. a final incomplete character, shown as U+FFFD)."""
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = dec(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
