"""What a reliability test runs: its engines and the router in front of them. A module names its
own in SYSTEM; the conftest's `system` and `fresh_system` fixtures run it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    """One engine of a system: `kind` gpu or cpu, its flags (after ENGINE_FLAGS), a test-only
    delay of every step, and whether the router sends it requests."""

    name: str
    kind: str
    flags: tuple[str, ...]
    step_delay_ms: int = 0
    behind_router: bool = True


@dataclass(frozen=True)
class SystemSpec:
    """What a test runs: engines (at most one gpu and one cpu behind the router) and the
    router's flags (None: no router). A module names its own in SYSTEM; a test another with
    indirect parametrization of `system` or `fresh_system`. shared: one running copy for the
    whole session, for modules that leave it idle."""

    engines: tuple[EngineSpec, ...]
    router_flags: tuple[str, ...] | None = ("--no-migrate",)
    shared: bool = False


SLOW_STEP_DELAY_MS = 30
# One gpu_service whose every step lasts at least SLOW_STEP_DELAY_MS (a test-only fault, so
# requests are measurably mid-stream), behind a gpu-only router without load-driven migration.
SLOW_GPU = SystemSpec(
    engines=(EngineSpec("gpu", "gpu", ("--name", "gpu-slow", "--kv-blocks", "256", "--block-size", "8"),
                        step_delay_ms=SLOW_STEP_DELAY_MS),),
    router_flags=("--policy", "gpu-only", "--no-migrate"), shared=True)


def lone_gpu(name: str, step_delay_ms: int) -> SystemSpec:
    """The only engine, behind a gpu-only router: for tests that kill it and expect the router
    to refuse what nothing can take."""
    return SystemSpec(engines=(EngineSpec("gpu", "gpu", ("--name", name, "--kv-blocks", "64", "--block-size", "8"),
                                          step_delay_ms=step_delay_ms),),
                      router_flags=("--policy", "gpu-only", "--no-migrate"))
