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

MAX_BYTES = 4 << 30          # least recently used entries go past this


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
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
