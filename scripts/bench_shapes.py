"""Benchmarks at real model shapes with random weights (bf16), for the GPU:

  decode     tokens/s of the multi-step decode dispatch at each batch size and context, with the
             HBM roofline (bytes one step must read / copy bandwidth measured in this run)
  prefill    tokens/s and time to first token of one prompt of each length, and its share of the
             bf16 matmul throughput measured in this run (model FLOPs utilisation)
  attention  our Pallas kernels against cuDNN (jax.nn.dot_product_attention) at the same shapes,
             and the decode kernel's share of copy bandwidth
  torch      transformers' generate() with its static cache at the same shapes, where torch is present

Results go to stdout as JSON lines as they are measured, and to OUT/bench-<shape>.json and .png."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax import sharding
from infernix_jax.config import PRESETS
from infernix_jax.engine import steps
from infernix_jax.engine.sampler import SamplingArrays
from infernix_jax.models.qwen3_5 import StateRows
from infernix_jax.models.kv_pool import KV_DTYPES, init_paged_kv, kv_bytes_per_token, num_attention_layers, state_bytes_per_seq
from infernix_jax.engine.plan import params_bytes
from infernix_jax.models.fuse import fuse_params
from infernix_jax.models.params import init_params
from infernix_jax.quant import WEIGHT_FORMATS
from infernix_jax.sharding import Parallel
from infernix_jax.route import Route
from scripts.bench_probes import GiB, copy_bandwidth, matmul_flops, timed

SAMPLED = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}      # --sampled: Qwen3's recommended (non-thinking)


def prefill_flops(cfg, n: int) -> float:
    """Matmul FLOPs of one n-token prompt: 2 x active weights per token (MoE: the routed experts and
    the shared one), causal attention over the attention layers, and one lm_head row."""
    H, L = cfg.hidden_size, cfg.num_layers
    n_attn = sum(not cfg.is_linear_layer(i) for i in range(L))
    per_tok = 0
    for i in range(L):
        if cfg.is_linear_layer(i):
            conv = 2 * cfg.lin_k_heads * cfg.lin_k_dim + cfg.lin_v_heads * cfg.lin_v_dim
            per_tok += H * (conv + cfg.lin_v_heads * cfg.lin_v_dim + 2 * cfg.lin_v_heads) \
                + cfg.lin_v_heads * cfg.lin_v_dim * H
        else:
            q = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
            per_tok += H * (q + 2 * cfg.num_kv_heads * cfg.head_dim) + cfg.num_heads * cfg.head_dim * H
        if cfg.is_moe_layer(i):
            per_tok += 3 * H * (cfg.num_experts_per_tok * cfg.moe_intermediate_size
                                + cfg.shared_expert_intermediate_size) + H * cfg.num_experts
        else:
            per_tok += 3 * H * cfg.intermediate_size
    attn = 2 * n * n * cfg.num_heads * cfg.head_dim * n_attn       # QK^T and PV, causal half of 4 n^2 h d
    return 2 * per_tok * n + attn + 2 * H * cfg.vocab_size


def gguf_blocks(params: dict, fmt: str) -> dict:
    """params with the projections as random GGUF blocks of type fmt (--weights q4_k, ...: nothing
    quantizes to those types; speed does not depend on the values)."""
    from infernix_jax.models.roles import QUANTIZABLE
    from scripts.bench_quant import quantized
    layers = [{k: quantized(v, fmt, i) if k in QUANTIZABLE else v for k, v in p.items()}
              for i, p in enumerate(params["layers"])]
    return {**params, "layers": layers}


class Bench:
    def __init__(self, shape: str, out: Path, block_size: int = 16, decode_steps: int = 8, impl: str = "pallas",
                 weights: str | None = None, kv_dtype: str = "", fuse: bool = True, parallel: Parallel | None = None,
                 mtp_depth: int = 0):
        self.shape, self.cfg = shape, PRESETS[shape]
        # --mtp N: the checkpoint's multi-token prediction head (one layer, as Qwen3.5's), timed in
        # the decode steps beside the same steps without it (engine/spec/mtp.py)
        self.mtp_depth = mtp_depth
        if mtp_depth:
            if not self.cfg.layer_types:
                raise ValueError(f"--mtp: {shape} is not a Qwen3.5 / Qwen3-Next shape (the MTP head is theirs)")
            self.cfg = dataclasses.replace(self.cfg, mtp_layers=1)
        self.suffix = (f"-{weights}" if weights else "") + (f"-kv{kv_dtype}" if kv_dtype else "") \
            + ("" if fuse else "-unfused") + (f"-tp{parallel.tensor}ep{parallel.expert}" if parallel else "")
        # several devices (sharding.py): the weights and pools split over a mesh, every step run on it;
        # sizes and the roofline below are one device's
        self.parallel = parallel if parallel else None
        self.mesh = sharding.make_mesh(parallel) if self.parallel else None
        fuse = fuse and self.mesh is None
        self.kv_dtype = kv_dtype
        self.out = out
        self.bs, self.k = block_size, decode_steps
        self.route = Route.named(impl, kv_dtype)
        # other ragged-kernel tiles for attention() to time beside the default: (rows, blocks, warps, stages)
        self.prefill_alternatives = ((64, 4, 4, 3), (128, 4, 4, 3), (128, 8, 8, 2))
        self.dtype = jnp.bfloat16
        # the probes first, on an empty card: beside a model that fills most of it (qwen3.5-27b's 50 GiB
        # on an 80 GB H100) their arrays ran it out of memory
        self.bw = copy_bandwidth()
        self.flops = matmul_flops()
        self.params = init_params(self.cfg, jax.random.PRNGKey(0), self.dtype)
        if weights == "gguf":
            raise ValueError("shapes has random weights, no GGUF file: pass a block type, e.g. --weights q4_k")
        if weights:              # --weights: the projections quantized (multiplied by the route's kernels)
            from infernix_jax.quant.apply import quantize_params
            self.params = quantize_params(self.params, weights, progress=False) if weights in WEIGHT_FORMATS \
                else gguf_blocks(self.params, weights)
        if fuse:                 # as load_model does (models/fuse.py); --unfused: one product per part
            self.params = fuse_params(self.params)
        if self.mesh is not None:
            self.params = sharding.shard_params(self.params, self.mesh, self.cfg)
            self.weights_bytes = sharding.bytes_per_device(
                self.params, sharding.param_specs(self.params, self.mesh, self.cfg), self.mesh)
        else:
            self.weights_bytes = params_bytes(self.params)
        self.per_tok = kv_bytes_per_token(self.cfg, self.dtype, kv_dtype, block_size) \
            / (self.parallel.kv_split(self.cfg.num_kv_heads) if self.parallel else 1)
        self.per_seq = state_bytes_per_seq(self.cfg, self.dtype)       # hybrids' recurrent state
        self.results = {"shape": shape, "weights": weights or "bf16", "kv_dtype": kv_dtype or "bf16", "fused": fuse,
                        "tensor_parallel": parallel.tensor if parallel else 1,
                        "expert_parallel": parallel.expert if parallel else 1,
                        "kv_bytes_per_token": self.per_tok, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                        "copy_GBps": self.bw / 1e9, "matmul_TFLOPs": self.flops / 1e12, "weights_GiB": self.weights_bytes / GiB, "decode": [],
                        "prefill": [], "attention": [], "torch": []}

    def step_bytes(self, B: int, ctx: float) -> float:
        """Bytes one decode step must move: the weights it uses, the batch's KV, and for hybrids each
        sequence's recurrent state read and written back. For MoE only the experts some token picks
        are read: under uniform routing, E * (1 - (1 - k/E)^B) of them."""
        cfg, weights = self.cfg, self.weights_bytes
        if cfg.num_experts:
            E, k = cfg.num_experts, cfg.num_experts_per_tok
            n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
            experts = n_moe * E * 3 * cfg.hidden_size * cfg.moe_intermediate_size * jnp.dtype(self.dtype).itemsize
            weights = weights - experts + experts * (1 - (1 - k / E) ** B)
        return weights + B * ctx * self.per_tok + 2 * B * self.per_seq

    def emit(self, kind: str, row: dict) -> None:
        self.results[kind].append(row)
        print(json.dumps({"kind": kind, "shape": self.shape, "weights": self.results["weights"],
                          "kv_dtype": self.results["kv_dtype"], **row}), flush=True)
        (self.out / f"bench-{self.shape}{self.suffix}.json").write_text(json.dumps(self.results, indent=1))

    def decode(self, B: int, ctx: int, reps: int = 5, kv_budget_gib: float = 100.0, mtp: bool = False,
               sampled: bool = False) -> None:
        """Decode steps at batch B and context ctx; mtp: with the MTP head's row at each step and its
        chain of drafts after the last (the engine's --speculative mtp), against the plain row;
        sampled: every row draws with SAMPLED (Qwen's recommended settings), against the greedy row
        (the sampler's top-k / top-p thresholds are loops: what they cost a step)."""
        M = -(-(ctx + self.k) // self.bs)
        if B * M * self.bs * self.per_tok > kv_budget_gib * GiB:
            return self.emit("decode", {"batch": B, "context": ctx, "skipped": "KV does not fit"})
        kv = sharding.make_sharded(lambda: init_paged_kv(self.cfg, B * M + 1, self.bs, self.dtype, state_slots=B,
                                                         kv_dtype=self.kv_dtype), sharding.kv_specs, self.mesh)
        rows = StateRows(jnp.arange(B, dtype=jnp.int32), jnp.arange(B, dtype=jnp.int32), jnp.zeros((B,), bool)) \
            if self.cfg.layer_types else None
        bt = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
        tok = jnp.zeros((B,), jnp.int32)
        pos = jnp.full((B,), ctx, jnp.int32)
        valid = jnp.ones((B,), bool)
        st = jnp.zeros((B,), jnp.int32)
        samp = SamplingArrays.greedy(B)
        if sampled:
            samp = samp.replace(**{k: np.full((B,), v, np.asarray(getattr(samp, k)).dtype) for k, v in SAMPLED.items()})
        state = {"kv": kv}
        head = dict(mtp_cap=jnp.full((B,), M * self.bs, jnp.int32), mtp_depth=self.mtp_depth) if mtp else {}

        def call():
            with sharding.use(self.mesh):
                out, state["kv"] = steps.decode_steps(self.params, self.cfg, state["kv"], tok, pos, bt, valid, st,
                                                      samp, num_steps=self.k, route=self.route, want_top=False,
                                                      rows=rows, **head)
            out[0].block_until_ready()
        t0 = time.perf_counter()
        call()
        compile_s = time.perf_counter() - t0
        sec = timed(call, reps)
        tok_s = B * self.k / sec
        roof = B * self.bw / self.step_bytes(B, ctx + self.k / 2)
        row = {"batch": B, "context": ctx, "tok_s": round(tok_s, 1), "roofline_tok_s": round(roof, 1),
               "of_roofline": round(tok_s / roof, 3), "ms_per_step": round(1e3 * sec / self.k, 3),
               "compile_s": round(compile_s, 1)}
        plain = [r for r in self.results["decode"] if (r["batch"], r["context"]) == (B, ctx) and "tok_s" in r
                 and "mtp_depth" not in r and "sampling" not in r]
        vs = {"vs_plain": round(tok_s / plain[-1]["tok_s"], 3)} if plain and (mtp or sampled) else {}
        if mtp:
            row.update(mtp_depth=self.mtp_depth, **vs)
        if sampled:
            row.update(sampling=SAMPLED, **vs)
        self.emit("decode", row)

    def prefill(self, n: int, reps: int = 3, chunk: int = 8192) -> None:
        """One n-token prompt, fed as the engine feeds it: chunks of at most `chunk` tokens, each
        step attending to the KV (and, in hybrids, continuing the state) of the ones before."""
        M = -(-n // self.bs)
        state = {"kv": sharding.make_sharded(lambda: init_paged_kv(self.cfg, M + 1, self.bs, self.dtype, state_slots=1,
                                                                   kv_dtype=self.kv_dtype), sharding.kv_specs,
                                             self.mesh)}
        i32 = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731
        calls = []
        for a in range(0, n, chunk):
            c = min(chunk, n - a)
            args = (jnp.zeros((c,), jnp.int32), jnp.arange(a, a + c, dtype=jnp.int32),
                    jnp.arange(a, a + c, dtype=jnp.int32), jnp.arange(M, dtype=jnp.int32)[None], i32(a + c),
                    i32(0, c), i32(c - 1)[None], jnp.zeros((1,), jnp.int32), SamplingArrays.greedy(1))
            rows = StateRows(i32(c), i32(1), jnp.zeros((1,), bool), jnp.arange(c, dtype=jnp.int32)[None], i32(c),
                             i32(0), jnp.asarray([a == 0])) if self.cfg.layer_types else None
            calls.append((args, rows))

        def call():
            with sharding.use(self.mesh):
                for args, rows in calls:
                    out, state["kv"] = steps.mixed_step(self.params, self.cfg, state["kv"], *args, route=self.route,
                                                        want_top=False, rows=rows)
            out[0].block_until_ready()
        sec = timed(call, reps)
        self.emit("prefill", {"tokens": n, "chunk": min(chunk, n), "tok_s": round(n / sec, 1),
                              "ttft_ms": round(1e3 * sec, 2),
                              "of_matmul_peak": round(prefill_flops(self.cfg, n) / sec / self.flops, 3)})

    def attention(self) -> None:
        from jax.experimental import pallas as pl

        from pallas_kernels.paged_decode_attention import BlockSizes as DecodeBlockSizes
        from pallas_kernels.paged_decode_attention import (paged_decode_attention, paged_decode_attention_reference,
                                                           split_pages)
        from pallas_kernels.ragged_paged_attention import BlockSizes as RaggedBlockSizes
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
        cfg, bs = self.cfg, self.bs
        nH, nKV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rng = jax.random.PRNGKey(1)
        for T in (4096,):           # prefill, causal, one sequence
            q = jax.random.normal(rng, (1, T, nH, hd), self.dtype)
            k = jax.random.normal(rng, (1, T, nKV, hd), self.dtype)
            v = jax.random.normal(rng, (1, T, nKV, hd), self.dtype)
            cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
            t_cudnn = timed(lambda: cud(q, k, v).block_until_ready(), 10)
            M = T // bs
            kp = k[0].reshape(M, bs, nKV, hd).transpose(2, 0, 1, 3)
            vp = v[0].reshape(M, bs, nKV, hd).transpose(2, 0, 1, 3)
            bt = jnp.arange(M, dtype=jnp.int32)[None]
            lens, cu = jnp.asarray([T], jnp.int32), jnp.asarray([0, T], jnp.int32)
            flops = 4 * T * T / 2 * nH * hd
            for bsz in (RaggedBlockSizes(), *(RaggedBlockSizes(*a) for a in self.prefill_alternatives)):
                t_ours = timed(lambda: ragged_paged_attention(q[0], kp, vp, bt, lens, cu, block_sizes=bsz)
                               .block_until_ready(), 10)
                self.emit("attention", {"kind": "prefill", "tokens": T, "config": str(bsz),
                                        "ours_ms": round(t_ours * 1e3, 3), "cudnn_ms": round(t_cudnn * 1e3, 3),
                                        "vs_cudnn": round(t_cudnn / t_ours, 3),
                                        "ours_TFLOPs": round(flops / t_ours / 1e12, 1)})
        for B, C in ((1, 1024), (1, 8192), (1, 32768), (4, 1024), (4, 8192), (8, 32768), (64, 4096)):
            M = C // bs
            kp = jax.random.normal(rng, (nKV, B * M, bs, hd), self.dtype)
            vp = jax.random.normal(rng, (nKV, B * M, bs, hd), self.dtype)
            q = jax.random.normal(rng, (B, nH, hd), self.dtype)
            bt = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
            lens = jnp.full((B,), C, jnp.int32)
            t_ours = timed(lambda: paged_decode_attention(q, kp, vp, bt, lens).block_until_ready(), 10)
            # the same kernel with its splits never shrunk to fill the GPU, and XLA's gather + einsum
            whole = DecodeBlockSizes(min_programs=0)
            t_whole = timed(lambda: paged_decode_attention(q, kp, vp, bt, lens, block_sizes=whole)
                            .block_until_ready(), 10)
            xla = jax.jit(paged_decode_attention_reference)
            t_xla = timed(lambda: xla(q, kp, vp, bt, lens).block_until_ready(), 10)
            kd = kp.reshape(nKV, B, C, hd).transpose(1, 2, 0, 3)
            vd = vp.reshape(nKV, B, C, hd).transpose(1, 2, 0, 3)
            cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn"))
            try:
                t_cudnn = timed(lambda: cud(q, kd, vd).block_until_ready(), 10)
            except Exception as e:  # cuDNN may refuse some decode shapes
                t_cudnn = None
                print(json.dumps({"cudnn_decode_error": str(e)[:200]}))
            kv_bytes = 2 * B * C * nKV * hd * 2
            self.emit("attention", {"kind": "decode", "batch": B, "context": C, "ours_ms": round(t_ours * 1e3, 3),
                                    "splits": pl.cdiv(M, split_pages(B, nKV, M, DecodeBlockSizes())),
                                    "unsplit_ms": round(t_whole * 1e3, 3), "vs_unsplit": round(t_whole / t_ours, 3),
                                    "xla_ms": round(t_xla * 1e3, 3), "vs_xla": round(t_xla / t_ours, 3),
                                    "cudnn_ms": t_cudnn and round(t_cudnn * 1e3, 3),
                                    "vs_cudnn": t_cudnn and round(t_cudnn / t_ours, 3),
                                    "of_copy_bw": round(kv_bytes / t_ours / self.bw, 3)})
            for kv_dtype in KV_DTYPES:     # the same decode on quantized pools: time against bf16's
                pools, quant = quantized_pools(kp, vp, kv_dtype)
                t_q = timed(lambda: paged_decode_attention(q, *pools, bt, lens, **quant).block_until_ready(), 10)
                q_bytes = B * C * kv_bytes_per_token(cfg, self.dtype, kv_dtype, bs) / num_attention_layers(cfg)
                self.emit("attention", {"kind": "decode", "batch": B, "context": C, "kv_dtype": kv_dtype,
                                        "ours_ms": round(t_q * 1e3, 3), "vs_bf16_kv": round(t_ours / t_q, 3),
                                        "bytes_vs_bf16_kv": round(kv_bytes / q_bytes, 3),
                                        "of_copy_bw": round(q_bytes / t_q / self.bw, 3)})

    def torch_static(self, B: int, ctx: int, new: int = 32) -> None:
        try:
            import torch
            import transformers
        except ImportError:
            return
        import gc
        gc.collect()               # the previous batch's model is out of scope: give its memory back
        torch.cuda.empty_cache()
        cfg = self.cfg
        kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=ctx + new + 16)
        if cfg.family == "qwen3_moe":
            hcfg = transformers.Qwen3MoeConfig(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                                               moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=True, **kw)
        elif cfg.family == "llama":
            hcfg = transformers.LlamaConfig(**kw)
        else:
            hcfg = transformers.Qwen3Config(**kw)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(hcfg, dtype=torch.bfloat16).eval()
        ids = torch.randint(0, cfg.vocab_size, (B, ctx), device="cuda")

        def gen(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, cache_implementation="static")
            torch.cuda.synchronize()
            return time.perf_counter() - t
        gen(new)   # transformers compiles the static-cache decode step on first use: warm it fully
        gen(new)
        t1, tn = gen(1), gen(new)
        self.emit("torch", {"batch": B, "context": ctx, "tok_s": round(B * (new - 1) / (tn - t1), 1)})

    def tune(self) -> None:
        """Sweep the kernels' block sizes at this shape's heads. The decode kernel's split size must not
        depend on the batch, so each configuration is timed at every (batch, context) and ranked by its
        worst slowdown against the best at each shape."""
        from pallas_kernels import paged_decode_attention as pda
        from pallas_kernels import ragged_paged_attention as rpa
        cfg, bs = self.cfg, self.bs
        nH, nKV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rng = jax.random.PRNGKey(2)
        configs = [pda.BlockSizes(ppb, pps, warps, stages) for ppb in (8, 16) for pps in (16, 32, 64, 128)
                   for warps in (4, 8) for stages in (2, 3) if ppb <= pps]
        table: dict = {}
        for B, C in ((1, 32768), (8, 32768), (64, 4096), (32, 8192)):
            M = C // bs
            kp, vp = (jax.random.normal(r, (nKV, B * M, bs, hd), self.dtype) for r in jax.random.split(rng))
            q = jax.random.normal(rng, (B, nH, hd), self.dtype)
            bt = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
            lens = jnp.full((B,), C, jnp.int32)
            for bsz in configs:
                try:
                    table[(B, C, bsz)] = timed(lambda: pda.paged_decode_attention(q, kp, vp, bt, lens, block_sizes=bsz)
                                               .block_until_ready(), 10, warm_s=0.1)
                except Exception as e:  # a configuration that does not compile at this shape
                    print(json.dumps({"tune_error": str(bsz), "error": str(e)[:120]}))
            del kp, vp
        shapes = sorted({(B, C) for B, C, _ in table})
        best_at = {sh: min(t for (B, C, _), t in table.items() if (B, C) == sh) for sh in shapes}
        ranked = []
        for bsz in configs:
            ts = [table.get((B, C, bsz)) for B, C in shapes]
            if None not in ts:
                ranked.append((max(t / best_at[sh] for t, sh in zip(ts, shapes)), bsz, ts))
        ranked.sort(key=lambda r: r[0])
        for worst, bsz, ts in ranked[:6]:
            self.emit("attention", {"kind": "tune-decode", "config": str(bsz), "worst_vs_best": round(worst, 3),
                                    **{f"ms_b{B}_c{C}": round(t * 1e3, 3) for (B, C), t in zip(shapes, ts)},
                                    **{f"of_copy_bw_b{B}_c{C}": round(4 * B * C * nKV * hd / t / self.bw, 3)
                                       for (B, C), t in zip(shapes, ts)}})
        T = 4096
        M = T // bs
        kp, vp = (jax.random.normal(r, (nKV, M, bs, hd), self.dtype) for r in jax.random.split(rng))
        q = jax.random.normal(rng, (T, nH, hd), self.dtype)
        bt = jnp.arange(M, dtype=jnp.int32)[None]
        lens, cu = jnp.asarray([T], jnp.int32), jnp.asarray([0, T], jnp.int32)
        flops = 4 * T * T / 2 * nH * hd
        results = []
        for bq in (64, 128):
            for ppb in (4, 8):
                for warps in (4, 8):
                    for stages in (2, 3):
                        bsz = rpa.BlockSizes(bq, ppb, warps, stages)
                        try:
                            t = timed(lambda: rpa.ragged_paged_attention(
                                q, kp, vp, bt, lens, cu, block_sizes=bsz).block_until_ready(), 10, warm_s=0.1)
                        except Exception as e:
                            print(json.dumps({"tune_error": str(bsz), "error": str(e)[:120]}))
                            continue
                        results.append((t, bsz))
        results.sort(key=lambda r: r[0])
        for t, bsz in results[:4]:
            self.emit("attention", {"kind": "tune-prefill", "tokens": T, "config": str(bsz),
                                    "ms": round(t * 1e3, 3), "TFLOPs": round(flops / t / 1e12, 1)})

    def plot(self) -> None:
        try:
            import matplotlib
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[bench]'); no plot written")
            return
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        rows = [r for r in self.results["decode"] if "tok_s" in r]
        for ctx in sorted({r["context"] for r in rows}):
            rs = [r for r in rows if r["context"] == ctx]
            ax.plot([r["batch"] for r in rs], [r["tok_s"] for r in rs], "o-", label=f"infernix, context {ctx}")
            ax.plot([r["batch"] for r in rs], [r["roofline_tok_s"] for r in rs], "--", label=f"HBM roofline, {ctx}")
        tr = self.results["torch"]
        if tr:
            ax.plot([r["batch"] for r in tr], [r["tok_s"] for r in tr], "s:", label="transformers static cache")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{self.shape} bf16 on {self.results['device']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(self.out / f"bench-{self.shape}{self.suffix}.png", dpi=110)


def quantized_pools(kp, vp, kv_dtype: str):
    """bf16 pools [nKV, P, bs, hd] quantized as --kv-dtype stores them -> ((k codes, v codes),
    {k_scale, v_scale, fmts}) for the attention kernels."""
    from pallas_kernels import kv_bf16p, kv_quant
    fmts = KV_DTYPES[kv_dtype]
    if kv_dtype == "bf16p":
        nKV, P, bs, hd = kp.shape
        packed = []
        for x in (kp, vp):
            state = (jnp.zeros((nKV, P, bs, kv_bf16p.code_dims(hd)), jnp.uint8), jnp.zeros((nKV, P, bs), jnp.float32),
                     jnp.zeros((nKV, P, kv_bf16p.ESCAPES), jnp.int32))
            packed.append(kv_bf16p.write(*state, x.reshape(nKV, P * bs, hd).swapaxes(0, 1), jnp.arange(P * bs))[:3])
        (kc, ks, ke), (vc, vs, ve) = packed
        return (kc, vc), dict(k_scale=ks, v_scale=vs, k_esc=ke, v_esc=ve, fmts=fmts)
    out = []
    for x, f in zip((kp, vp), fmts):
        s = kv_quant.row_scale(x.astype(jnp.float32), f)
        out.append((kv_quant.encode(x.astype(jnp.float32), s, f), s))
    return (out[0][0], out[1][0]), dict(k_scale=out[0][1], v_scale=out[1][1], fmts=fmts)


def scaling(shape: str, out: str, batches, contexts, prefills, impl: str, decode_steps: int, tps: list[int],
            expert_parallel: int = 1, weights: str | None = None, kv_dtype: str = "") -> list[dict]:
    """The same decode and prefill at each tensor-parallel size in tps (on one host's devices): tok/s
    and the scaling efficiency against the first size, speed-up / (devices / first's devices).
    Printed as JSON lines and written to OUT/scaling-<shape>.json."""
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    rows, base = [], {}
    for tp in tps:
        par = Parallel(tp, expert_parallel)
        b = Bench(shape, outdir, decode_steps=decode_steps, impl=impl, weights=weights, kv_dtype=kv_dtype,
                  parallel=par if par else None)
        for ctx in contexts:
            for B in batches:
                b.decode(B, ctx)
        for n in prefills:
            b.prefill(n)
        for r in b.results["decode"] + b.results["prefill"]:
            if "tok_s" not in r:
                continue
            key = ("decode", r["batch"], r["context"]) if "batch" in r else ("prefill", r["tokens"])
            base.setdefault(key, (r["tok_s"], par.devices))
            t0, d0 = base[key]
            row = {"shape": shape, "tensor_parallel": tp, "expert_parallel": expert_parallel, "kind": key[0],
                   **({"batch": key[1], "context": key[2]} if key[0] == "decode" else {"tokens": key[1]}),
                   "tok_s": r["tok_s"], "speedup": round(r["tok_s"] / t0, 3),
                   "efficiency": round(r["tok_s"] / t0 / (par.devices / d0), 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (outdir / f"scaling-{shape}.json").write_text(json.dumps(rows, indent=1))
        del b
    return rows


def run(shape: str, out: str, batches, contexts, prefills, attention: bool, torch_batches, impl: str,
        decode_steps: int, tune: bool = False, weights: str | None = None, kv_dtype: str = "",
        fuse: bool = True, mtp_depth: int = 0, sampled: bool = False) -> dict:
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    b = Bench(shape, outdir, decode_steps=decode_steps, impl=impl, weights=weights, kv_dtype=kv_dtype, fuse=fuse,
              mtp_depth=mtp_depth)
    print(json.dumps({"shape": shape, "copy_GBps": round(b.bw / 1e9, 1), "weights_GiB": round(b.weights_bytes / GiB, 2)}),
          flush=True)
    if tune:
        b.tune()
    if attention:
        b.attention()
    for ctx in contexts:
        for B in batches:
            b.decode(B, ctx)
            if mtp_depth:
                b.decode(B, ctx, mtp=True)
            if sampled:
                b.decode(B, ctx, sampled=True)
    for n in prefills:
        b.prefill(n)
    if torch_batches:
        b.params = None          # hand the GPU memory to torch (run with XLA_PYTHON_CLIENT_ALLOCATOR=platform)
        jax.clear_caches()
    for B in torch_batches:
        b.torch_static(B, contexts[0])
    b.plot()
    return b.results


__all__ = ["run", "scaling", "PRESETS"]

