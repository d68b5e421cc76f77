"""One process of test_multihost.py's prefix-cache run: `python multihost_cache.py RANK PORT DIR PHASE`.

Two such processes (two CPU devices each) serve a tiny random hybrid over a mesh of all four devices
with every tier of the prefix cache on: a small device pool, the RAM tier, the SSD tier, state
snapshots and a cache file. Rank 0 schedules and writes what it got to DIR/PHASE.json; rank 1
replays its device calls. Phase "first" pushes a shared prefix off the device (its blocks to the RAM
tier, its snapshot to the SSD) and resumes it; phase "again" starts from the cache file alone."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]          # this checkout's package, then the tests' helpers

from infernix_jax import distributed  # noqa: E402


def prompts():
    import numpy as np
    rng = np.random.default_rng(3)
    system = list(map(int, rng.integers(10, 49000, 64)))
    return [system + list(map(int, rng.integers(10, 49000, 6))) for _ in range(2)], \
        [list(map(int, rng.integers(10, 49000, 100))) for _ in range(3)]


def model_():
    """A tiny random Qwen3.5 with a KV head per device: its blocks split over both processes."""
    from infernix_jax.loader import load_model
    from test_engine_hybrid import tiny_hybrid
    tokenizer = load_model("smollm2-135m-instruct").tokenizer           # (fetched by the test's fixture)
    return tiny_hybrid("qwen3_5", tokenizer, 49152, num_key_value_heads=4)


def engine_settings(model, directory: str) -> dict:
    from infernix_jax.cache.host_tier import GiB
    from infernix_jax.models.kv_pool import kv_bytes_per_block
    per_block = kv_bytes_per_block(model.cfg, model.dtype, "", 16) // 4          # one device's share (a KV head)
    return dict(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128, decode_steps=2,
                kv_cache_gib=10 * per_block / GiB, prefix_cache_ram_gib=0.01, state_snapshots=2,
                # (a fixed RAM tier: with auto resize, a machine loaded below its 2 GiB reserve shrinks
                # the tier and the prefix comes from the SSD instead; one CI run saw no RAM hit here)
                ram_resize="off",
                ssd_context_gib=0.01, ssd_context_dir=os.path.join(directory, "ssd"),
                prefix_cache_file=os.path.join(directory, "cache.npz"))


def main(rank: int, port: int, directory: str, phase: str) -> int:
    distributed.initialize(f"127.0.0.1:{port}", 2, rank)
    from infernix_jax.cache.block_manager import chain_key
    from infernix_jax.engine import Engine, Request, SamplingParams
    from infernix_jax.sharding import Parallel
    model = model_()
    eng = Engine(model, parallel=Parallel(4), **engine_settings(model, directory))
    if rank != 0:
        assert eng.cache.host is None and eng.cache.ssd is None      # the leader's tiers only
        eng.follow()
        eng.close()
        return 0
    shared, unrelated = prompts()
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = {"loaded": len(eng.cache.host)}
    try:
        if phase == "first":
            out["first"] = eng.generate([Request(shared[0], p)])[0].token_ids
            for q in unrelated:          # push the shared prefix off the device, its snapshot onto the SSD
                eng.generate([Request(q, SamplingParams(max_tokens=2))])
            out["evicted"] = not any(m.tokens == tuple(shared[0][:16]) for m in eng.bm.meta.values())
            key = eng.bm.root                                   # the shared prefix's key (4 blocks)
            for j in range(4):
                key = chain_key(key, shared[0][16 * j:16 * (j + 1)])
            eng.cache.ssd.flush()
            out["snapshot_on_ssd"] = eng.snapshots.get(key) is None and eng.cache.ssd.has_snapshot(key)
        r = eng.generate([Request(shared[1], p)])[0]
        out.update(second=r.token_ids, cached=r.cached_tokens, stats=eng.cache.stats)
    finally:
        eng.close()                      # saves the cache file (the follower replays the block reads), releases it
    with open(os.path.join(directory, phase + ".json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]))
