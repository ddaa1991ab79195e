"""The serving policies: DualPace and the two baselines it is compared against, described once.

Every consumer (router admission and migration, the host tier, cpu_service, the GPU engine's
cooperative step layout, `dualpace up`, the simulator, the comparison benchmark) asks a policy's
traits here instead of testing its name. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Policy(str, Enum):
    DUALPACE = "dualpace"  # independent CPU engine loop
    GATED = "gated"        # NEO-like baseline: CPU decodes advance inside GPU iterations
    GPU_ONLY = "gpu-only"  # vLLM-like baseline: the GPU engine alone


@dataclass(frozen=True)
class PolicyTraits:
    summary: str  # one line, for --help
    # A CPU engine (cpu_service) serves requests; without one the router places on GPU engines
    # only, admits optimistically (as vLLM V1 does) and plans no migration.
    uses_cpu_engine: bool
    # The CPU engine advances its requests only inside the GPU engine's steps (NEO as built):
    # every decode iteration asks to join the next GPU step and waits for it (dense work always on
    # the GPU, so it needs a gpu_service), and the step is laid out for the least GPU wait.
    cpu_decodes_inside_gpu_steps: bool
    # The CPU engine runs on its own clock (see the properties below for what that allows).
    cpu_on_own_clock: bool

    @property
    def migrates(self) -> bool:
        """The router's planner moves requests between the GPU and CPU engines."""
        return self.uses_cpu_engine

    @property
    def holds_for_handoff(self) -> bool:
        """The GPU engine holds a request it will hand off out of every step after the one that
        samples its first token (NewEngineRequest.hold_after_first_token), so the move starts at
        once, else token 2 waits for the GPU's next step. Not under gated: a CPU-resident request
        advances only inside GPU steps; held, it would miss the GPU's next step and join the one
        after it, one GPU step later than the GPU decoding it unheld."""
        return self.cpu_on_own_clock

    @property
    def continues_on_host_tier(self) -> bool:
        """The router may continue a conversation on the CPU engine that caches its prefix."""
        return self.cpu_on_own_clock

    @property
    def cpu_service_policy(self) -> Policy:
        """What cpu_service runs under this policy (it is never started under gpu-only)."""
        return Policy.GATED if self.cpu_decodes_inside_gpu_steps else Policy.DUALPACE


POLICY_TRAITS: dict[Policy, PolicyTraits] = {
    Policy.DUALPACE: PolicyTraits(
        "independent CPU decode engine beside the GPU engine",
        uses_cpu_engine=True, cpu_decodes_inside_gpu_steps=False, cpu_on_own_clock=True),
    Policy.GATED: PolicyTraits(
        "NEO-like baseline: CPU decodes advance only inside GPU iterations, dense work on the GPU",
        uses_cpu_engine=True, cpu_decodes_inside_gpu_steps=True, cpu_on_own_clock=False),
    Policy.GPU_ONLY: PolicyTraits(
        "vLLM-like baseline: the GPU engine alone, no cpu_service",
        uses_cpu_engine=False, cpu_decodes_inside_gpu_steps=False, cpu_on_own_clock=False),
}
POLICY_NAMES = tuple(policy.value for policy in Policy)
CPU_SERVICE_POLICY_NAMES = tuple(p.value for p, t in POLICY_TRAITS.items() if t.uses_cpu_engine)


def traits(policy: Policy | str) -> PolicyTraits:
    return POLICY_TRAITS[parse_policy(policy)]


def parse_policy(value: Policy | str) -> Policy:
    try:
        return Policy(value)
    except ValueError:
        raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, got {value!r}") from None


def policy_help(names: tuple[str, ...] = POLICY_NAMES) -> str:
    """`--policy` help: each name with its summary."""
    return "; ".join(f"{name}: {POLICY_TRAITS[Policy(name)].summary}" for name in names)
