"""The simulator's public names (the implementation is the profiles.sim package)."""

from profiles.sim import (  # noqa: F401
    ASSIST_DEVICE_HOLDS,
    CPU,
    GPU,
    SimConfig,
    SimResult,
    SimulationError,
    Simulator,
    deterministic_token,
    simulate,
)
