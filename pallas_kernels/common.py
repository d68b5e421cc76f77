"""Helpers every Pallas kernel here shares."""
from __future__ import annotations


def triton_params(num_warps: int, num_stages: int):
    """The Triton lowering's compiler parameters (None where this jax has no such module: the
    kernel then runs with Pallas' defaults)."""
    try:
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):  # older/newer module layouts
        return None
