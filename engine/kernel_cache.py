"""Where compiled GPU kernels persist between runs: Triton's compilation cache and its
autotuning results (flash-linear-attention's kernels and ours are Triton kernels, each
compiled per specialisation on first use and autotuned over several configurations).

`kernel_cache_dir(option)` picks the directory: `--kernel-cache DIR` when given, else
`$TRITON_CACHE_DIR` when set, else `<user cache dir>/hypercache/triton` (`$XDG_CACHE_HOME`
or `~/.cache`). `use_kernel_cache(dir)` points this process (and its children) at it
through Triton's own environment settings, before the first kernel module is imported:
`TRITON_CACHE_DIR` (compiled binaries, and the autotuning results fla writes beside them:
its autotuners cache results unless `FLA_CACHE_RESULTS=0`) and
`TRITON_CACHE_AUTOTUNING=1` (the same for every other autotuned kernel; an explicit
value in the environment is kept). A second start then skips compilation and the timing
runs; a directory copied to a fresh machine with the same GPU, driver, Triton and fla
versions starts warm. (Triton's own default, `~/.triton/cache`, persists too; this gives
the cache one known place that can be shipped and measured.)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from engine.errors import ConfigError

CACHE_ENV = "TRITON_CACHE_DIR"
AUTOTUNE_ENV = "TRITON_CACHE_AUTOTUNING"


def default_kernel_cache_dir() -> Path:
    """`<user cache dir>/hypercache/triton`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hypercache" / "triton"


def kernel_cache_dir(option: Optional[str] = None) -> Path:
    """The kernel cache directory: `option`, else $TRITON_CACHE_DIR, else the default."""
    if option is not None:
        if not option.strip():
            raise ConfigError("--kernel-cache: must name a directory")
        return Path(option).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else default_kernel_cache_dir()


def use_kernel_cache(directory: Path) -> Path:
    """Create `directory` and make it this process's Triton cache (inherited by child
    processes); returns it resolved. Raises ConfigError when it cannot be created or
    written."""
    directory = directory.resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"kernel cache directory {directory}: cannot create it ({exc.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise ConfigError(f"kernel cache directory {directory}: not writable")
    os.environ[CACHE_ENV] = str(directory)
    os.environ.setdefault(AUTOTUNE_ENV, "1")
    return directory
