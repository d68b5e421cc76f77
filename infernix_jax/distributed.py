"""Several hosts: every process joins through jax.distributed and holds its devices' shards of the
mesh (sharding.py); process 0 (the leader) runs the server and the scheduler; every other process
(a follower) builds the same engine and replays the leader's device calls, so that all of them run
the same jitted steps on the same inputs, as a multi-controller JAX program must.

The leader's calls travel as pickles broadcast over the devices (multihost_utils, a collective
every process joins): a length, then the bytes. The processes of one deployment trust each other.
The prefix cache's tiers live on the leader alone: what it reads off the devices (evicted blocks,
hybrids' state snapshots) is gathered whole on every process and kept by the leader (its RAM tier,
SSD tier and cache file); what it writes back travels to the others inside the call.
Not on several hosts yet (refused with a clear error): --kv-dtype bf16p."""
from __future__ import annotations

import hashlib
import os
import pickle

import jax
import numpy as np

ENV = ("INFERNIX_COORDINATOR", "INFERNIX_NUM_PROCESSES", "INFERNIX_PROCESS_ID")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join a multi-host run from flags or the INFERNIX_* environment (before any device is used).
    Returns whether there are several processes. Nothing given: one process, nothing done."""
    coordinator = coordinator or os.environ.get(ENV[0])
    n = num_processes if num_processes is not None else _int_env(ENV[1])
    pid = process_id if process_id is not None else _int_env(ENV[2])
    if not coordinator and n is None and pid is None:
        return False
    if not coordinator or n is None or pid is None:
        raise ValueError("several hosts need --coordinator HOST:PORT, --num-processes N and --process-id I "
                         f"(or {', '.join(ENV)})")
    if n < 1 or not 0 <= pid < n:
        raise ValueError(f"--process-id must be in [0, {n}) and --num-processes >= 1 (got {pid}, {n})")
    if n == 1:
        return False
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=pid)
    return True


def _int_env(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None


def check_mesh(parallel) -> None:
    """Several hosts run one model over every device of every process: a clear error otherwise (a
    mesh of some processes' devices leaves the others nothing to run)."""
    if several() and (not parallel or parallel.devices != jax.device_count()):
        raise ValueError(f"several hosts: --tensor-parallel x --expert-parallel must cover every device of every "
                         f"process ({jax.device_count()}), got {parallel.devices if parallel else 1}")


def several() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


class Channel:
    """The leader's device calls, in order, to every follower. send/receive are collectives: the
    leader's send pairs with each follower's receive."""

    def __init__(self):
        from jax.experimental import multihost_utils
        self._bcast = multihost_utils.broadcast_one_to_all

    def send(self, msg) -> None:
        data = np.frombuffer(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self._bcast(np.asarray([data.size], np.int64))
        self._bcast(np.pad(data, (0, _bucket(data.size) - data.size)))

    def receive(self):
        n = int(self._bcast(np.zeros((1,), np.int64))[0])
        data = np.asarray(self._bcast(np.zeros((_bucket(n),), np.uint8)))
        return pickle.loads(data[:n].tobytes())

    def agree(self, value, what: str) -> None:
        """Every process built the same `what` (value: a summary whose repr names it): else a clear
        error on every process, before any step could hang on mismatched shapes."""
        from jax.experimental import multihost_utils
        digest = np.frombuffer(hashlib.sha256(repr(value).encode()).digest()[:8], np.int64)
        every = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
        if (every != every[0]).any():
            raise ValueError(f"the processes built different {what}s (process {jax.process_index()}: {value}); start "
                             f"every process with the same options on the same kind of device")


def _bucket(n: int) -> int:
    """Powers of two from 256 bytes: few broadcast shapes, so few compiles."""
    b = 256
    while b < n:
        b *= 2
    return b


__all__ = ["Channel", "check_mesh", "initialize", "is_leader", "several"]
