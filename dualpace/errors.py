"""User-facing errors of the shared core.

Each carries a message that names the problem (and the field, where there is
one), so the CLI prints it on one line and the gRPC layer maps it to a status
code without parsing text.
"""


class DualPaceError(Exception):
    """Base class: an error a user can act on; printed without a traceback."""


class InvalidArgument(DualPaceError):
    """A request or command-line value is out of range or malformed."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class ModelLoadError(DualPaceError):
    """A checkpoint is missing, corrupt or of an unsupported architecture."""


class RequestNotFound(DualPaceError):
    """No request with this id is known to the engine (gRPC NOT_FOUND)."""

    def __init__(self, request_id: str):
        super().__init__(f"request_id: no request {request_id!r}")
        self.request_id = request_id


class Overloaded(DualPaceError):
    """The engine's queue is full; retry later or elsewhere (gRPC RESOURCE_EXHAUSTED)."""


class Unavailable(DualPaceError):
    """The engine cannot serve right now: stopping, failed, or a peer is down (gRPC UNAVAILABLE)."""


class DataLoss(DualPaceError):
    """This request's numbers are corrupt (e.g. non-finite logits) and it cannot continue; the
    engine itself is healthy (gRPC DATA_LOSS, which the router does not retry)."""


class PermissionDenied(DualPaceError):
    """The caller may not ask for this, e.g. a KV migration to an engine not named by --peer
    (gRPC PERMISSION_DENIED)."""


class FailedPrecondition(DualPaceError):
    """The engine is not in a state (or configuration) that allows this call (gRPC FAILED_PRECONDITION)."""
