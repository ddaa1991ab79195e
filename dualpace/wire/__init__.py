"""The wire layer: generated gRPC code (v1/) and protobuf <-> core conversion (common.py, tensors.py, one module per service).

The .proto files under proto/dualpace/v1/ are the source of truth; the code in
v1/ is generated from them by `python -m dualpace.wire.generate` (make proto)
and committed. Nothing outside this package should build core types from
protobuf messages by hand: use dualpace.wire.common and the per-service modules.
"""
