"""Tiny random transformers models (the reference implementations) and GGUF files made from them."""
from __future__ import annotations

import numpy as np
import torch

BASE = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=37, max_position_embeddings=512, hidden_act="silu", initializer_range=0.2,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

MOE = dict(moe_intermediate_size=12, num_experts_per_tok=2, num_experts=8, decoder_sparse_step=1,
           mlp_only_layers=[], norm_topk_prob=True)


# Gated DeltaNet settings of transformers' own Qwen3-Next / Qwen3.5 testers (MODELS.md section 9)
LINEAR = dict(linear_conv_kernel_dim=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
              linear_num_value_heads=8, head_dim=16)


def hf_config(family: str, **overrides):
    import transformers as tf
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
           "qwen3_moe": tf.Qwen3MoeConfig, "qwen3_next": tf.Qwen3NextConfig, "qwen3_5": tf.Qwen3_5TextConfig,
           "qwen3_5_moe": tf.Qwen3_5MoeTextConfig}[family]
    kw = dict(BASE)
    if family in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        kw.update(MOE)
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        kw.update(LINEAR, layer_types=["linear_attention", "full_attention"] if family == "qwen3_next"
                  else ["full_attention", "linear_attention"])
        if family != "qwen3_5":
            kw["shared_expert_intermediate_size"] = 36
        if family == "qwen3_5_moe":
            for k in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
                kw.pop(k)
    kw.update(overrides)
    theta = kw.pop("rope_theta", 10000.0)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if "linear_conv_kernel_dim" in kw:
        kw["rope_parameters"]["partial_rotary_factor"] = kw.pop("partial_rotary_factor", 0.25)
    return cls(**kw)


def make_hf_model(family: str, seed: int = 0, **overrides):
    import transformers as tf
    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # norms init to ones; randomise them so a missing norm cannot hide
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias") or name.endswith("dt_bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen3_next": "qwen3next",
             "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf permute for attn_q / attn_k (HF rotate_half -> interleaved)
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, family: str, qtype_for=lambda name, arr: None):
    """Write an HF model as llama.cpp would; qtype_for(name, arr) picks a GGMLQuantizationType or None
    (F32). Returns {hf_name: the array as the GGUF stores it, dequantized} so a reference model can be
    given exactly the stored weights."""
    import gguf
    cfg = model.config
    arch = GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if family == "qwen3_moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    stored = {}
    L = cfg.num_hidden_layers

    def put(gname, hf_name, arr, permute_heads=0):
        a = _permute(arr, permute_heads) if permute_heads else arr
        q = qtype_for(gname, a) if a.ndim >= 2 else None
        if q is None:
            w.add_tensor(gname, a.astype(np.float32))
            back = a.astype(np.float32)
        else:
            data = gguf.quants.quantize(a.astype(np.float32), q)
            w.add_tensor(gname, data, raw_dtype=q)
            back = gguf.quants.dequantize(data, q).reshape(a.shape)
        if permute_heads:  # the reference gets the same values in HF order
            back = back.reshape(permute_heads, back.shape[0] // permute_heads // 2, 2, *back.shape[1:]) \
                .swapaxes(1, 2).reshape(back.shape)
        stored[hf_name] = back

    put("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", "model.norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", "lm_head.weight", sd["lm_head.weight"])
    perm = family == "llama"
    for i in range(L):
        h, g = f"model.layers.{i}.", f"blk.{i}."
        put(g + "attn_norm.weight", h + "input_layernorm.weight", sd[h + "input_layernorm.weight"])
        put(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", sd[h + "post_attention_layernorm.weight"])
        for proj, gn, heads in (("q", "attn_q", cfg.num_attention_heads), ("k", "attn_k", cfg.num_key_value_heads),
                                ("v", "attn_v", 0), ("o", "attn_output", 0)):
            put(f"{g}{gn}.weight", f"{h}self_attn.{proj}_proj.weight", sd[f"{h}self_attn.{proj}_proj.weight"],
                heads if perm else 0)
            if f"{h}self_attn.{proj}_proj.bias" in sd:
                put(f"{g}{gn}.bias", f"{h}self_attn.{proj}_proj.bias", sd[f"{h}self_attn.{proj}_proj.bias"],
                    heads if perm else 0)
        for n in ("q_norm", "k_norm"):
            if f"{h}self_attn.{n}.weight" in sd:
                put(f"{g}attn_{n}.weight", f"{h}self_attn.{n}.weight", sd[f"{h}self_attn.{n}.weight"])
        if f"{h}mlp.gate.weight" in sd:
            put(g + "ffn_gate_inp.weight", h + "mlp.gate.weight", sd[h + "mlp.gate.weight"])
            gate_up = sd[h + "mlp.experts.gate_up_proj"]                      # [E, 2I, H]
            I = gate_up.shape[1] // 2
            put(g + "ffn_gate_exps.weight", h + "experts.gate", gate_up[:, :I])
            put(g + "ffn_up_exps.weight", h + "experts.up", gate_up[:, I:])
            put(g + "ffn_down_exps.weight", h + "mlp.experts.down_proj", sd[h + "mlp.experts.down_proj"])
            stored[h + "mlp.experts.gate_up_proj"] = np.concatenate(
                [stored.pop(h + "experts.gate"), stored.pop(h + "experts.up")], axis=1)
        else:
            for proj, gn in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
                put(f"{g}{gn}.weight", f"{h}mlp.{proj}_proj.weight", sd[f"{h}mlp.{proj}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _tile(x: np.ndarray, Hk: int, r: int, d: int) -> np.ndarray:
    """llama.cpp's value-head reorder: grouped rows [Hk, r, d, ...] -> tiled [r, Hk, d, ...]."""
    rest = x.shape[1:]
    return x.reshape(Hk, r, d, *rest).swapaxes(0, 1).reshape(-1, *rest)


def write_hybrid_gguf(model, path, family: str, mtp_blocks: int = 0, tokenizer_from=None) -> None:
    """Write a Qwen3-Next / Qwen3.5 model as llama.cpp's converter does (MODELS.md section 8):
    norms stored as 1 + w (except the GDN output norm), ssm_a = -exp(A_log), conv squeezed,
    Qwen3-Next's in_proj_qkvz split into attn_qkv + attn_gate, Qwen3.5's value heads tiled.
    mtp_blocks: blocks appended for MTP (block_count and nextn_predict_layers count them; their
    tensors are not written, as our loader does not read them). tokenizer_from: a GGUF file whose
    tokenizer.* keys (vocabulary, merges, chat template) are copied in."""
    import gguf
    cfg = model.config
    arch = GGUF_ARCH[family]
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    Hk, Hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r = Hv // Hk
    tiled = family != "qwen3_next" and r > 1
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L + mtp_blocks)
    if mtp_blocks:
        w.add_nextn_predict_layers(mtp_blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(H)
    w.add_feed_forward_length(getattr(cfg, "intermediate_size", 0) or 0)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(Hk)
    w.add_ssm_time_step_rank(Hv)
    w.add_ssm_inner_size(Hv * dv)
    every = list(cfg.layer_types).index("full_attention") + 1
    assert all((t == "full_attention") == ((i + 1) % every == 0) for i, t in enumerate(cfg.layer_types)), \
        "GGUF files can only describe layers with a full-attention interval"
    w.add_full_attention_interval(every)
    if tokenizer_from is not None:
        for key, field in gguf.GGUFReader(str(tokenizer_from)).fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if family != "qwen3_5":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    sd = {k.replace("model.language_model.", "model."): v.detach().float().numpy() for k, v in model.state_dict().items()}

    def put(name, a):
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"] + 1)
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    for i in range(L):
        h, g = f"model.layers.{i}.", f"blk.{i}."
        put(g + "attn_norm.weight", sd[h + "input_layernorm.weight"] + 1)
        put(g + "post_attention_norm.weight", sd[h + "post_attention_layernorm.weight"] + 1)
        if cfg.layer_types[i] == "linear_attention":
            la = h + "linear_attn."
            conv, A, dt = sd[la + "conv1d.weight"][:, 0, :], sd[la + "A_log"], sd[la + "dt_bias"]
            out = sd[la + "out_proj.weight"]
            if family == "qwen3_next":                   # [q, k, v, z] per key head -> all q | all k | all v, z
                qkvz = sd[la + "in_proj_qkvz.weight"].reshape(Hk, 2 * dk + 2 * r * dv, H)
                q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
                put(g + "attn_qkv.weight", np.concatenate([t.reshape(-1, H) for t in (q, k, v)]))
                put(g + "attn_gate.weight", z.reshape(-1, H))
                put(g + "ssm_ba.weight", sd[la + "in_proj_ba.weight"])
            else:
                qkv, z = sd[la + "in_proj_qkv.weight"], sd[la + "in_proj_z.weight"]
                b, a = sd[la + "in_proj_b.weight"], sd[la + "in_proj_a.weight"]
                if tiled:
                    qkv = np.concatenate([qkv[:2 * Hk * dk], _tile(qkv[2 * Hk * dk:], Hk, r, dv)])
                    z, b, a = _tile(z, Hk, r, dv), _tile(b, Hk, r, 1), _tile(a, Hk, r, 1)
                put(g + "attn_qkv.weight", qkv)
                put(g + "attn_gate.weight", z)
                put(g + "ssm_beta.weight", b)
                put(g + "ssm_alpha.weight", a)
            if tiled:
                conv = np.concatenate([conv[:2 * Hk * dk], _tile(conv[2 * Hk * dk:], Hk, r, dv)])
                A, dt = _tile(A, Hk, r, 1), _tile(dt, Hk, r, 1)
                out = _tile(out.T, Hk, r, dv).T
            put(g + "ssm_conv1d.weight", conv)
            put(g + "ssm_a", -np.exp(A))
            put(g + "ssm_dt.bias", dt)
            put(g + "ssm_norm.weight", sd[la + "norm.weight"])
            put(g + "ssm_out.weight", out)
        else:
            for proj, gn in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
                put(f"{g}{gn}.weight", sd[f"{h}self_attn.{proj}_proj.weight"])
            for n in ("q_norm", "k_norm"):
                put(f"{g}attn_{n}.weight", sd[f"{h}self_attn.{n}.weight"] + 1)
        if h + "mlp.gate.weight" in sd:
            put(g + "ffn_gate_inp.weight", sd[h + "mlp.gate.weight"])
            if h + "mlp.experts.gate_up_proj" in sd:
                gate_up, down = sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.down_proj"]
            else:
                E = cfg.num_experts
                gate_up = np.stack([np.concatenate([sd[f"{h}mlp.experts.{e}.gate_proj.weight"],
                                                    sd[f"{h}mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
                down = np.stack([sd[f"{h}mlp.experts.{e}.down_proj.weight"] for e in range(E)])
            I = gate_up.shape[1] // 2
            put(g + "ffn_gate_exps.weight", gate_up[:, :I])
            put(g + "ffn_up_exps.weight", gate_up[:, I:])
            put(g + "ffn_down_exps.weight", down)
            for proj in ("gate", "up", "down"):
                put(f"{g}ffn_{proj}_shexp.weight", sd[f"{h}mlp.shared_expert.{proj}_proj.weight"])
            put(g + "ffn_gate_inp_shexp.weight", sd[h + "mlp.shared_expert_gate.weight"])
        else:
            for proj in ("gate", "up", "down"):
                put(f"{g}ffn_{proj}.weight", sd[f"{h}mlp.{proj}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_into(model, stored: dict):
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in stored.items():
            sd[k].copy_(torch.as_tensor(v))
    return model
