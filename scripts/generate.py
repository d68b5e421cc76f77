"""infernix-generate: batch generation over a JSONL file.

Each input line holds {"prompt": str} (raw text) or {"messages": [...]} (chat), plus optional
per-line max_tokens, temperature, top_p, top_k, seed, stop. Each output line keeps the input's fields
and adds text, prompt_tokens, completion_tokens and finish_reason; a bad line gets an "error" field
instead and the rest go on (the command then exits with 1). Output is written in input order as
batches finish."""
from __future__ import annotations

import argparse
import json
import sys

from scripts._common import (Progress, add_kv_dtype_arg, add_model_args, add_parallel_args, apply_route,
                             init_distributed, parallel_of, run)

SAMPLING_FIELDS = {"max_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int,
                   "seed": int, "stop": (str, list)}


def _params(line: dict, defaults: argparse.Namespace):
    from infernix_jax.engine import SamplingParams
    for k, t in SAMPLING_FIELDS.items():
        if k in line and (isinstance(line[k], bool) or not isinstance(line[k], t)):
            raise ValueError(f"'{k}' has the wrong type ({type(line[k]).__name__})")
    stop = line.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) for s in stop):
        raise ValueError("'stop' must be a string or a list of strings")
    p = SamplingParams(max_tokens=line.get("max_tokens", defaults.max_tokens),
                       temperature=float(line.get("temperature", defaults.temperature)),
                       top_p=float(line.get("top_p", defaults.top_p)), top_k=line.get("top_k", defaults.top_k),
                       seed=line.get("seed", defaults.seed), stop=stop)
    p.validate()
    return p


def _prompt_ids(line: dict, tok) -> list[int]:
    if "messages" in line:
        msgs = line["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise ValueError("'messages' must be a list of {role, content} objects")
        return tok.encode_chat(msgs, tools=line.get("tools"), add_generation_prompt=True)
    if isinstance(line.get("prompt"), str):
        return tok.encode(line["prompt"])
    raise ValueError("each line needs a string 'prompt' or a list of 'messages'")


def _generate_all(engine, model, raw_lines: list[str], a) -> tuple[int, int]:
    """Every line through the engine, a batch at a time, written as it finishes -> (failed, total)."""
    from infernix_jax.engine import Request
    items = []  # (line dict, Request | None, error)
    for n, ln in enumerate(raw_lines, 1):
        try:
            line = json.loads(ln)
            if not isinstance(line, dict):
                raise ValueError("the line is not a JSON object")
        except (json.JSONDecodeError, ValueError) as e:
            items.append(({"line": n}, None, f"line {n}: invalid JSON object: {e}"))
            continue
        try:
            sp = _params(line, a)
            ids = _prompt_ids(line, model.tokenizer)
            engine.check_fits(len(ids), sp.max_tokens)
            items.append((line, Request(prompt_ids=ids, params=sp), None))
        except Exception as e:  # a bad line is reported in its output and the rest go on
            items.append((line, None, f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)))
    failed = 0
    with open(a.output, "w", encoding="utf-8") as out, \
            Progress("infernix-generate", len(items), "prompt", "generating") as bar:
        for start in range(0, len(items), a.batch_size):
            chunk = items[start:start + a.batch_size]
            reqs = [r for _, r, _ in chunk if r is not None]
            results = iter(engine.generate(reqs) if reqs else [])
            for line, req, err in chunk:
                rec = dict(line)
                if req is None:
                    rec["error"] = err
                    failed += 1
                else:
                    r = next(results)
                    rec.update(text=r.text, prompt_tokens=r.prompt_tokens,
                               completion_tokens=r.completion_tokens, finish_reason=r.finish_reason)
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
            out.flush()
            bar.update(len(chunk))
    return failed, len(items)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="infernix-generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_kv_dtype_arg(p)
    p.add_argument("--input", required=True, help="JSONL file of prompts")
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + completion tokens")
    add_parallel_args(p)

    def go():
        a = p.parse_args(argv)
        apply_route(a)
        if a.batch_size < 1:
            raise ValueError("--batch-size must be >= 1")
        from infernix_jax import distributed
        from infernix_jax.engine.config import EngineConfig
        parallel = parallel_of(a)
        ec = EngineConfig(max_num_seqs=a.batch_size, max_model_len=a.max_model_len,
                          attn_impl=getattr(a, "attn_impl", None), kv_dtype=a.kv_dtype or "", parallel=parallel)
        several = init_distributed(a)
        if not several or distributed.is_leader():         # (the other processes read no input)
            with open(a.input, encoding="utf-8") as f:
                raw_lines = [ln for ln in f.read().splitlines() if ln.strip()]
        from infernix_jax.engine import Engine
        from infernix_jax.loader import load_model
        model = load_model(a.model, dtype=a.dtype, weights=a.weights, parallel=parallel)
        if model.tokenizer is None:
            raise ValueError(f"{a.model} has no tokenizer (tokenizer.json, or a GGUF's tokenizer.ggml.* metadata)")
        engine = Engine(model, ec)
        if several and not distributed.is_leader():        # a follower runs process 0's steps, writes nothing
            engine.follow()
            return 0
        try:
            failed, total = _generate_all(engine, model, raw_lines, a)
        finally:
            engine.close()               # (several hosts: releases the other processes)
        if failed:               # (the exit-code rule of every tool: README, "Command-line tools")
            print(f"infernix-generate: {failed} of {total} lines failed (see their 'error' field)",
                  file=sys.stderr)
            return 1
        return 0

    return run("infernix-generate", go)


if __name__ == "__main__":
    sys.exit(main())
