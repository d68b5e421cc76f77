"""POST /v1/completions (OpenAI's legacy text completions): a raw prompt, no chat template.

prompt: a string, a list of strings, a list of token ids, or a list of such lists; each prompt gets
n choices, numbered prompt-major as OpenAI does. logprobs: an integer (0-5 alternatives) in the
legacy shape {tokens, token_logprobs, top_logprobs, text_offset}."""
from __future__ import annotations

import dataclasses
import json
import secrets
import time

from .errors import invalid
from .openai_chat import MAX_N, requested_max_tokens, sampling, seeds_for, stream_end, usage
from .prompt import budget, check_room
from .turn import Done, Features
from .validate import get_bool, get_dict, get_int

MAX_PROMPTS = 64


def _prompts(body, engine) -> list[list[int]]:
    p = body.get("prompt")
    tok = engine.tokenizer
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        items = p
    else:
        raise invalid("'prompt' must be a string, a list of strings, or token ids (a list of integers, or a "
                      "list of such lists)", "prompt")
    if len(items) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    V = engine.cfg.vocab_size
    out = []
    for it in items:
        if isinstance(it, str):
            ids = tok.encode(it, add_special_tokens=True)
        elif all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < V for x in it):
            ids = list(it)
        else:
            raise invalid(f"token ids in 'prompt' must be integers in [0, {V})", "prompt")
        check_room(engine, len(ids), "prompt")
        out.append(ids)
    return out


def build(body, engine):
    """-> [(prompt ids, SamplingParams)] in choice order, meta."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name in ("suffix", "logit_bias"):
        if body.get(name):
            raise invalid(f"'{name}' is not supported by this server", name)
    prompts = _prompts(body, engine)
    n = get_int(body, "n", 1, 1, MAX_N)
    best_of = get_int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise invalid("'best_of' other than n is not supported", "best_of")
    lp = get_int(body, "logprobs", None, 0, 5)
    echo = get_bool(body, "echo", False)
    chat_body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    jobs = []
    for ids in prompts:
        params = sampling(chat_body, budget(engine, len(ids), requested_max_tokens(body) or 16))
        params = dataclasses.replace(params, logprobs=lp is not None, top_logprobs=lp or 0,
                                     prompt_logprobs=lp if echo and lp is not None else None)
        jobs += [(ids, p) for p in seeds_for(params, n)]
    opts = get_dict(body, "stream_options") or {}
    meta = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()),
            "model": body.get("model") if isinstance(body.get("model"), str) else engine.model_name,
            "stream": get_bool(body, "stream", False), "include_usage": bool(opts.get("include_usage")),
            "echo": echo, "logprobs": lp is not None, "prompts": prompts}
    return jobs, meta


FEATURES = Features()        # raw completions: no reasoning or tool parsing


def logprobs_block(tokenizer, entries, offset: int = 0) -> dict:
    """entries: (token id, logprob, alternatives); logprob None for a prompt's first token (null in
    OpenAI's shape, as are its alternatives)."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, lp, alts in entries:
        t = tokenizer.decode([tid], skip_special_tokens=False)
        tokens.append(t)
        lps.append(lp)
        tops.append(None if lp is None else {tokenizer.decode([a], skip_special_tokens=False): alp for a, alp in alts})
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def body_of(meta, results: list[tuple[str, str, list, list, Done]], tokenizer, n: int) -> dict:
    choices = []
    for i, (_, text, _, lps, done) in enumerate(results):
        prompt = meta["prompts"][i // n]
        echo = tokenizer.decode(prompt, skip_special_tokens=False) if meta["echo"] else ""
        if echo and meta["logprobs"]:      # (lps: the prompt's from its second token on, then the output's)
            lps = [(prompt[0], None, ()), *lps]
        choices.append({"index": i, "text": echo + text, "finish_reason": done.finish_reason,
                        "logprobs": logprobs_block(tokenizer, lps, 0 if echo and meta["logprobs"] else len(echo))
                        if meta["logprobs"] else None})
    prompt_tokens = sum(len(p) for p in meta["prompts"])
    return {"id": meta["id"], "object": "text_completion", "created": meta["created"], "model": meta["model"],
            "choices": choices, "usage": usage(prompt_tokens, sum(r[4].completion_tokens for r in results),
                                               sum(min(r[4].cached_tokens for r in results[i:i + n])
                                                   for i in range(0, len(results), n)))}


class StreamRenderer:
    def __init__(self, meta: dict, n_choices: int, n: int, tokenizer):
        self.meta, self.tokenizer, self.n = meta, tokenizer, n
        self.done: list[Done | None] = [None] * n_choices
        self.offset = [0] * n_choices

    def _chunk(self, i, text, finish=None, logprobs=None) -> str:
        return "data: " + json.dumps({"id": self.meta["id"], "object": "text_completion", "created": self.meta["created"],
                                      "model": self.meta["model"], "choices": [{"index": i, "text": text,
                                      "finish_reason": finish, "logprobs": logprobs}]}, ensure_ascii=False) + "\n\n"

    def start(self) -> list[str]:
        out = []
        if self.meta["echo"] and not self.meta["logprobs"]:     # (with logprobs: sent with the prompt's)
            for i in range(len(self.done)):
                echo = self.tokenizer.decode(self.meta["prompts"][i // self.n], skip_special_tokens=False)
                self.offset[i] = len(echo)
                out.append(self._chunk(i, echo))
        return out

    @staticmethod
    def heartbeat() -> str:
        return ": keep-alive\n\n"

    def pieces(self, i: int, pieces: list) -> list[str]:
        out = []
        for kind, v in pieces:
            if kind == "text":
                out.append(self._chunk(i, v))
            elif kind == "prompt_logprobs":              # echo with logprobs: the prompt, with its logprobs
                prompt = self.meta["prompts"][i // self.n]
                block = logprobs_block(self.tokenizer, [(prompt[0], None, ()), *v])
                echo = self.tokenizer.decode(prompt, skip_special_tokens=False)
                self.offset[i] = sum(len(t) for t in block["tokens"])
                out.append(self._chunk(i, echo, logprobs=block))
            elif kind == "logprobs" and self.meta["logprobs"]:
                block = logprobs_block(self.tokenizer, v, self.offset[i])
                self.offset[i] += sum(len(t) for t in block["tokens"])
                out.append(self._chunk(i, "", logprobs=block))
            elif kind == "done":
                self.done[i] = v
                out.append(self._chunk(i, "", v.finish_reason))
        return out

    def end(self) -> list[str]:
        return stream_end(self.meta, "text_completion", self.done, sum(len(p) for p in self.meta["prompts"]), self.n)
