"""JAX's persistent compilation cache, on by default under the cache directory: a step shape compiled
once (seconds on the CPU, up to minutes for a big model on a GPU) is read back by the next start in
a fraction of that. `--compile-cache DIR` (or INFERNIX_COMPILE_CACHE) moves it, `off` turns it off.

The cache holds executables that this process will run: keep it where only you can write (JAX's own
warning: whoever writes there can run code as you). It is created 0700."""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("infernix.compile_cache")

MAX_BYTES = 4 << 30          # past this, a start deletes the least recently used entries


def default_dir() -> Path:
    from .hub import home
    return home() / "xla-cache"


def enable(where: str | None = None) -> Path | None:
    """Turn the cache on at `where` (None: INFERNIX_COMPILE_CACHE, else the default directory;
    "off": leave it off). Call before the first compilation. Returns the directory, or None when off
    (also when the directory cannot be made: a warning, and every start compiles)."""
    spec = where if where is not None else os.environ.get("INFERNIX_COMPILE_CACHE") or ""
    if spec == "off":
        return None
    path = Path(spec).expanduser() if spec else default_dir()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        log.warning("compile cache off: cannot create %s (%s)", path, e.strerror or e)
        return None
    import jax
    jax.config.update("jax_compilation_cache_dir", str(path))
    # every step shape, however quick to compile here: a start replays dozens of them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX's own size limit lists and reads every entry of the directory on each write: with ~15,000
    # entries (the test suite's) a compile took 8x as long (0.29 s against 0.04 s). Unlimited there,
    # and bounded here instead, once per start.
    jax.config.update("jax_compilation_cache_max_size", -1)
    prune(path)
    return path


def prune(path: Path, max_bytes: int = MAX_BYTES, keep: float = 0.75) -> int:
    """Past max_bytes, delete the least recently used entries (by access or modification time,
    whichever is later) until keep x max_bytes remain. Returns how many were deleted. Also drops the
    access stamps JAX's own size limit wrote (`*-atime`), which nothing reads any more."""
    entries, total = [], 0
    try:
        for f in os.scandir(path):
            if f.name.endswith("-atime"):
                _unlink(f.path)
            elif f.name.endswith("-cache") and (st := _stat(f)) is not None:
                entries.append((max(st.st_atime, st.st_mtime), st.st_size, f.path))
                total += st.st_size
    except OSError as e:
        log.warning("compile cache: cannot read %s (%s)", path, e.strerror or e)
        return 0
    if total <= max_bytes:
        return 0
    dropped = 0
    for _, size, name in sorted(entries):
        if total <= keep * max_bytes:
            break
        if _unlink(name):
            total -= size
            dropped += 1
    log.info("compile cache: %d least recently used entries deleted (%s holds %.1f GiB)", dropped, path,
             total / (1 << 30))
    return dropped


def _stat(entry: os.DirEntry):
    try:
        return entry.stat() if entry.is_file() else None
    except OSError:           # deleted meanwhile by another process pruning the same cache
        return None


def _unlink(name: str) -> bool:
    try:
        os.unlink(name)
        return True
    except OSError:           # another process deleted it first, or it is not ours to delete
        return False
