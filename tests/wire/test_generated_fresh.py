"""The committed generated code matches the .proto files and imports cleanly."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from dualpace.wire import generate

pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")

COMMITTED_DIR = generate.DEFAULT_OUT_DIR


def test_committed_code_is_fresh(tmp_path: Path) -> None:
    fresh_paths = generate.generate(tmp_path)
    fresh_names = sorted(path.name for path in fresh_paths)
    committed_names = sorted(path.name for path in COMMITTED_DIR.iterdir() if path.is_file())
    assert committed_names == fresh_names, (
        f"dualpace/wire/v1/ holds {committed_names}, protoc produces {fresh_names}: run make proto"
    )
    stale_names = [
        path.name for path in fresh_paths if (COMMITTED_DIR / path.name).read_bytes() != path.read_bytes()
    ]
    assert not stale_names, f"generated code is stale ({', '.join(stale_names)} differ): run make proto"


@pytest.mark.parametrize("name", ["common", "engine", "assist", "router"])
def test_generated_modules_import(name: str) -> None:
    pb2 = importlib.import_module(f"dualpace.wire.v1.{name}_pb2")
    importlib.import_module(f"dualpace.wire.v1.{name}_pb2_grpc")
    assert pb2.DESCRIPTOR.package == "dualpace.v1"
    assert pb2.DESCRIPTOR.name == f"dualpace/v1/{name}.proto"


def test_services_are_defined() -> None:
    from dualpace.wire.v1 import assist_pb2_grpc, engine_pb2, engine_pb2_grpc, router_pb2_grpc

    assert hasattr(engine_pb2_grpc, "EngineStub")
    assert hasattr(assist_pb2_grpc, "DenseAssistStub")
    assert hasattr(router_pb2_grpc, "RouterStub")
    method_names = [method.name for method in engine_pb2.DESCRIPTOR.services_by_name["Engine"].methods]
    assert method_names == [
        "Generate", "Abort", "MigrateOut", "ImportKv", "GetLoad", "WatchLoad", "ListRequests", "Info", "WatchKvEvents",
        "CopyPrefix",
    ]


def test_rewrite_generated_moves_imports_into_the_wire_package() -> None:
    text = (
        "from dualpace.v1 import common_pb2 as dualpace_dot_v1_dot_common__pb2\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'dualpace.v1.engine_pb2', _globals)\n"
        "'/dualpace.v1.Engine/Generate'\n"
    )
    assert generate.rewrite_generated(text) == (
        "from dualpace.wire.v1 import common_pb2 as dualpace_dot_v1_dot_common__pb2\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'dualpace.wire.v1.engine_pb2', _globals)\n"
        "'/dualpace.v1.Engine/Generate'\n"
    )


def test_every_proto_element_has_a_comment() -> None:
    """Each rpc, message, oneof, field, enum and enum value has a // comment above it."""
    proto_paths = sorted((generate.DEFAULT_PROTO_ROOT / generate.PROTO_PACKAGE_DIR).glob("*.proto"))
    assert [path.stem for path in proto_paths] == ["assist", "common", "engine", "router"]
    missing = []
    for path in proto_paths:
        missing += _uncommented_declarations(path.read_text(encoding="utf-8").splitlines(), path.name)
    assert not missing, "declarations without a comment above them:\n" + "\n".join(missing)


def _uncommented_declarations(lines: list[str], file_name: str) -> list[str]:
    """Declarations (rpc, message, enum, field, enum value) not preceded by a // line."""
    missing = []
    for index, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("//") or stripped in ("}", "};"):
            continue
        if stripped.startswith(("syntax", "package", "import")):
            continue
        previous = lines[index - 1].strip() if index > 0 else ""
        if not previous.startswith("//"):
            missing.append(f"{file_name}:{index + 1}: {stripped}")
    return missing
