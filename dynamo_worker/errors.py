"""The node router's gRPC status codes -> Dynamo's exception types (dynamo.llm.exceptions).

Pure: a table of names, resolved against Dynamo in engine.py, so the codes keep their meaning
across the hop: a bad request stays a client error (400), a full or absent node is "try another
worker" (503), a stream the node cut short is a lost connection (which Dynamo may migrate)."""

from __future__ import annotations

# Before the first token: the request never started on this node.
BEFORE_FIRST_TOKEN = {
    "INVALID_ARGUMENT": "InvalidArgument",
    "OUT_OF_RANGE": "InvalidArgument",
    "RESOURCE_EXHAUSTED": "WorkerUnavailable",  # the node's bounded queue is full
    "UNAVAILABLE": "WorkerUnavailable",  # no engine of the node can take it, or the router is down
    "DEADLINE_EXCEEDED": "ConnectionTimeout",
    "CANCELLED": "Cancelled",
    "UNAUTHENTICATED": "CannotConnect",  # the worker's token does not match the router's
    "PERMISSION_DENIED": "CannotConnect",
}
# After tokens were streamed, losing the node is a cut stream, not a refusal.
MID_STREAM = {**BEFORE_FIRST_TOKEN, "UNAVAILABLE": "Disconnected", "RESOURCE_EXHAUSTED": "StreamIncomplete"}


def dynamo_error_name(code_name: str, streamed_tokens: bool) -> str:
    """The name of the dynamo.llm.exceptions class for a gRPC status code name."""
    table = MID_STREAM if streamed_tokens else BEFORE_FIRST_TOKEN
    return table.get(code_name, "Unknown")  # INTERNAL, DATA_LOSS, FAILED_PRECONDITION, UNKNOWN...


def error_message(code_name: str, details: str, node: str) -> str:
    return f"dualpace node {node}: {code_name}: {details}"
