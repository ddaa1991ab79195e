"""Migration planning (dualpace.policy.migration_planner.plan_migrations): table cases and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpace.policy.migration_planner import (
    MigrationConfig,
    PlannedMigration,
    plan_migrations,
    transfer_ms,
)
from dualpace.policy.policies import Policy
from dualpace.policy.views import EngineView, RoutedRequest

BS = 16


def gpu(name="gpu", total=100, used=0, healthy=True, waiting=0, p50=10.0):
    return EngineView(name, "gpu", healthy, total, used, BS, 0, waiting, p50, 2 * p50)


def cpu(name="cpu", total=1000, used=0, healthy=True, running=0, p50=50.0):
    return EngineView(name, "cpu", healthy, total, used, BS, running, 0, p50, 2 * p50)


def on_gpu(request_id, remaining, engine="gpu", migrating=False, prompt=BS * 20):
    """A decoding GPU request holding 20 blocks (320 tokens: the prompt and its first generated
    token) with `remaining` tokens still to generate."""
    return RoutedRequest(request_id, engine, prompt - 1, 1, remaining + 1, migrating)


def on_cpu(request_id, prompt, generated, max_tokens, engine="cpu", migrating=False):
    return RoutedRequest(request_id, engine, prompt, generated, max_tokens, migrating)


# The payoff cases below are worked out for this transfer cost (5 ms fixed, 2 GB/s), not the defaults.
TRANSFER = {"kv_transfer_fixed_ms": 5.0, "kv_transfer_bytes_per_s": 2e9}


def plan(requests, *engines, policy=Policy.DUALPACE, **config):
    return plan_migrations(requests, {e.name: e for e in engines}, policy, MigrationConfig(**{**TRANSFER, **config}))


def moved(plans):
    return [(p.request_id, p.source, p.target, p.reason) for p in plans]


def pressure(*request_ids, target="cpu"):
    return [(rid, "gpu", target, "gpu_kv_pressure") for rid in request_ids]


def headroom(*request_ids, source="cpu"):
    return [(rid, source, "gpu", "gpu_headroom") for rid in request_ids]


GPU_REQUESTS = [on_gpu("a", 50), on_gpu("b", 200), on_gpu("c", 100), on_gpu("d", 10)]


# -- GPU -> CPU under KV pressure ---------------------------------------------------------------

PRESSURE_CASES = [
    # id, requests, engines, config, expected
    ("longest-remaining-first-stops-at-target", GPU_REQUESTS, [gpu(used=96), cpu()], {}, pressure("b", "c")),
    ("exactly-reaches-target", GPU_REQUESTS, [gpu(used=95), cpu()], {}, pressure("b")),
    ("below-high-no-waiting", GPU_REQUESTS, [gpu(used=85), cpu()], {}, []),
    ("above-target-with-waiting", GPU_REQUESTS, [gpu(used=80, waiting=1), cpu()], {}, pressure("b")),
    ("at-target-with-waiting", GPU_REQUESTS[:3], [gpu(used=75, waiting=2), cpu()], {}, []),
    ("snapshot-lag-counts-own", GPU_REQUESTS + [on_gpu("e", 5)], [gpu(used=0), cpu()], {}, pressure("b", "c")),
    ("cpu-unhealthy", GPU_REQUESTS, [gpu(used=96), cpu(healthy=False)], {}, []),
    ("no-cpu-engine", GPU_REQUESTS, [gpu(used=96)], {}, []),
    ("cpu-full", GPU_REQUESTS, [gpu(used=96), cpu(total=100, used=95)], {}, []),
    # free 30 blocks: b needs 33 (520 tokens), c 27 fits, then a (24) and d (21) no longer fit
    ("cpu-room-for-some", GPU_REQUESTS, [gpu(used=96), cpu(total=100, used=70)], {}, pressure("c")),
    ("cpu-kv-counts-own", GPU_REQUESTS + [on_cpu("x", BS * 70, 0, 1)], [gpu(used=96), cpu(total=100)], {},
     pressure("c")),
    ("cpu-max-running", GPU_REQUESTS, [gpu(used=96), cpu(running=1)], {"cpu_max_running": 2}, pressure("b")),
    ("max-per-tick", GPU_REQUESTS, [gpu(used=100), cpu()], {"max_per_tick": 1}, pressure("b")),
    ("max-per-tick-zero", GPU_REQUESTS, [gpu(used=100), cpu()], {"max_per_tick": 0}, []),
    ("gpu-only-never", GPU_REQUESTS, [gpu(used=100), cpu()], {"policy": Policy.GPU_ONLY}, []),
    ("gated-migrates", GPU_REQUESTS, [gpu(used=95), cpu()], {"policy": Policy.GATED}, pressure("b")),
    ("skips-migrating-and-last-token",
     [on_gpu("a", 50), on_gpu("b", 200, migrating=True), on_gpu("c", 1), on_gpu("d", 10)],
     [gpu(used=100, waiting=1), cpu()], {}, pressure("a")),
    # b's 20 blocks are already on their way out: 95 - 20 = 75 is at the target
    ("in-flight-migration-counted",
     [on_gpu("a", 50), on_gpu("b", 200, migrating=True), on_gpu("c", 100)], [gpu(used=95), cpu()], {}, []),
    ("unhealthy-gpu-left-alone", GPU_REQUESTS, [gpu(used=100, healthy=False), cpu()], {}, []),
    ("most-free-cpu", GPU_REQUESTS, [gpu(used=95), cpu("c-a", used=500), cpu("c-b", used=100)], {},
     pressure("b", target="c-b")),
    ("custom-watermarks", GPU_REQUESTS, [gpu(used=90), cpu()],
     {"gpu_high_watermark": 0.85, "gpu_target_watermark": 0.55}, pressure("b", "c")),
]


@pytest.mark.parametrize(("requests", "engines", "config", "expected"), [c[1:] for c in PRESSURE_CASES],
                         ids=[c[0] for c in PRESSURE_CASES])
def test_pressure(requests, engines, config, expected):
    assert moved(plan(requests, *engines, **config)) == expected


# -- CPU -> GPU when the GPU has headroom and the move pays --------------------------------------

# 160 prompt tokens, 100 to go: payoff 100 * (50 - 10) - 5 - 10 ms > 0; 17 blocks on the GPU.
BACK = on_cpu("x", 160, 0, 100)

HEADROOM_CASES = [
    ("pays-off", [BACK], [gpu(used=10), cpu()], {}, headroom("x")),
    ("transfer-too-slow", [BACK], [gpu(used=10), cpu()], {"kv_bytes_per_token": 10**8}, []),
    # 60 * (10.25 - 10.0) == 5 + 10 exactly: no gain, no move; 61 tokens to go: move
    ("payoff-break-even", [on_cpu("x", 160, 0, 60)], [gpu(used=10), cpu(p50=10.25)], {}, []),
    ("payoff-just-positive", [on_cpu("x", 160, 0, 61)], [gpu(used=10), cpu(p50=10.25)], {}, headroom("x")),
    ("cpu-faster", [BACK], [gpu(used=10, p50=30.0), cpu(p50=20.0)], {}, []),
    ("gpu-at-low-watermark", [BACK], [gpu(used=50), cpu()], {}, []),
    ("gpu-waiting", [BACK], [gpu(used=10, waiting=1), cpu()], {}, []),
    ("gpu-unhealthy", [BACK], [gpu(used=10, healthy=False), cpu()], {}, []),
    ("cpu-unhealthy", [BACK], [gpu(used=10), cpu(healthy=False)], {}, []),
    ("migrating-stays", [on_cpu("x", 160, 0, 100, migrating=True)], [gpu(used=10), cpu()], {}, []),
    ("last-token-stays", [on_cpu("x", 160, 99, 100)], [gpu(used=10), cpu()], {}, []),
    ("gpu-only-never", [BACK], [gpu(used=10), cpu()], {"policy": Policy.GPU_ONLY}, []),
    # payoff order p (160 to go), r (140), s (100), q (60); p, r, q take 20 GPU blocks, s 8:
    # 40 + 20 = 60, r would make 80 > 75 (skipped), s makes 68, q would make 88 (skipped)
    ("best-payoff-first-within-target",
     [on_cpu("q", 160, 100, 160), on_cpu("p", 160, 0, 160), on_cpu("s", 16, 0, 100), on_cpu("r", 160, 20, 160)],
     [gpu(used=40), cpu()], {}, headroom("p", "s")),
    ("max-per-tick", [on_cpu(f"x{i}", 16, 0, 50) for i in range(5)], [gpu(used=0), cpu()],
     {"max_per_tick": 2}, headroom("x0", "x1")),
    ("from-healthy-cpu-only", [on_cpu("x", 160, 0, 100, engine="c-a"), on_cpu("y", 160, 0, 50, engine="c-b")],
     [gpu(used=10), cpu("c-a", healthy=False), cpu("c-b")], {}, headroom("y", source="c-b")),
    # a request coming in from the CPU already counts against the GPU: 40 + 20 + 20 > 75
    ("in-flight-arrival-counted", [on_cpu("p", 160, 0, 160, migrating=True), on_cpu("q", 160, 0, 160)],
     [gpu(used=40), cpu()], {}, []),
]


@pytest.mark.parametrize(("requests", "engines", "config", "expected"), [c[1:] for c in HEADROOM_CASES],
                         ids=[c[0] for c in HEADROOM_CASES])
def test_headroom(requests, engines, config, expected):
    assert moved(plan(requests, *engines, **config)) == expected


def test_ties_broken_by_request_id_whatever_the_input_order():
    gpu_requests = [on_gpu(rid, 100) for rid in ("m", "c", "x", "a")]
    expected = pressure("a", "c")  # 100 -> 80 -> 60 blocks: at the target after two
    for order in (gpu_requests, gpu_requests[::-1], sorted(gpu_requests, key=lambda r: r.request_id)):
        assert moved(plan(order, gpu(used=100), cpu(), max_per_tick=3)) == expected
    cpu_requests = [on_cpu(rid, 16, 0, 50) for rid in ("k", "b", "z")]
    for order in (cpu_requests, cpu_requests[::-1]):
        assert moved(plan(order, gpu(used=0), cpu(), max_per_tick=2)) == headroom("b", "k")


def test_transfer_ms():
    config = MigrationConfig(kv_bytes_per_token=1000, kv_transfer_bytes_per_s=2e9, kv_transfer_fixed_ms=5.0)
    assert transfer_ms(1000, config) == pytest.approx(5.5)
    assert transfer_ms(0, config) == pytest.approx(5.0)
    assert transfer_ms(10, MigrationConfig(kv_transfer_bytes_per_s=0)) == float("inf")


def test_no_profile_transfer_rate_is_the_slowest_measured_one():
    """The defaults are measurements, not guesses: the lowest rate and highest fixed cost of the
    stored local profiles' KV transfer fits (re-profiling there means updating them)."""
    import glob
    import json
    from pathlib import Path

    from dualpace.policy.migration_planner import (
        MEASURED_KV_TRANSFER_BYTES_PER_S,
        MEASURED_KV_TRANSFER_FIXED_MS,
        MEASURED_KV_TRANSFER_PROFILES,
    )

    root = Path(__file__).resolve().parents[2]
    fits = [json.loads(Path(path).read_text())["kv_transfer"]
            for path in sorted(glob.glob(str(root / MEASURED_KV_TRANSFER_PROFILES)))]
    assert fits, f"no profile matches {MEASURED_KV_TRANSFER_PROFILES}"
    assert MEASURED_KV_TRANSFER_BYTES_PER_S == pytest.approx(min(f["bytes_per_s"] for f in fits), rel=1e-3)
    assert MEASURED_KV_TRANSFER_FIXED_MS == pytest.approx(max(f["fixed_ms"] for f in fits), abs=0.05)
    config = MigrationConfig()
    assert (config.kv_transfer_bytes_per_s, config.kv_transfer_fixed_ms) == (
        MEASURED_KV_TRANSFER_BYTES_PER_S, MEASURED_KV_TRANSFER_FIXED_MS)


def test_planned_migration_fields():
    [planned] = plan(GPU_REQUESTS, gpu(used=95), cpu())
    assert planned == PlannedMigration(request_id="b", source="gpu", target="cpu", reason="gpu_kv_pressure")


# -- properties ---------------------------------------------------------------------------------

ENGINE_NAMES = ("g0", "g1", "c0", "c1")


@st.composite
def scenarios(draw):
    """Mostly-healthy engines and requests sized so that pressure and headroom both occur."""
    mostly = st.sampled_from([True, True, True, False])
    engines = {}
    for name in ENGINE_NAMES:
        if name not in ("g0", "c0") and not draw(st.booleans()):
            continue
        total = draw(st.sampled_from([0, 30, 100, 300]))
        engines[name] = EngineView(
            name=name, kind="gpu" if name.startswith("g") else "cpu", healthy=draw(mostly),
            kv_blocks_total=total, kv_blocks_used=draw(st.integers(0, total)),
            block_size=draw(st.sampled_from([4, 16])), num_running=draw(st.sampled_from([0, 2, 8])),
            num_waiting=draw(st.sampled_from([0, 0, 1])), itl_p50_ms=draw(st.floats(0, 100)), itl_p99_ms=0.0)
    ids = draw(st.lists(st.integers(0, 40), max_size=16))
    requests = [RoutedRequest(
        request_id=f"r{i}", engine=draw(st.sampled_from(("g0", "g0", "c0", "c0", "g1", "c1", "gone"))),
        num_prompt_tokens=draw(st.integers(1, 200)), num_generated_tokens=draw(st.integers(0, 60)),
        max_tokens=draw(st.integers(1, 120)), migrating=not draw(mostly)) for i in ids]
    low, target, high = draw(st.sampled_from([(0.5, 0.75, 0.9), (0.2, 0.4, 0.6), (0.3, 0.3, 0.3)])
                             | st.lists(st.floats(0, 1), min_size=3, max_size=3).map(sorted))
    config = MigrationConfig(
        gpu_low_watermark=low, gpu_target_watermark=target, gpu_high_watermark=high,
        max_per_tick=draw(st.sampled_from([0, 1, 2, 4, 6])),
        kv_bytes_per_token=draw(st.sampled_from([0, 1000, 10**6])),
        cpu_max_running=draw(st.sampled_from([None, None, 0, 3, 10])))
    policy = draw(st.sampled_from([Policy.DUALPACE, Policy.DUALPACE, Policy.GATED, Policy.GPU_ONLY]))
    return requests, engines, policy, config


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_plan_invariants(scenario, rng):
    requests, engines, policy, config = scenario
    plans = plan_migrations(requests, engines, policy, config)
    assert len(plans) <= config.max_per_tick
    if policy is Policy.GPU_ONLY:
        assert plans == []
    ids = [p.request_id for p in plans]
    assert len(ids) == len(set(ids)), "a request planned twice"
    by_id = {}
    for r in requests:
        by_id.setdefault(r.request_id, []).append(r)
    for p in plans:
        candidates = [r for r in by_id[p.request_id] if r.engine == p.source]
        assert candidates and any(not r.migrating and r.remaining_tokens > 1 for r in candidates)
        source, target = engines[p.source], engines[p.target]
        assert source.healthy and target.healthy
        assert {source.kind, target.kind} == {"gpu", "cpu"}
        assert p.reason == ("gpu_kv_pressure" if source.kind == "gpu" else "gpu_headroom")
    # deterministic: the input order does not matter when ids are unique
    if len(by_id) == len(requests):
        shuffled = list(requests)
        rng.shuffle(shuffled)
        assert plan_migrations(shuffled, engines, policy, config) == plans


def test_requests_never_prefilled_are_not_moved():
    """Still queued on the GPU (no token yet): the CPU would have to prefill it, so it stays."""
    queued = RoutedRequest("queued", "gpu", BS * 20, 0, 400)
    assert plan([queued], gpu(used=95, waiting=1), cpu()) == []
    assert plan([on_gpu("decoding", 400)], gpu(used=95, waiting=1), cpu())


def test_a_request_moves_at_most_max_migrations_per_request_times():
    """No ping-pong: after its hand-off and one more move, a request stays where it is."""
    moved_twice = RoutedRequest("x", "cpu", 160, 5, 100, num_migrations=2)
    moved_once = RoutedRequest("y", "cpu", 160, 5, 100, num_migrations=1)
    assert plan([moved_twice], gpu(used=10), cpu()) == []
    assert [m.request_id for m in plan([moved_once], gpu(used=10), cpu())] == ["y"]


# -- with a profile's cost model (a predictor) ---------------------------------------------------


class FixedItl:
    def __init__(self, cpu_ms=50.0, gpu_ms=10.0, per_sequence_ms=0.0, transfer_fixed_ms=0.0, transfer_per_token_ms=0.0):
        self.cpu_ms, self.gpu_ms, self.per_sequence_ms = cpu_ms, gpu_ms, per_sequence_ms
        self.transfer_fixed_ms, self.transfer_per_token_ms = transfer_fixed_ms, transfer_per_token_ms
        self.calls = []

    def itl_ms(self, kind, context_tokens):
        self.calls.append((kind, sorted(context_tokens)))
        base = self.cpu_ms if kind == "cpu" else self.gpu_ms
        return base + self.per_sequence_ms * len(context_tokens)

    def kv_transfer_ms(self, num_tokens):
        return self.transfer_fixed_ms + self.transfer_per_token_ms * num_tokens


def test_predicted_transfer_time_decides_the_payoff():
    request = on_cpu("r", prompt=100, generated=10, max_tokens=20)  # 10 remaining, 110 tokens of KV
    # gain 10 tokens * (50 - 10) = 400 ms; overhead 10 ms
    cheap = FixedItl(transfer_fixed_ms=100.0)
    assert moved(plan([request], gpu(p50=10.0), cpu(p50=50.0), predictor=cheap)) == headroom("r")
    costly = FixedItl(transfer_fixed_ms=391.0)
    assert plan([request], gpu(p50=10.0), cpu(p50=50.0), predictor=costly) == []
    # the config's bandwidth is not used when a predictor is present
    assert transfer_ms(110, MigrationConfig(predictor=costly, kv_transfer_bytes_per_s=1e12)) == 391.0


def test_predicted_itls_replace_the_measured_ones():
    request = on_cpu("r", prompt=100, generated=10, max_tokens=20)
    # measured: CPU no slower than the GPU -> no move; predicted: CPU much slower -> move
    assert plan([request], gpu(p50=50.0), cpu(p50=50.0)) == []
    predictor = FixedItl(cpu_ms=60.0, gpu_ms=5.0)
    assert moved(plan([request], gpu(p50=50.0), cpu(p50=50.0), predictor=predictor)) == headroom("r")
    # the GPU's ITL is predicted with the request added, the CPU's for what it holds now
    assert ("gpu", [110]) in predictor.calls and ("cpu", [110]) in predictor.calls
    # predicted the other way round: no move even though the measurements say it pays
    assert plan([request], gpu(p50=1.0), cpu(p50=500.0), predictor=FixedItl(cpu_ms=5.0, gpu_ms=60.0)) == []


def test_cpu_itl_target_limits_pressure_moves():
    requests = [on_gpu(f"g{i}", remaining=100 - i) for i in range(5)]  # 100 blocks used of 100
    predictor = FixedItl(cpu_ms=10.0, per_sequence_ms=10.0)  # CPU ITL = 10 + 10 * sequences
    unlimited = plan(requests, gpu(), cpu(), predictor=predictor)
    assert len(unlimited) >= 2
    limited = plan(requests, gpu(), cpu(), predictor=predictor, cpu_itl_target_ms=20.0)
    assert moved(limited) == pressure("g0")  # a second request would take the CPU to 30 ms
    assert plan(requests, gpu(), cpu(running=2), predictor=predictor, cpu_itl_target_ms=20.0) == []
