"""infernix-score: full-vocabulary log-probabilities for token sequences.

Each input line holds {"tokens": [ids]}. The output .npz holds, for line i (0-based),
logprobs_<i>: float32 [len, vocab], the log-probabilities of the next token at every position,
computed in the chosen dtype with fp32 logits and log-softmax. A bad line is stored as error_<i>
(a string) and the command exits with 1 after writing the rest."""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from scripts._common import Progress, add_model_args, apply_route, run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="infernix-score", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--input", required=True, help="JSONL file of {\"tokens\": [...]}")
    p.add_argument("--output", required=True, help=".npz file to write")

    def go():
        a = p.parse_args(argv)
        apply_route(a)
        with open(a.input, encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
        import jax
        import jax.numpy as jnp
        from infernix_jax.engine.steps import bucket, full_logprobs
        from infernix_jax.loader import load_model
        from infernix_jax.models import init_cache
        model = load_model(a.model, dtype=a.dtype, with_tokenizer=False, weights=a.weights)
        cfg = model.cfg
        arrays, failed = {}, 0
        bar = Progress("infernix-score", len(lines), "line", "scoring")
        for i, ln in enumerate(bar.each(lines)):
            try:
                toks = json.loads(ln).get("tokens") if ln.lstrip().startswith("{") else None
                if not isinstance(toks, list) or not toks or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in toks):
                    raise ValueError("each line needs a non-empty integer list 'tokens'")
                if not all(0 <= t < cfg.vocab_size for t in toks):
                    raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
                if len(toks) > cfg.max_position_embeddings:
                    raise ValueError(f"{len(toks)} tokens exceed the context of {cfg.max_position_embeddings}")
            except (json.JSONDecodeError, ValueError, AttributeError) as e:
                arrays[f"error_{i}"] = np.array(f"line {i + 1}: {e}")
                failed += 1
                continue
            T = bucket(len(toks))
            padded = np.zeros((1, T), np.int32)
            padded[0, :len(toks)] = toks
            # exact for the chosen dtype: no TF32 shortcut for float32 matmuls on GPUs
            with jax.default_matmul_precision("highest" if a.dtype == "float32" else "default"):
                lp = full_logprobs(model.params, cfg, jnp.asarray(padded), init_cache(cfg, 1, T, model.dtype))
            arrays[f"logprobs_{i}"] = np.asarray(lp[0, :len(toks)], dtype=np.float32)
        bar.close()
        np.savez(a.output, **arrays)
        if failed:
            print(f"infernix-score: {failed} of {len(lines)} lines failed (stored as error_<i>)", file=sys.stderr)
            return 1
        return 0

    return run("infernix-score", go)


if __name__ == "__main__":
    sys.exit(main())
