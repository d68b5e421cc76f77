"""A route: how a jitted step computes, as one value. Which kernels run (the Pallas ones or their
pure-jnp references, and Pallas in interpret mode for CPU tests), the KV pool's format, and the
switches the coming routes add (batch-invariant arithmetic, fast paths left out). A Route is frozen
and hashable: the steps take it as one static argument, so each route is its own compiled code.

Below the step the route is passed down explicitly (models/paged.py -> the decoders, the paged
attention, the MoE and Gated DeltaNet layers), except to `models.layers.linear`, which a dozen
places call: the step makes its route current while it traces (`use`), as sharding.use does the
mesh, and linear reads it (`current`). Outside a step (the contiguous forward, tests) the current
route is the reference one. jit's caches do not see the current route: a jitted function that
reaches linear takes the route as a static argument and `use`s it, as the steps do."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from .choices import ATTN_IMPLS          # --attn-impl's names of the kernel choice


@dataclasses.dataclass(frozen=True)
class Route:
    kernels: str = "reference"    # "pallas": the Pallas kernels where they take the shape; "reference": jnp
    interpret: bool = False       # the Pallas kernels in interpret mode (runs on the CPU: tests)
    kv_dtype: str = ""            # the KV pool's format (--kv-dtype; "": the model dtype)

    def __post_init__(self):
        if self.kernels not in ("reference", "pallas"):
            raise ValueError(f"unknown kernels {self.kernels!r}: reference or pallas")

    @classmethod
    def named(cls, attn_impl: str = "reference", kv_dtype: str = "") -> "Route":
        """The route of an --attn-impl name (ATTN_IMPLS) and a KV format."""
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"--attn-impl must be one of {', '.join(ATTN_IMPLS)} (got {attn_impl!r})")
        return cls("reference" if attn_impl == "reference" else "pallas", attn_impl == "pallas_interpret",
                   kv_dtype or "")

    @property
    def pallas(self) -> bool:
        return self.kernels == "pallas"

    @property
    def attn_impl(self) -> str:
        """Its --attn-impl name."""
        return "pallas_interpret" if self.interpret and self.pallas else self.kernels


REFERENCE = Route()
_current: contextvars.ContextVar[Route] = contextvars.ContextVar("infernix_route", default=REFERENCE)


@contextlib.contextmanager
def use(route: Route):
    """Make `route` current while a step traces (see the module doc)."""
    token = _current.set(route)
    try:
        yield route
    finally:
        _current.reset(token)


def current() -> Route:
    return _current.get()


__all__ = ["ATTN_IMPLS", "REFERENCE", "Route", "current", "use"]
