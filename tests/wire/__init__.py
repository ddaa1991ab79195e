"""Tests of the gRPC contracts and the protobuf <-> core conversions."""
