"""What every native library of the project shares when it is built: the compiler's version (part
of each cache key), the cache folder and an atomic install. Each library keeps its own sources,
flags and cache key (cpu_kernels_build, quant_kernels, dualpace.engine.transfer.kv_copy_native)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


def compiler_version(compiler: str) -> str:
    """`compiler --version`'s text, or "none" where it cannot run."""
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "none"


def kernel_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/dualpace/kernels` (default `~/.cache/dualpace/kernels`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dualpace" / "kernels"


def build_atomically(path: Path, command_for: Callable[[Path], list[str]]) -> None:
    """Run the compile command `command_for(temporary output)` and move its output to `path`, so
    that a reader never sees a partial file. Builders of one path take turns (a lock file beside
    it): one that waited finds the library installed and does not compile it again, as when two
    daemons starting at once (or the tests' background builds and a test) want the same library.
    Raises CalledProcessError / OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, and by the kernel if this process dies
        if path.exists():
            return
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
            tmp_path = Path(tmp.name)
        try:
            subprocess.run(command_for(tmp_path), check=True, capture_output=True, text=True)
            os.replace(tmp_path, path)
        finally:
            tmp_path.unlink(missing_ok=True)
