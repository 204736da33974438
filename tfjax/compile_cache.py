"""JAX's persistent compilation cache under the tfjax cache dir, so a second run starts without recompiling.

On by default at `<TFJAX_CACHE or ~/.cache/tfjax>/jax`; `TFJAX_COMPILE_CACHE` names another folder, or
`off` turns it off (the tests do, so they never write into the user's cache). A `jax_compilation_cache_dir`
already set (JAX_COMPILATION_CACHE_DIR) is left alone. Read once at start, never while tracing.
"""

from __future__ import annotations

import os
from pathlib import Path

OFF = {"0", "off", "false", "no", ""}


def folder() -> Path | None:
    """Where compiled programs are kept, or None when the cache is off."""
    from tfjax.packaged import cache_root

    value = os.environ.get("TFJAX_COMPILE_CACHE")
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value)
    return cache_root() / "jax"


def enable() -> Path | None:
    """Point JAX's persistent cache at `folder()` (every program, however quick to compile); the folder or None."""
    import jax

    if jax.config.jax_compilation_cache_dir:  # the user's own choice wins
        return Path(jax.config.jax_compilation_cache_dir)
    where = folder()
    if where is None:
        return None
    where.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where
