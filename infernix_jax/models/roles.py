"""What each weight is, declared once by its name in the params tree: the logical axes of its
dimensions (sharding.py maps them onto a mesh), whether `--weights` quantizes it, and which matrix
it joins when the loader fuses projections (fuse.py). params.py declares where each weight comes
from (shape, init, checkpoint names); everything that asks what a weight *is* reads ROLES, and the
tables the others used to keep (sharding's axes, quant.apply's quantizable names, fuse's groups)
are derived from it below. A test checks that every weight any family declares has a role."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Role:
    # the logical axis of each dimension ("vocab", "embed", "heads", "kv_heads", "ffn", "experts");
    # () where the weight is whole on every device
    axes: tuple = ()
    # "matrix": an [out, in] projection models.layers.linear multiplies by; "experts": routed MoE
    # experts [E, out, in]; "": never quantized (embeddings, norms, routers, conv filters)
    quantize: str = ""
    fuse: str = ""           # the fused weight whose rows it becomes, parts in ROLES' order (fuse.py)
    bias: str = ""           # its bias, where it has one (fused with it, or not at all)


def _proj(axes: tuple, fuse: str = "", bias: str = "") -> Role:
    return Role(axes, "matrix", fuse, bias)


_EXPERTS_IN, _EXPERTS_OUT = ("experts", "ffn", "embed"), ("experts", "embed", "ffn")

ROLES: dict[str, Role] = {
    "embed": Role(("vocab", "embed")), "lm_head": Role(("vocab", "embed")),
    # attention (q, k, v fuse into wqkv; their biases into bqkv)
    "wq": _proj(("heads", "embed"), "wqkv", "bq"), "wk": _proj(("kv_heads", "embed"), "wqkv", "bk"),
    "wv": _proj(("kv_heads", "embed"), "wqkv", "bv"), "wo": _proj(("embed", "heads")),
    "bq": Role(("heads",), fuse="bqkv"), "bk": Role(("kv_heads",), fuse="bqkv"), "bv": Role(("kv_heads",), fuse="bqkv"),
    "bo": Role(), "q_norm": Role(), "k_norm": Role(),
    # dense MLP and a MoE layer's shared expert (gate and up fuse)
    "w_gate": _proj(("ffn", "embed"), "w_gate_up"), "w_up": _proj(("ffn", "embed"), "w_gate_up"),
    "w_down": _proj(("embed", "ffn")),
    "s_gate": _proj(("ffn", "embed"), "s_gate_up"), "s_up": _proj(("ffn", "embed"), "s_gate_up"),
    "s_down": _proj(("embed", "ffn")), "s_router": Role(),
    # routed experts
    "router": Role(), "e_gate": Role(_EXPERTS_IN, "experts"), "e_up": Role(_EXPERTS_IN, "experts"),
    "e_down": Role(_EXPERTS_OUT, "experts"),
    # Gated DeltaNet (hybrids): projections whole on every device
    **{n: Role(quantize="matrix") for n in ("lin_qkvz", "lin_ba", "lin_qkv", "lin_z", "lin_b", "lin_a", "lin_out")},
    **{n: Role() for n in ("lin_conv", "lin_A_log", "lin_dt_bias", "lin_norm")},
    # norms; the MTP head's own weights
    **{n: Role() for n in ("attn_norm", "mlp_norm", "final_norm", "norm", "pre_norm_embed", "pre_norm_hidden", "fc")},
}


def _fused() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for name, r in ROLES.items():
        if r.fuse and r.quantize:
            out.setdefault(r.fuse, []).append(name)
    return {k: tuple(v) for k, v in out.items()}


# fused name -> its parts, in row order; fused name -> (fused bias, the parts' biases)
FUSED: dict[str, tuple[str, ...]] = _fused()
BIAS: dict[str, tuple[str, tuple[str, ...]]] = {
    f: (ROLES[ROLES[parts[0]].bias].fuse, tuple(ROLES[p].bias for p in parts))
    for f, parts in FUSED.items() if all(ROLES[p].bias for p in parts)}
# the weights --weights quantizes: projections (fused ones too: a fused model given to quantize_params)
QUANTIZABLE = frozenset({n for n, r in ROLES.items() if r.quantize == "matrix"} | set(FUSED))
EXPERTS = frozenset(n for n, r in ROLES.items() if r.quantize == "experts")
PARAM_AXES = {n: r.axes for n, r in ROLES.items() if r.axes}

__all__ = ["BIAS", "EXPERTS", "FUSED", "PARAM_AXES", "QUANTIZABLE", "ROLES", "Role"]
