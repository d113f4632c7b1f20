"""JAX's persistent compilation cache under the jaxcert cache directory."""

from __future__ import annotations

import os
import pathlib

from jaxcert.base.paths import cache_dir

__all__ = ["enable_compilation_cache"]


def enable_compilation_cache(path: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Turns on JAX's persistent compilation cache, so identical runs do not recompile.

    Compiled XLA executables are stored under ``path`` (default ``<cache>/xla``, see
    ``jaxcert.base.paths.cache_dir``) and reused by any later process with the same program,
    shapes, JAX version and devices; every program is cached (measured: a 0.5 s threshold
    left 2.3 s of compilation in a second certify run, none left 1.8 s). The environment
    variable ``JAXCERT_COMPILE_CACHE`` overrides the default folder (a path), or turns the
    cache off (``0``).

    Returns:
      The cache folder, or ``None`` when turned off by the environment.
    """
    env = os.environ.get("JAXCERT_COMPILE_CACHE", "")
    if env.lower() in ("0", "false", "no", "off"):
        return None
    import jax

    if path is None:
        path = env if env not in ("", "1") else cache_dir() / "xla"
    folder = pathlib.Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder
