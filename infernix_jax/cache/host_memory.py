"""Device <-> host copies that stay JAX arrays, in the host's pinned memory where the backend has
it (CUDA, TPU, and the CPU backend, where it is ordinary memory): both directions are then DMA
at the link's full speed, and both are asynchronous: `to_host` and `to_device` return at once and
the copy overlaps the device's work; only reading the array's values (numpy) waits for it.

The prefix cache keeps evicted KV blocks and hybrid state snapshots this way (through the runner:
cache/device.py), so neither moving
them out nor bringing them back stalls the thread that drives the device."""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding


@functools.cache
def host_sharding(device) -> SingleDeviceSharding | None:
    """Pinned host memory of `device` (else unpinned host memory); None when it has neither."""
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return SingleDeviceSharding(device, memory_kind=kind)
    return None


def to_host(x):
    """Start copying a device array (or a pytree of them) to host memory; returns at once. An array
    split over several devices (sharding.py) is gathered into numpy instead (waits); one over
    several processes must be replicated (device.whole), and this process's copy is taken."""
    def one(a):
        if not a.is_fully_addressable:
            a = a.addressable_data(0)
        s = host_sharding(next(iter(a.devices()))) if len(a.devices()) == 1 else None
        if s is None:                     # a backend without host memory kinds: numpy (waits)
            return np.asarray(a)
        return jax.device_put(a, s)
    return jax.tree.map(one, x)


def put_host(x, device=None):
    """numpy arrays (a pytree) into `device`'s (default: the first device's) host memory."""
    s = host_sharding(device or jax.devices()[0])
    return x if s is None else jax.device_put(x, s)


def to_device(x, like):
    """Start copying host arrays (pinned JAX arrays or numpy) to the device memory of the devices
    that array `like` is on (several: a copy on each, for a step on the mesh to take; several
    processes: every process passes the same values, and each fills its own devices)."""
    devs = like.sharding.device_set
    if len(devs) == 1:
        return jax.device_put(x, SingleDeviceSharding(next(iter(devs))))
    s = NamedSharding(like.sharding.mesh, PartitionSpec())
    if like.is_fully_addressable:
        return jax.device_put(x, s)

    def one(a):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, s, lambda index: a[index])
    return jax.tree.map(one, x)
