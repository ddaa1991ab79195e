"""Regenerate the protobuf and gRPC Python code in dualpace/wire/v1/.

Usage (from the repository root; `make proto` runs this):

    python -m dualpace.wire.generate            # rewrite dualpace/wire/v1/
    python -m dualpace.wire.generate --out DIR  # write the package into DIR

The .proto files under proto/dualpace/v1/ are the source of truth. protoc
(from the pinned grpcio-tools) writes modules that import each other as
`dualpace.v1.*`; this script moves them into the `dualpace.wire.v1` package
and rewrites those imports, so the generated code is committed and importable
without protoc. tests/wire/test_generated_fresh.py checks that the committed
files are exactly what this script produces.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_PACKAGE_DIR = Path("dualpace") / "v1"
"""Where the .proto files sit below the proto root (their import prefix)."""

GENERATED_PACKAGE = "dualpace.wire.v1"
"""The Python package the generated modules live in."""

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROTO_ROOT = REPO_ROOT / "proto"
DEFAULT_OUT_DIR = REPO_ROOT / "dualpace" / "wire" / "v1"

INIT_TEXT = '''"""Generated protobuf and gRPC code for dualpace.v1 (do not edit).

Produced from proto/dualpace/v1/*.proto by `python -m dualpace.wire.generate`
(`make proto`). Convert to and from core types with dualpace.wire (common and one module per service).
"""
'''

_IMPORT_PATTERN = re.compile(r"^from dualpace\.v1 import ", re.MULTILINE)
_MODULE_NAME_PATTERN = re.compile(r"'dualpace\.v1\.(\w+_pb2)'")


def rewrite_generated(text: str) -> str:
    """Point protoc's `dualpace.v1` module references at the wire package."""
    text = _IMPORT_PATTERN.sub(f"from {GENERATED_PACKAGE} import ", text)
    return _MODULE_NAME_PATTERN.sub(rf"'{GENERATED_PACKAGE}.\1'", text)


def _run_protoc(proto_root: Path, raw_out_dir: Path) -> None:
    """Run the bundled protoc with the python, pyi and grpc plugins."""
    from grpc_tools import protoc  # dev dependency; imported only when generating

    proto_files = sorted((proto_root / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not proto_files:
        raise SystemExit(f"no .proto files under {proto_root / PROTO_PACKAGE_DIR}")
    relative_names = [str(path.relative_to(proto_root)) for path in proto_files]
    args = [
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--python_out={raw_out_dir}",
        f"--pyi_out={raw_out_dir}",
        f"--grpc_python_out={raw_out_dir}",
        *relative_names,
    ]
    exit_code = protoc.main(args)
    if exit_code != 0:
        raise SystemExit(f"protoc failed with exit code {exit_code}")


def generate(out_dir: Path, proto_root: Path = DEFAULT_PROTO_ROOT) -> list[Path]:
    """Write the generated package into out_dir, replacing its generated files.

    Returns the written paths, sorted. Stale *_pb2*.py/.pyi files in out_dir
    (from a removed .proto) are deleted.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as raw_dir_name:
        raw_out_dir = Path(raw_dir_name)
        _run_protoc(proto_root, raw_out_dir)
        generated_sources = sorted((raw_out_dir / PROTO_PACKAGE_DIR).iterdir())
        contents = {
            path.name: rewrite_generated(path.read_text(encoding="utf-8")) for path in generated_sources
        }
    contents["__init__.py"] = INIT_TEXT
    for stale in out_dir.glob("*_pb2*"):
        if stale.name not in contents:
            stale.unlink()
    written_paths = []
    for name, text in sorted(contents.items()):
        path = out_dir / name
        path.write_bytes(text.encode("utf-8"))
        written_paths.append(path)
    return written_paths


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help="package directory to write")
    parser.add_argument("--proto-root", type=Path, default=DEFAULT_PROTO_ROOT, help="directory holding dualpace/v1/*.proto")
    args = parser.parse_args(argv)
    written_paths = generate(args.out, args.proto_root)
    print(f"wrote {len(written_paths)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
