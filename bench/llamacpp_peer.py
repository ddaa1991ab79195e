"""llama.cpp as a peer in the same run: its `llama-batched-bench` on the same GGUF and threads.

Built once from the registry's llama-cpp-python source distribution (its vendored llama.cpp),
only the batched-bench target, Release, -DGGML_NATIVE=ON (llama.cpp picks its own kernels for
this CPU), static, no network features; cached under `$XDG_CACHE_HOME/dualpace/llamacpp/`
(default ~/.cache), outside the repository. The build takes ~15 minutes on 2 cores; it runs
niced. Needs pip, cmake, ninja and a C++ compiler.

    python -m bench.llamacpp_peer --build     # fetch + build (idempotent), print the binary path

Its `llama-quantize` (same source, same build folder, a few minutes more) makes the K-quant files
the `gguf` package cannot (it has no Q4_K/Q6_K quantizer): from an F32 GGUF
(`dualpace model export --gguf f32 --out F32.gguf`),

    python -m bench.llamacpp_peer --quantize F32.gguf OUT.gguf Q4_K_M

A decode point (batch B, context C): `-npp C -ntg T -npl B -pps`: one shared C-token prompt,
then T decode steps of B sequences, each attending over its own C + t tokens (as our rows,
which fill the KV with C random tokens per sequence). S_TG = B T / (decode time). Prefill:
`-npp P -ntg 1 -npl 1`, S_PP = P / (prompt time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
BINARY = "llama-batched-bench"
QUANTIZE_BINARY = "llama-quantize"
PERPLEXITY_BINARY = "llama-perplexity"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dualpace" / "llamacpp"


def binary_path(target: str = BINARY) -> Path:
    return cache_dir() / f"build-{VERSION}" / "bin" / target


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as out:
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])}... failed (exit {result.returncode}); see {log}")


def build(target: str = BINARY) -> Path:
    """The target's binary (batched-bench by default), fetched and built if it is not in the cache."""
    binary = binary_path(target)
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
    if not (build_dir / "build.ninja").exists():
        _configure(source, build_dir, root)
    _run(["nice", "-n", "10", "ninja", "-C", str(build_dir), target], root / f"ninja-{target}.log")
    return binary


def _configure(source: Path, build_dir: Path, root: Path) -> None:
    _run(["nice", "-n", "10", "cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja",
          "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
          "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF"], root / "cmake.log")


def quantize(source_gguf: Path, out_gguf: Path, file_type: str = "Q4_K_M", threads: int = 2) -> str:
    """`llama-quantize SOURCE OUT FILE_TYPE THREADS` (built if needed); its log. Where a row length is
    not a multiple of 256 it stores that tensor in a fallback format (Q4_K -> Q5_0, Q6_K -> Q8_0)
    and says so in the log."""
    if Path(out_gguf).exists():
        raise FileExistsError(f"{out_gguf} exists")
    cmd = [str(build(QUANTIZE_BINARY)), str(source_gguf), str(out_gguf), file_type, str(threads)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama-quantize failed (exit {result.returncode}): {result.stderr[-2000:]}")
    return result.stdout + result.stderr


def peer_flags(cpu_flags: frozenset[str] | None = None) -> list[str]:
    """Extra llama-batched-bench flags for this CPU. On an AMX CPU its repacking of the weights
    into AMX tiles (the extra buffer type) ends the process with SIGSEGV in
    ggml_backend_amx_mul_mat at start-up in this vendored version (seen on a 2-core Intel Xeon
    with AMX, llama.cpp issue #20824), so the peer runs with --no-repack: its AVX-512 VNNI CPU
    kernels, no AMX."""
    from dualpace.model.cpu_kernels_build import cpu_flags as read_flags

    flags = read_flags() if cpu_flags is None else cpu_flags
    return ["--no-repack"] if "amx_int8" in flags else []


def batched_bench(gguf: Path, threads: int, prompt_tokens: int, new_tokens: int, batch: int,
                  timeout_s: float = 1200.0) -> dict:
    """One llama-batched-bench point: its JSON line (speed_pp, speed_tg, t_pp, t_tg, ...)."""
    kv_tokens = batch * (prompt_tokens + new_tokens) + 64  # not unified: each sequence holds a copy of the prompt
    cmd = [str(build()), "-m", str(gguf), "-t", str(threads), "-c", str(kv_tokens), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_tokens), "-ntg", str(new_tokens), "-npl", str(batch), "-pps",
           "--output-format", "jsonl", *peer_flags()]
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


def kl_divergence(base_gguf: Path, gguf: Path, text: Path, window: int, threads: int, folder: Path,
                  timeout_s: float = 3600.0) -> dict:
    """llama-perplexity's KL divergence of `gguf` from `base_gguf` over `text` (chunks of `window`
    tokens, the second half of each scored): {"mean_kl", "top_token_differs", "log"} (built if needed)."""
    binary = str(build(PERPLEXITY_BINARY))
    logits = folder / "base.kld"
    common = ["-f", str(text), "-c", str(window), "-t", str(threads), "--kl-divergence-base", str(logits), *peer_flags()]
    for cmd in ([binary, "-m", str(base_gguf), *common], [binary, "-m", str(gguf), *common, "--kl-divergence"]):
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"llama-perplexity failed (exit {result.returncode}): {result.stderr[-2000:]}")
    out = result.stdout + result.stderr
    mean = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", out)
    same = re.search(r"Same top p:\s+([0-9.]+)", out)
    if mean is None or same is None:
        raise RuntimeError(f"llama-perplexity printed no KL divergence: {out[-2000:]}")
    return {"mean_kl": float(mean.group(1)), "top_token_differs": 1 - float(same.group(1)) / 100}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="store_true", help="fetch and build if needed, print the binary")
    parser.add_argument("--quantize", nargs=3, metavar=("SOURCE_GGUF", "OUT_GGUF", "FILE_TYPE"),
                        help="llama-quantize SOURCE_GGUF (F32/F16) into OUT_GGUF as FILE_TYPE (e.g. Q4_K_M)")
    args = parser.parse_args(argv)
    if args.build:
        print(build())
    if args.quantize:
        source, out, file_type = args.quantize
        if not Path(source).is_file():
            parser.error(f"{source}: no such file")
        if Path(out).exists():
            parser.error(f"{out} exists")
        log = quantize(Path(source), Path(out), file_type)
        print("\n".join(line for line in log.splitlines() if "fallback" in line or "quant size" in line))
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
