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
