"""The route (infernix_jax/route.py): one static value naming how a step computes. Its names, its
errors, and that the quantized matmul follows the route current while it traces (the step's)."""
import jax
import jax.numpy as jnp
import pytest

from infernix_jax.choices import ATTN_IMPLS
from infernix_jax.quant.formats import quantize
from infernix_jax.route import REFERENCE, Route, current, use


def test_names_round_trip_and_bad_ones_are_clear():
    for name in ATTN_IMPLS:
        assert Route.named(name).attn_impl == name
    assert Route.named("pallas_interpret", "int8") == Route("pallas", True, "int8")
    assert hash(Route.named("pallas")) == hash(Route("pallas"))          # a static argument of jit
    with pytest.raises(ValueError, match="--attn-impl must be one of"):
        Route.named("triton")
    with pytest.raises(ValueError, match="unknown kernels"):
        Route("cuda")


def test_linear_follows_the_current_route():
    from infernix_jax.models.layers import linear
    w = quantize(jax.random.normal(jax.random.PRNGKey(0), (192, 256)), "int8")        # (a shape the kernel takes)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 256))
    # (a fresh function each time: jit's caches, make_jaxpr's too, key on the function and its
    # arguments, not on the current route: what reads it must take the route as a static argument)
    assert current() is REFERENCE and "pallas_call" not in str(jax.make_jaxpr(lambda x, w: linear(x, w))(x, w))
    with use(Route.named("pallas_interpret")):
        assert current().pallas and "pallas_call" in str(jax.make_jaxpr(lambda x, w: linear(x, w))(x, w))
        inside = linear(x, w)
    assert current() is REFERENCE
    assert float(jnp.max(jnp.abs(inside - linear(x, w)))) < 1e-4
