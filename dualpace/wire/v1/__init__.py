"""Generated protobuf and gRPC code for dualpace.v1 (do not edit).

Produced from proto/dualpace/v1/*.proto by `python -m dualpace.wire.generate`
(`make proto`). Convert to and from core types with dualpace.wire (common and one module per service).
"""
