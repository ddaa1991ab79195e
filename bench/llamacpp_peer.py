"""llama.cpp as a peer in the same run: its `llama-batched-bench` on the same GGUF and threads.

Built once from the registry's llama-cpp-python source distribution (its vendored llama.cpp),
only the batched-bench target, Release, -DGGML_NATIVE=ON (llama.cpp picks its own kernels for
this CPU), static, no network features; cached under `$XDG_CACHE_HOME/dualpace/llamacpp/`
(default ~/.cache), outside the repository. The build takes ~15 minutes on 2 cores; it runs
niced. Needs pip, cmake, ninja and a C++ compiler.

    python -m bench.llamacpp_peer --build     # fetch + build (idempotent), print the binary path

A decode point (batch B, context C): `-npp C -ntg T -npl B -pps`: one shared C-token prompt,
then T decode steps of B sequences, each attending over its own C + t tokens (as our rows,
which fill the KV with C random tokens per sequence). S_TG = B T / (decode time). Prefill:
`-npp P -ntg 1 -npl 1`, S_PP = P / (prompt time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
BINARY = "llama-batched-bench"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dualpace" / "llamacpp"


def binary_path() -> Path:
    return cache_dir() / f"build-{VERSION}" / "bin" / BINARY


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as out:
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])}... failed (exit {result.returncode}); see {log}")


def build() -> Path:
    """The batched-bench binary, fetched and built if it is not in the cache."""
    binary = binary_path()
    if binary.exists():
        return binary
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    source = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not source.is_dir():
        sdist = root / "src" / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.exists():
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                  f"llama-cpp-python=={VERSION}", "-d", str(sdist.parent)], root / "download.log")
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    build_dir = binary.parent.parent
    _run(["nice", "-n", "10", "cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja",
          "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
          "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF"], root / "cmake.log")
    _run(["nice", "-n", "10", "ninja", "-C", str(build_dir), BINARY], root / "ninja.log")
    return binary


def batched_bench(gguf: Path, threads: int, prompt_tokens: int, new_tokens: int, batch: int,
                  timeout_s: float = 1200.0) -> dict:
    """One llama-batched-bench point: its JSON line (speed_pp, speed_tg, t_pp, t_tg, ...)."""
    kv_tokens = batch * (prompt_tokens + new_tokens) + 64  # not unified: each sequence holds a copy of the prompt
    cmd = [str(build()), "-m", str(gguf), "-t", str(threads), "-c", str(kv_tokens), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_tokens), "-ntg", str(new_tokens), "-npl", str(batch), "-pps",
           "--output-format", "jsonl"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed (exit {result.returncode}): {result.stderr[-2000:]}")
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{") and '"pl"' in line]
    if not rows:
        raise RuntimeError(f"llama-batched-bench printed no result: {result.stdout[-2000:]}")
    return rows[-1]


def decode_tokens_per_s(gguf: Path, threads: int, batch: int, context: int, new_tokens: int) -> float:
    return batched_bench(gguf, threads, context, new_tokens, batch)["speed_tg"]


def prefill_tokens_per_s(gguf: Path, threads: int, prompt_tokens: int) -> float:
    return batched_bench(gguf, threads, prompt_tokens, 1, 1)["speed_pp"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="store_true", help="fetch and build if needed, print the binary")
    args = parser.parse_args(argv)
    if args.build:
        print(build())
    return 0


if __name__ == "__main__":
    sys.exit(main())
