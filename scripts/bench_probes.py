"""Device probes the benchmarks share: a median timer that warms the GPU's clocks first, and the
device's own ceilings measured in the run (copy/read bandwidth for the HBM roofline, bf16 matmul
throughput for prefill's)."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

GiB = 1 << 30


def timed(fn, reps: int, warm_s: float = 0.3) -> float:
    """Median seconds per call. Calls fn for warm_s first: an idle GPU runs its clocks low for the
    first few milliseconds, and the first call compiles. fn must block on its result."""
    t_end = time.perf_counter() + warm_s
    fn()
    while time.perf_counter() < t_end:
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def probe_bytes(cap: int = 2 * GiB, floor: int = 256 << 20) -> int:
    """How big the bandwidth probe's array can be: cap, or a quarter of what the device has free
    (a model that fills most of the card leaves little: qwen3.5-27b's weights on an 80 GB H100 ran
    the probe's 2 GiB array and its 2 GiB copy out of memory), never below floor (still far larger
    than any L2)."""
    stats = jax.devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return cap if free <= 0 else max(floor, min(cap, free // 4))


def copy_bandwidth() -> float:
    """HBM bandwidth measured here, counting bytes read plus bytes written: the better of a copy and a
    read (a sum) of up to 2 GiB (probe_bytes), far larger than the L2. Decode steps mostly read, so
    the roofline uses whichever the device does fastest."""
    n = probe_bytes() // 2
    # never zeros; made in one fused op (eager, the uint32 indices alone were twice the array)
    x = jax.jit(lambda: (jnp.arange(n, dtype=jnp.uint32) % 251).astype(jnp.bfloat16) - 125)()
    copy = jax.jit(lambda a: a * 2)
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    bw_copy = 2 * x.nbytes / timed(lambda: copy(x).block_until_ready(), 20)
    bw_read = x.nbytes / timed(lambda: read(x).block_until_ready(), 20)
    return max(bw_copy, bw_read)


def matmul_flops() -> float:
    """bf16 matmul throughput measured here (an 8192^3 product): the compute roofline of prefill."""
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    return 2 * 8192 ** 3 / timed(lambda: mm(a).block_until_ready(), 10)
