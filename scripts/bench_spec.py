"""infernix-bench spec: speculative decoding on workloads of its own, one stream, greedy.

  copy-edit     a source file and the request to output it again with one name changed
  two-versions  two versions of a file and the request to output the first (older) one with one more
                change: the same lines are followed by different text in each version, and the
                latest occurrence (the chain's guess) is the wrong one where they differ (n-gram trees
                hold both)
  free-chat     a question with nothing to copy (speculation must not lose)

Each workload runs with speculation off, ngram (chains), tree (--ngram-tree-nodes 16; tree32: 32) and auto
(and mtp, asked for, on a checkpoint with an MTP head) on the same engine settings; every mode's
output must equal off's token for token (the bench fails otherwise). Decode tok/s is the better of
the third and fourth runs of each (the first two compile and fill the prefix cache, so prefill is
a cache hit every time; a single run on a shared 2-core machine varied by 15 %), less the prefill,
and printed as a ratio against off, beside acceptance and tokens per verify round. Off's output is
also replayed with drafts of several shapes (`replay`): the tokens a step each could hold at best,
which bounds what any of them can gain on that workload whatever a round costs."""
from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import numpy as np

MODES = {"off": dict(speculative="off"), "ngram": dict(speculative="ngram"),
         "tree": dict(speculative="ngram", ngram_tree_nodes=16), "tree32": dict(speculative="ngram", ngram_tree_nodes=32),
         "auto": dict(speculative="auto"),
         "mtp": dict(speculative="mtp")}       # (a checkpoint with an MTP head: Qwen3.5, Qwen3-Next)


def workloads(tok) -> dict[str, list[int]]:
    here = Path(__file__).resolve().parent.parent
    code = (here / "infernix_jax" / "engine" / "stops.py").read_text()
    v2 = code.replace("TextTracker", "StopTracker").replace("holdback", "keep_back")
    chat = lambda text: tok.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    return {
        "copy-edit": chat(f"Here is a Python file:\n\n{code}\n\nOutput the whole file again with the class "
                          "TextTracker renamed to StopTracker. Output only the code."),
        "two-versions": chat(f"Version 1 of a file:\n\n{code}\n\nVersion 2 of the same file:\n\n{v2}\n\nOutput "
                             "version 1 again with the method `finish` renamed to `flush`. Output only the code."),
        "free-chat": chat("Tell me a short story about a lighthouse keeper who befriends a seal."),
    }


REPLAY = {"chain7": (7, 0), "chain15": (15, 0), "tree16-d7": (7, 16), "tree16": (15, 16), "tree32": (15, 32)}


def replay(prompt: list[int], output: list[int]) -> dict[str, float]:
    """What drafts of each shape (REPLAY: depth, tree nodes) could hold on this output, timing
    aside: steps replayed over the fixed greedy output, each the drafter's draft at that point
    and the longest path of it the output follows, plus the bonus token -> tokens per step (a step
    without a draft emits one; the modes' "tokens/round" count verify rounds only)."""
    from infernix_jax.engine.spec import ngram
    full, P, N = np.asarray(prompt + output, np.int32), len(prompt), len(output)
    out = {}
    for label, (k, nodes) in REPLAY.items():
        pos, rounds = P, 0
        while pos < P + N:
            d, held, cur = ngram.propose(full[:pos], k, tree_nodes=nodes), 0, -1
            while d is not None and pos + held < P + N:
                nxt = [i for i, (t, p) in enumerate(zip(d.tokens, d.parents)) if p == cur and t == full[pos + held]]
                if not nxt:
                    break
                cur, held = nxt[0], held + 1
            pos, rounds = pos + held + 1, rounds + 1
        out[label] = round(N / rounds, 2)
    return out


def run(model, new_tokens: int, names: list[str], modes: list[str], out: str | None) -> dict:
    from infernix_jax.engine import Engine, Request, SamplingParams
    loads = workloads(model.tokenizer)
    results = {}
    for name in names:
        prompt = loads[name]
        row, plain = {}, None
        for mode in modes:
            eng = Engine(model, max_num_seqs=1, max_model_len=len(prompt) + new_tokens + 64, **MODES[mode])

            def once(n):
                t = time.perf_counter()
                r = eng.generate([Request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))])[0]
                return time.perf_counter() - t, r
            once(new_tokens)
            once(new_tokens)
            t1 = min(once(1)[0] for _ in range(2))       # the prefill (a cache hit) and the first token
            (t, r), t_again = once(new_tokens), once(new_tokens)[0]
            t = min(t, t_again)
            if plain is None:
                plain = r.token_ids
                row["replay"] = replay(prompt, plain)
                print(f"{name:13s} replay of off's output, tokens a step at best: "
                      + ", ".join(f"{k} {v}" for k, v in row["replay"].items()), flush=True)
            elif r.token_ids != plain:
                raise AssertionError(f"{name}: {mode}'s output differs from speculation off's")
            tps = (new_tokens - 1) / max(t - t1, 1e-9)
            st = {k: dict(rounds=v.rounds, drafted=v.drafted, accepted=v.accepted,
                          acceptance=round(v.acceptance, 3), tokens_per_round=round(v.tokens_per_round, 2))
                  for k, v in (eng.spec.stats.items() if eng.spec else ())}
            row[mode] = dict(tok_s=round(tps, 2), methods=st)
            base = row["off"]["tok_s"] if "off" in row else None
            ratio = f"{tps / base:.2f}x off" if base else ""
            acc = "; ".join(f"{k}: {v['acceptance']:.0%} accepted, {v['tokens_per_round']} tok/round"
                            for k, v in st.items())
            print(f"{name:13s} {mode:6s} {tps:8.1f} tok/s  {ratio:10s} {acc}", flush=True)
            # the next mode's engine takes its own KV pool (most of a GPU's free memory): this one's goes first
            eng.close()
            eng = once = None
            gc.collect()
        results[name] = row
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1))
    return results
