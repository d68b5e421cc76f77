"""Model configuration: one frozen, hashable dataclass per model, built from an HF config.json or
from GGUF metadata. Being hashable, it is passed to jitted functions as a static argument."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# HF model_type / GGUF general.architecture -> our family name.
HF_FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",              # the VLM wrapper: its text_config is used
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")   # Gated DeltaNet + gated attention
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                 "qwen3next": "qwen3_next", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
SUPPORTED_HF = sorted(HF_FAMILIES)
SUPPORTED_GGUF = sorted(GGUF_FAMILIES)
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


class ConfigError(ValueError):
    """A model description we cannot run; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str                 # llama | qwen2 | qwen3 | qwen3_moe
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    qkv_bias: bool = False      # Qwen2; Llama with attention_bias
    o_bias: bool = False        # Llama with attention_bias (o_proj has a bias too there)
    qk_norm: bool = False       # Qwen3 / Qwen3-MoE: per-head RMSNorm on q and k before RoPE
    # MoE (Qwen3-MoE); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Hybrids (Qwen3-Next, Qwen3.5): layer_types[i] is "linear_attention" (Gated DeltaNet) or
    # "full_attention" (gated attention with partial RoPE); () means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False      # q_proj also yields a per-head sigmoid gate on the output
    norm_plus_one: bool = False         # zero-centred RMSNorm: y = norm(x) * (1 + w)
    shared_expert_intermediate_size: int = 0
    lin_conv_kernel: int = 0            # Gated DeltaNet: causal depthwise conv width K
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    lin_grouped_proj: bool = False      # Qwen3-Next: in_proj_qkvz / in_proj_ba grouped per key head
    mtp_layers: int = 0                 # multi-token-prediction layers in the checkpoint (mtp.*)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
            if unknown:
                raise ConfigError(f"unknown layer types {sorted(unknown)}; expected linear_attention / full_attention")
            if not self.lin_k_heads or self.lin_v_heads % self.lin_k_heads:
                raise ConfigError(f"linear_num_value_heads {self.lin_v_heads} must be a multiple of "
                                  f"linear_num_key_heads {self.lin_k_heads}")

    def is_linear_layer(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        # transformers' Qwen3MoeDecoderLayer rule.
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    # ---- builders -------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if isinstance(d.get("text_config"), dict) and d.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
            eos = d.get("eos_token_id")
            d = {**d["text_config"], "tie_word_embeddings": d.get("tie_word_embeddings",
                                                                  d["text_config"].get("tie_word_embeddings", False))}
            d.setdefault("eos_token_id", eos)
        mt = d.get("model_type")
        if mt not in HF_FAMILIES:
            raise ConfigError(f"unsupported architecture {mt!r}; supported model_type values: "
                              f"{', '.join(SUPPORTED_HF)}")
        fam = HF_FAMILIES[mt]
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        rope = d.get("rope_parameters") or {}
        hybrid = fam in HYBRID_FAMILIES
        if hybrid and rope.get("mrope_section") and not rope.get("mrope_interleaved", True):
            raise ConfigError("non-interleaved M-RoPE is not supported")   # text-only: interleaved = 1-D RoPE
        if rope.get("rope_type", "default") not in ("default", None):
            raise ConfigError(f"rope_type {rope.get('rope_type')!r} is not supported yet (only 'default')")
        scaling = d.get("rope_scaling") or {}
        if (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
            raise ConfigError(f"rope_scaling {scaling} is not supported yet (only default RoPE)")
        if d.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        moe = fam in ("qwen3_moe", "qwen3_next", "qwen3_5_moe")
        if hybrid:
            every = d.get("full_attention_interval", 4)
            types = tuple(d.get("layer_types") or ("full_attention" if (i + 1) % every == 0 else "linear_attention"
                                                    for i in range(d["num_hidden_layers"])))
        return cls(
            family=fam,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d.get("intermediate_size", 0),
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=d.get("hidden_act", "silu"),
            qkv_bias=fam == "qwen2" or (fam == "llama" and bool(d.get("attention_bias", False))),
            o_bias=fam == "llama" and bool(d.get("attention_bias", False)),
            qk_norm=fam in ("qwen3", "qwen3_moe") or hybrid,
            num_experts=(d.get("num_experts") or d.get("num_local_experts") or 0) if moe else 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=d.get("moe_intermediate_size", 0) if moe else 0,
            # Qwen3.5-MoE's router always renormalises its top-k
            norm_topk_prob=(fam == "qwen3_5_moe" or bool(d.get("norm_topk_prob", False))) if moe else False,
            decoder_sparse_step=d.get("decoder_sparse_step", 1) if moe else 1,
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()) if moe else (),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **(dict(layer_types=types, attn_output_gate=bool(d.get("attn_output_gate", True)), norm_plus_one=True,
                    partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
                    shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0) if moe else 0,
                    lin_conv_kernel=d["linear_conv_kernel_dim"], lin_k_heads=d["linear_num_key_heads"],
                    lin_v_heads=d["linear_num_value_heads"], lin_k_dim=d["linear_key_head_dim"],
                    lin_v_dim=d["linear_value_head_dim"], lin_grouped_proj=fam == "qwen3_next",
                    mtp_layers=int(d.get("num_nextn_predict_layers") or d.get("mtp_num_hidden_layers") or 0))
               if hybrid else {}),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} has no config.json; point --model at a Hugging Face model "
                              f"directory, a .gguf file or an alias") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON ({e}); re-download the model") from None
        return cls.from_hf_dict(d)

    @classmethod
    def from_gguf_fields(cls, kv: dict[str, Any], tensor_names: set[str],
                         embed_rows: int) -> "ModelConfig":
        """kv: GGUF metadata as plain Python values (see weights.gguf_loader.read_metadata)."""
        arch = kv.get("general.architecture")
        if arch not in GGUF_FAMILIES:
            raise ConfigError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF)}")
        fam = GGUF_FAMILIES[arch]

        def g(key, default=None):
            return kv.get(f"{arch}.{key}", default)

        def need(key):
            if g(key) is None:
                raise ConfigError(f"GGUF key {arch}.{key} is missing: the file is not a complete {arch} model")
            return g(key)

        heads = int(g("attention.head_count"))
        kv_heads = g("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer list in some files; ours are uniform
            kv_heads = kv_heads[0]
        hidden = int(g("embedding_length"))
        head_dim = int(g("attention.key_length", hidden // heads))
        moe = fam in ("qwen3_moe", "qwen3_next", "qwen3_5_moe")
        eos = kv.get("tokenizer.ggml.eos_token_id")
        eot = kv.get("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(t for t in (eos, eot) if t is not None))
        # Qwen3.5 files may append their MTP layers as extra blocks (read as nextn; not loaded yet)
        n_layers = int(g("block_count")) - int(g("nextn_predict_layers", 0) or 0)
        hybrid = {}
        if fam in HYBRID_FAMILIES:
            every, hv = int(g("full_attention_interval", 4)), int(need("ssm.time_step_rank"))
            hybrid = dict(
                layer_types=tuple("full_attention" if (i + 1) % every == 0 else "linear_attention"
                                  for i in range(n_layers)),
                attn_output_gate=True, norm_plus_one=True,
                partial_rotary_factor=int(g("rope.dimension_count", head_dim // 4)) / head_dim,
                shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length", 0)) if moe else 0,
                lin_conv_kernel=int(need("ssm.conv_kernel")), lin_k_heads=int(need("ssm.group_count")), lin_v_heads=hv,
                lin_k_dim=int(need("ssm.state_size")), lin_v_dim=int(need("ssm.inner_size")) // hv,
                lin_grouped_proj=fam == "qwen3_next")
        return cls(
            family=fam,
            vocab_size=int(g("vocab_size", embed_rows)),
            hidden_size=hidden,
            intermediate_size=int(g("feed_forward_length", 0)),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(g("rope.freq_base", 10000.0)),
            max_position_embeddings=int(g("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm=bool(hybrid) or "blk.0.attn_q_norm.weight" in tensor_names,
            num_experts=int(g("expert_count", 0)) if moe else 0,
            num_experts_per_tok=int(g("expert_used_count", 0)) if moe else 0,
            moe_intermediate_size=int(g("expert_feed_forward_length", 0)) if moe else 0,
            # llama.cpp normalises the top-k weights of qwen3moe unless the file says otherwise.
            norm_topk_prob=bool(g("expert_weights_norm", True)) if moe else False,
            bos_token_id=kv.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            **hybrid,
        )



def _preset(**kw) -> ModelConfig:
    return ModelConfig(**{"rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
                          "vocab_size": 151936, **kw})


def _hybrid_preset(**kw) -> ModelConfig:
    n = kw["num_layers"]
    return _preset(**{"vocab_size": 248320, "head_dim": 256, "rope_theta": 1e7, "max_position_embeddings": 262144,
                      "partial_rotary_factor": 0.25, "attn_output_gate": True, "norm_plus_one": True, "qk_norm": True,
                      "layer_types": tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                           for i in range(n)),
                      "lin_conv_kernel": 4, "lin_k_heads": 16, "lin_k_dim": 128, "lin_v_dim": 128, **kw})


# Real architectures by name, for benchmarks at real shapes with random weights.
PRESETS = {
    "smollm2-135m": ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "qwen3-0.6b": _preset(family="qwen3", hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                          num_kv_heads=8, head_dim=128, tie_word_embeddings=True, qk_norm=True),
    "qwen3-8b": _preset(family="qwen3", hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                        num_kv_heads=8, head_dim=128, qk_norm=True),
    "qwen3-30b-a3b": _preset(family="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_layers=48,
                             num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True, num_experts=128,
                             num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # hybrids: three Gated DeltaNet layers, then one gated-attention layer (MODELS.md sections 4-5)
    "qwen3.5-27b": _hybrid_preset(family="qwen3_5", hidden_size=5120, intermediate_size=17408, num_layers=64,
                                  num_heads=24, num_kv_heads=4, lin_v_heads=48),
    "qwen3.5-35b-a3b": _hybrid_preset(family="qwen3_5_moe", hidden_size=2048, intermediate_size=512, num_layers=40,
                                      num_heads=16, num_kv_heads=2, lin_v_heads=32, num_experts=256,
                                      num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True,
                                      shared_expert_intermediate_size=512),
}
