"""Constrained decoding with llguidance: a request's grammar (a JSON schema, a Lark grammar) becomes
a matcher that, before each token, gives the set of allowed tokens as a bitmask the sampler applies
on the device, and that consumes each sampled token afterwards.

Grammars are llguidance grammar strings: `grammar_from_json_schema(schema)`, or Lark text (which
may embed `%json {schema}` rules). A constrained row needs the host between tokens, so its batch
decodes one token per dispatch."""
from __future__ import annotations

import functools
import json

import llguidance
import llguidance.numpy as lln
import numpy as np

# compact JSON: flexible whitespace lets small models emit whitespace forever
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    pass


def grammar_from_json_schema(schema: dict) -> str:
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": _COMPACT})


def json_rule(schema: dict) -> str:
    """A Lark rule body that matches JSON valid against schema (to embed in a larger grammar)."""
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT})


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, n_vocab: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos))


def ll_tokenizer(tokenizer, n_vocab: int, eos_ids) -> llguidance.LLTokenizer:
    """The llguidance view of our tokenizer (built once: ~0.2 s for a 50K vocabulary)."""
    return _ll_tokenizer(tokenizer.tok.to_str(), n_vocab, tuple(sorted(eos_ids)))


def words(n_vocab: int) -> int:
    return (n_vocab + 31) // 32


class Constraint:
    def __init__(self, lltok: llguidance.LLTokenizer, grammar: str):
        self.m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"invalid grammar: {self.m.get_error()}")

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed-token bits for the next token into bitmask[row] (int32 [B, words])."""
        lln.fill_next_token_bitmask(self.m, bitmask, row)

    def consume(self, token: int) -> bool:
        return self.m.consume_token(token)

    @property
    def done(self) -> bool:
        """Nothing more may follow (the grammar is complete and only ends the text)."""
        return self.m.is_stopped() or self.m.is_error()


def check_grammar(tokenizer, n_vocab: int, eos_ids, grammar: str) -> None:
    """Raises GrammarError if the grammar does not compile (for a 400 before the engine sees it)."""
    Constraint(ll_tokenizer(tokenizer, n_vocab, eos_ids), grammar)
