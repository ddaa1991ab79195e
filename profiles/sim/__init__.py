"""Discrete-event simulator: the real schedulers, admission and migration planner, with a
profile's cost model as the clock. Nothing here re-implements a policy;
what it adds is only the passage of time.

- config.py     SimConfig (what to simulate), SimResult (what it reports), engine names
- device.py     the GPU shared by the GPU engine's iterations and Dense Assist work
- simulator.py  the event loop: arrivals, engine iterations, admission, migrations
- prefix.py     the engines' prefix caches and the router's prefix index, as on the daemons
- results.py    a finished run, summarized

Pure: no clock reads, no torch, grpc or asyncio; the same inputs give the same result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dualpace.profile.cost_model import CostModel
from profiles.sim.config import (
    ASSIST_DEVICE_HOLDS,
    CPU,
    GPU,
    SimConfig,
    SimResult,
    SimulationError,
    deterministic_token,
)
from profiles.sim.results import summarize
from profiles.sim.simulator import Simulator
from toolkit.workload import RequestSpec

__all__ = ["ASSIST_DEVICE_HOLDS", "CPU", "GPU", "SimConfig", "SimResult", "SimulationError", "Simulator",
           "deterministic_token", "simulate"]


def simulate(cost: CostModel, config: SimConfig, specs: Sequence[RequestSpec], rate: float = math.nan) -> SimResult:
    """Run `specs` through the simulated deployment and summarize."""
    sim = Simulator(cost, config)
    sim.run(specs)
    return summarize(sim, rate)
