"""The persistent compilation cache's own size bound (compile_cache.prune): JAX's rescans the
directory on every write, so ours runs once per start."""
import os

import jax

from infernix_jax import compile_cache


def _entry(d, name: str, size: int, t: float):
    p = d / f"{name}-cache"
    p.write_bytes(os.urandom(size))
    os.utime(p, (t, t))
    return p


def test_prune_deletes_the_least_recently_used_entries_past_the_bound(tmp_path):
    old = [_entry(tmp_path, f"old{i}", 1000, 1_000_000 + i) for i in range(4)]
    new = [_entry(tmp_path, f"new{i}", 1000, 2_000_000 + i) for i in range(4)]
    (tmp_path / "new0-atime").write_bytes(b"12345678")          # JAX's stamps: dropped
    (tmp_path / "shapes-abc.json").write_text("{}")               # not an entry: kept
    assert compile_cache.prune(tmp_path, max_bytes=10_000) == 0   # under the bound: nothing goes
    assert all(p.exists() for p in old + new)
    assert not (tmp_path / "new0-atime").exists()
    # 8000 bytes over a 6000-byte bound: down to 0.75 x 6000 = 4500, oldest first
    assert compile_cache.prune(tmp_path, max_bytes=6000) == 4
    assert not any(p.exists() for p in old) and all(p.exists() for p in new)
    assert (tmp_path / "shapes-abc.json").exists()


def test_enable_leaves_jax_without_its_per_write_size_scan(tmp_path, monkeypatch):
    set_ = {}
    monkeypatch.setattr(jax.config, "update", lambda name, value: set_.__setitem__(name, value))
    (tmp_path / "xla").mkdir()
    _entry(tmp_path / "xla", "e", 10, 1e6)                        # under the bound: kept
    assert compile_cache.enable(str(tmp_path / "xla")) == tmp_path / "xla"
    assert set_ == {"jax_compilation_cache_dir": str(tmp_path / "xla"),
                    "jax_persistent_cache_min_compile_time_secs": 0.0, "jax_compilation_cache_max_size": -1}
    assert (tmp_path / "xla" / "e-cache").exists()
    set_.clear()
    assert compile_cache.enable("off") is None and set_ == {}
