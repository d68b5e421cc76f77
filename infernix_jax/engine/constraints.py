"""Constrained decoding with llguidance: a request's grammar (a JSON schema, a Lark grammar) becomes
a matcher that, before each token, gives the set of allowed tokens as a bitmask the sampler applies
on the device, and that consumes each sampled token afterwards.

Grammars are llguidance grammar strings: `grammar_from_json_schema(schema)`, or Lark text (which
may embed `%json {schema}` rules). A constrained row needs the host between tokens, so its batch
decodes one token per dispatch."""
from __future__ import annotations

import json
import weakref

import llguidance
import llguidance.numpy as lln
import numpy as np

# compact JSON: flexible whitespace lets small models emit whitespace forever. oneOf is read as anyOf
# (llguidance cannot enforce "exactly one"; tool schemas use oneOf for alternatives that rarely overlap)
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": True}


class GrammarError(ValueError):
    pass


def grammar_from_json_schema(schema: dict) -> str:
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": _COMPACT})


def json_rule(schema: dict) -> str:
    """A Lark rule body that matches JSON valid against schema (to embed in a larger grammar)."""
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT})


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # tokenizer -> {(n_vocab, eos): LLTokenizer}


def ll_tokenizer(tokenizer, n_vocab: int, eos_ids) -> llguidance.LLTokenizer:
    """The llguidance view of our tokenizer, built once per tokenizer (~0.25 s for a 50K vocabulary;
    the engine builds it while warming up): each constrained request only looks it up (serializing
    the tokenizer to find it cost ~20 ms a request)."""
    key = (n_vocab, tuple(sorted(eos_ids)))
    built = _BUILT.setdefault(tokenizer, {})
    if key not in built:
        built[key] = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=n_vocab, eos_token=list(key[1]))
    return built[key]


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

    def try_consume(self, tokens: list[int]) -> int:
        """Consume the leading tokens the grammar allows; -> how many (rollback undoes them)."""
        return self.m.try_consume_tokens(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    @property
    def done(self) -> bool:
        """Nothing more may follow (the grammar is complete and only ends the text)."""
        return self.m.is_stopped() or self.m.is_error()


def check_grammar(tokenizer, n_vocab: int, eos_ids, grammar: str) -> None:
    """Raises GrammarError if the grammar does not compile (for a 400 before the engine sees it)."""
    Constraint(ll_tokenizer(tokenizer, n_vocab, eos_ids), grammar)
