"""infernix-bench: speed of the engine and its kernels, each against a reference measured in the same run.

  infernix-bench decode [--model M] [--batch 1] [--prompt-tokens 128] [--new-tokens 128]
      a real model on this machine: decode tokens/s (prefill excluded, after a warm-up run that
      compiles) against transformers' generate() on torch with the same weights, greedy
  infernix-bench shapes --shape qwen3-8b [--batches 1,64] [--contexts 1024] [--prefill-lens 4096]
      GPU, random weights at a named real shape: decode and prefill against the HBM roofline
      (scripts/bench_shapes.py); --tensor-parallel 1,2,4,8 for the scaling over devices
  infernix-bench qmatmul | moe | gdn        GPU kernels alone (bench_quant.py, bench_moe.py, bench_gdn.py)
  infernix-bench prefix [--tokens 2048]     time to first token of a resent conversation from each
                                            prefix-cache tier (scripts/bench_prefix.py)
  infernix-bench serve [--starts 2] [--clients 1,8]
      the server over HTTP: start-up (first start compiling, then from the compilation cache), the
      first answer against the next, throughput of several clients against one (bench_serve.py)
  infernix-bench spec [--new-tokens 256] [--workloads copy-edit,two-versions,free-chat]
      speculative decoding off / ngram / tree / auto on workloads of its own, one stream, the real
      --model: tok/s against off, acceptance (bench_spec.py)
  infernix-bench steps [--batches 1,8] [--prefill-lens 64,512] [--contexts 256]
      the reference attention's cost: a mixed step of a prompt chunk beside decodes, rows laid out
      against every row ragged (bench_steps.py)

Results and the commands that produced them: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from scripts._common import add_kv_dtype_arg, add_model_args, apply_route, run


def _ours(model, batch: int, prompt: list[int], new: int, kv_cache_gib: float | None = None,
          max_model_len: int | None = None, attn_impl: str | None = None, kv_dtype: str = "") -> float:
    from infernix_jax.engine import Engine, Request, SamplingParams
    eng = Engine(model, max_num_seqs=batch, max_model_len=max_model_len or len(prompt) + new + 16, attn_impl=attn_impl,
                 kv_cache_gib=kv_cache_gib, kv_dtype=kv_dtype)

    def once(n):
        reqs = [Request(list(prompt), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for _ in range(batch)]
        t = time.perf_counter()
        eng.generate(reqs)
        return time.perf_counter() - t

    once(new)                     # compile prefill + decode at these shapes
    t_prefill = min(once(1) for _ in range(2))
    t_total = min(once(new) for _ in range(2))
    return batch * (new - 1) / (t_total - t_prefill)


def _transformers(model_spec: str, path, batch: int, prompt: list[int], new: int) -> float | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if path.is_dir():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32)
    hf.eval()
    ids = torch.tensor([prompt] * batch)

    def once(n):
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False)
        return time.perf_counter() - t

    once(4)
    t_prefill = min(once(1) for _ in range(2))
    t_total = min(once(new) for _ in range(2))
    return batch * (new - 1) / (t_total - t_prefill)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="infernix-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["decode", "shapes", "gdn", "prefix", "qmatmul", "moe", "serve", "spec", "steps"],
                   help="decode: a real model on this machine vs transformers; shapes: random weights at "
                        "named real shapes (GPU), see scripts/bench_shapes.py; gdn: the Gated DeltaNet decode "
                        "kernel and chunked prefill at a real linear-layer shape (GPU), see scripts/bench_gdn.py; prefix: time to "
                        "first token of a resent conversation from each prefix-cache tier, see scripts/bench_prefix.py; "
                        "moe: one MoE layer through the grouped expert kernel against the jnp paths (GPU), "
                        "see scripts/bench_moe.py; "
                        "qmatmul: the fused dequantizing matmul at a shape's projections against bf16 (GPU), "
                        "see scripts/bench_quant.py; serve: the server's start-up and its throughput under "
                        "several clients, see scripts/bench_serve.py; spec: speculative decoding's modes on "
                        "workloads of its own, see scripts/bench_spec.py; steps: the reference attention's mixed steps, "
                        "see scripts/bench_steps.py")
    p.add_argument("--shape", default="qwen3-0.6b", help="for 'shapes': smollm2-135m, qwen3-0.6b, qwen3-8b, "
                                                          "qwen3-30b-a3b, qwen3.5-27b, qwen3.5-35b-a3b")
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--prefill-lens", default="512,4096,16384")
    p.add_argument("--attention", action="store_true", help="also compare the attention kernels with cuDNN")
    p.add_argument("--tune", action="store_true", help="sweep the kernels' block sizes first (shapes: attention; "
                                                        "qmatmul: the quantized matmul)")
    p.add_argument("--formats", default="int8,fp8,fp8b,mxfp8,int4,nvfp4", help="for 'qmatmul': weight formats (also the GGUF blocks q8_0, q4_0, q4_1, q4_k, q6_k, "
                        "iq4_xs, as random blocks)")
    p.add_argument("--torch-batches", default="", help="batches for transformers' static cache, e.g. 1,64")
    p.add_argument("--attn-impl", default=None, choices=["pallas", "reference"],
                   help="shapes: the kernels to time (default pallas); decode: the engine's (default: pallas on GPU)")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--tensor-parallel", "--tp", dest="tensor_parallel", default="1", metavar="LIST",
                   help="shapes: tensor-parallel sizes to compare, e.g. 1,2,4,8 (one host's devices): tok/s and "
                        "scaling efficiency against the first")
    p.add_argument("--expert-parallel", "--ep", dest="expert_parallel", type=int, default=1,
                   help="shapes, with --tensor-parallel: expert-parallel groups (devices = TP x EP)")
    p.add_argument("--unfused", action="store_true", help="shapes: q/k/v and gate/up as separate products (the "
                                                          "loader fuses them: models/fuse.py), to measure the fusion")
    p.add_argument("--mtp", type=int, default=0, metavar="N",
                   help="shapes (qwen3.5 shapes): also time the decode steps with a one-layer MTP head drafting N "
                        "tokens after each dispatch (--speculative mtp), against the same steps without it")
    p.add_argument("--sampled", action="store_true",
                   help="shapes: also time the decode steps with every row sampling (temperature 0.7, top_k 20, "
                        "top_p 0.8), against the same steps greedy")
    p.add_argument("--out", default="bench-out")
    from infernix_jax.choices import GGML_FORMATS
    add_model_args(p, more_weights=GGML_FORMATS)      # shapes also takes a GGUF block type (random blocks)
    add_kv_dtype_arg(p)                               # decode, shapes and prefix
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--no-reference", action="store_true", help="skip the transformers run")
    p.add_argument("--tokens", type=int, default=2048, help="for 'prefix': the conversation's length")
    p.add_argument("--chunk", type=int, default=2048, help="for 'prefix': the prefill chunk (token budget of a step)")
    p.add_argument("--cases", default="a,b,c,d,e,replay",
                   help="for 'prefix': which cases (a cold, b device, c RAM, d SSD, e restart, replay; "
                        "disk: this host's cold read and zstd speeds, what bounds d)")
    p.add_argument("--starts", type=int, default=2, help="for 'serve': server starts on one compilation cache")
    p.add_argument("--clients", default="1,8", help="for 'serve': concurrent clients to compare (the first is "
                                                     "the reference)")
    p.add_argument("--requests", type=int, default=4, help="for 'serve': requests each client sends in turn")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV pool of our engine (default: what the engine picks for the lengths below)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="our engine's context (default: prompt + new tokens); infernix-serve uses the model's")

    p.add_argument("--workloads", default="copy-edit,two-versions,free-chat", help="for 'spec'")
    p.add_argument("--modes", default="off,ngram,tree,auto", help="for 'spec' (off first: the reference; mtp too "
                                                                  "where the checkpoint has an MTP head)")

    def go():
        a = p.parse_args(argv)
        apply_route(a)
        if a.what == "spec":
            from scripts import bench_spec
            from infernix_jax.loader import load_model
            names, modes = [w for w in a.workloads.split(",") if w], [m for m in a.modes.split(",") if m]
            known = ("copy-edit", "two-versions", "free-chat")
            if set(names) - set(known) or set(modes) - set(bench_spec.MODES) or not modes or modes[0] != "off":
                raise ValueError(f"spec: --workloads from {','.join(known)}; --modes from "
                                 f"{','.join(bench_spec.MODES)}, off first")
            new = 256 if a.new_tokens == p.get_default("new_tokens") else a.new_tokens
            bench_spec.run(load_model(a.model, dtype=a.dtype, weights=a.weights), new, names, modes,
                           None if a.out == p.get_default("out") else a.out)
            return 0
        if a.what == "serve":
            from scripts import bench_serve
            if a.starts < 1 or a.requests < 1:
                raise ValueError("--starts and --requests must be >= 1")
            clients = [int(x) for x in a.clients.split(",") if x]
            if any(c < 1 for c in clients):
                raise ValueError("--clients takes positive counts, e.g. 1,8")
            cache = a.compile_cache if a.compile_cache not in (None, "off") else None
            bench_serve.run(a.model, a.starts, cache, clients, a.requests, a.new_tokens, a.out,
                            [] if a.dtype is None else ["--dtype", a.dtype])
            return 0
        if a.what == "steps":
            from scripts import bench_steps
            from infernix_jax.loader import load_model
            ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
            batches = "1,8" if a.batches == p.get_default("batches") else a.batches
            lens = "64,512" if a.prefill_lens == p.get_default("prefill_lens") else a.prefill_lens
            context = 256 if a.contexts == p.get_default("contexts") else ints(a.contexts)[0]
            cases = [(N, B) for B in ints(batches) for N in ints(lens) if N >= B]
            if not cases:
                raise ValueError("steps: no case has --prefill-lens >= --batches")
            bench_steps.run(load_model(a.model, dtype=a.dtype, weights=a.weights), cases, context, a.out)
            return 0
        if a.what == "gdn":
            from scripts import bench_gdn
            shape = "qwen3.5-27b" if a.shape == p.get_default("shape") else a.shape
            if shape not in bench_gdn.SHAPES:
                raise ValueError(f"unknown gdn shape {shape!r}; known: {', '.join(bench_gdn.SHAPES)}")
            ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
            bench_gdn.run(shape, ints(a.batches), ints(a.prefill_lens))
            return 0
        if a.what == "prefix":
            from scripts import bench_prefix
            shape = None if a.shape == p.get_default("shape") else a.shape     # default: the real --model
            if a.tokens < 64:
                raise ValueError("--tokens must be >= 64")
            cases = [c for c in a.cases.split(",") if c]
            bad = set(cases) - set(bench_prefix.PrefixBench.CASES)
            if bad:
                raise ValueError(f"unknown --cases {', '.join(sorted(bad))}; known: {','.join(bench_prefix.PrefixBench.CASES)}")
            bench_prefix.run(shape, a.model, a.dtype, a.tokens, a.chunk,
                             None if a.out == p.get_default("out") else a.out, cases, a.kv_dtype or "")
            return 0
        if a.what == "moe":
            from scripts import bench_moe
            shape = "qwen3-30b-a3b" if a.shape == p.get_default("shape") else a.shape
            if shape not in bench_moe.SHAPES:
                raise ValueError(f"unknown moe shape {shape!r}; known: {', '.join(bench_moe.SHAPES)}")
            batches = "1,8,64,512,4096" if a.batches == p.get_default("batches") else a.batches
            bench_moe.run(shape, [int(x) for x in batches.split(",") if x], a.weights, a.out)
            return 0
        if a.what == "qmatmul":
            from scripts import bench_quant
            from infernix_jax.quant.formats import FORMATS
            from infernix_jax.quant.ggml import GGML_FORMATS
            known = (*FORMATS, *GGML_FORMATS)
            shape = "qwen3-8b" if a.shape == p.get_default("shape") else a.shape
            if shape not in bench_quant.PRESETS:
                raise ValueError(f"unknown shape {shape!r}; known: {', '.join(bench_quant.PRESETS)}")
            fmts = [f for f in a.formats.split(",") if f]
            bad = set(fmts) - set(known)
            if bad:
                raise ValueError(f"unknown --formats {', '.join(sorted(bad))}; known: {','.join(known)}")
            batches = "1,64,256,4096" if a.batches == p.get_default("batches") else a.batches
            bench_quant.run(shape, a.out, [int(x) for x in batches.split(",") if x], fmts, a.tune)
            return 0
        if a.what == "shapes":
            from scripts import bench_shapes
            if a.shape not in bench_shapes.PRESETS:
                raise ValueError(f"unknown shape {a.shape!r}; known: {', '.join(bench_shapes.PRESETS)}")
            ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
            if a.tensor_parallel != "1" or a.expert_parallel != 1:        # the same steps at several TP sizes
                bench_shapes.scaling(a.shape, a.out, ints(a.batches), ints(a.contexts), ints(a.prefill_lens),
                                     a.attn_impl or "pallas", a.decode_steps, ints(a.tensor_parallel),
                                     a.expert_parallel, a.weights, a.kv_dtype or "")
                return 0
            bench_shapes.run(a.shape, a.out, ints(a.batches), ints(a.contexts), ints(a.prefill_lens), a.attention,
                             ints(a.torch_batches), a.attn_impl or "pallas", a.decode_steps, a.tune, a.weights,
                             a.kv_dtype or "", fuse=not a.unfused, mtp_depth=a.mtp, sampled=a.sampled)
            return 0
        import jax
        from infernix_jax.loader import load_model
        model = load_model(a.model, dtype=a.dtype, weights=a.weights)
        import numpy as np
        prompt = list(np.random.default_rng(0).integers(100, model.cfg.vocab_size - 100, a.prompt_tokens))
        prompt = [int(t) for t in prompt]
        ours = _ours(model, a.batch, prompt, a.new_tokens, a.kv_cache_gib, a.max_model_len, a.attn_impl,
                     a.kv_dtype or "")
        ref = None if a.no_reference else _transformers(a.model, model.path, a.batch, prompt, a.new_tokens)
        res = {"model": model.name, "dtype": a.dtype, "device": str(jax.devices()[0].device_kind),
               "cpu": platform.processor() or platform.machine(), "batch": a.batch,
               "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "jax": jax.__version__,
               "kv_cache_gib": a.kv_cache_gib, "max_model_len": a.max_model_len, "kv_dtype": a.kv_dtype or "model",
               "infernix_tok_s": round(ours, 1)}
        if ref is not None:
            res.update(transformers_tok_s=round(ref, 1), ratio=round(ours / ref, 2))
        print(json.dumps(res))

    return run("infernix-bench", go)


if __name__ == "__main__":
    sys.exit(main())
