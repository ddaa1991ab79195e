"""Admission decisions (dualpace.policy.admission.admit): one table row per branch."""

from __future__ import annotations

import pytest

from dualpace.policy.admission import AdmissionConfig, Placement, admit, blocks_for
from dualpace.policy.policies import Policy
from dualpace.policy.views import EngineView, RoutedRequest

BS = 16  # block size in every case below


def gpu(name="gpu", total=100, used=0, healthy=True, running=0, waiting=0, p50=10.0, block_size=BS):
    return EngineView(name, "gpu", healthy, total, used, block_size, running, waiting, p50, 2 * p50)


def cpu(name="cpu", total=1000, used=0, healthy=True, running=0, waiting=0, p50=40.0, block_size=BS):
    return EngineView(name, "cpu", healthy, total, used, block_size, running, waiting, p50, 2 * p50)


def held(engine, count, num_tokens=BS * 16):
    """`count` placed requests on `engine`, each holding num_tokens tokens (16 blocks by default)."""
    return [RoutedRequest(f"{engine}-{i}", engine, num_tokens, 0, 64) for i in range(count)]


DEFAULT = AdmissionConfig()
GPU_ONLY = AdmissionConfig(policy=Policy.GPU_ONLY)

# Request: 100 prompt + 100 max tokens = 200 tokens = 13 blocks. GPU reserve: 10 of 100 blocks.
CASES = [
    # id, engines, placed, num_queued, config, (prompt, max_tokens), expected
    ("gpu-room", [gpu(), cpu()], [], 0, DEFAULT, (100, 100), (Placement.GPU, "gpu")),
    ("gpu-room-exact", [gpu(used=77), cpu()], [], 0, DEFAULT, (100, 100), (Placement.GPU, "gpu")),
    ("gpu-reserve-spills-to-cpu", [gpu(used=78), cpu()], [], 0, DEFAULT, (100, 100), (Placement.CPU, "cpu")),
    ("expected-output-fraction", [gpu(used=80), cpu()], [], 0,
     AdmissionConfig(expected_output_fraction=0.5), (100, 100), (Placement.GPU, "gpu")),
    ("reserve-float-rounding", [gpu(total=300, used=257), cpu()], [], 0, DEFAULT, (100, 100),
     (Placement.GPU, "gpu")),
    ("reserve-float-rounding-full", [gpu(total=300, used=258), cpu()], [], 0, DEFAULT, (100, 100),
     (Placement.CPU, "cpu")),
    ("snapshot-lag-counts-placed", [gpu(used=0), cpu()], held("gpu", 5), 0, DEFAULT, (100, 100),
     (Placement.CPU, "cpu")),
    ("snapshot-above-placed", [gpu(used=85), cpu()], held("gpu", 1), 0, DEFAULT, (100, 100),
     (Placement.CPU, "cpu")),
    ("placed-elsewhere-ignored", [gpu(used=0), cpu()], held("cpu", 5), 0, DEFAULT, (100, 100),
     (Placement.GPU, "gpu")),
    ("idle-gpu-skips-reserve", [gpu(used=0), cpu(total=10)], [], 0, DEFAULT, (BS * 90, BS * 5),
     (Placement.GPU, "gpu")),
    ("busy-gpu-keeps-reserve", [gpu(used=1), cpu(total=10)], [], 0, DEFAULT, (BS * 90, BS * 5),
     (Placement.WAIT, None)),
    ("gpu-only-never-cpu", [gpu(used=95), cpu()], [], 0, GPU_ONLY, (100, 100), (Placement.WAIT, None)),
    ("gpu-only-cpu-alone-rejects", [gpu(healthy=False), cpu()], [], 0, GPU_ONLY, (100, 100),
     (Placement.REJECT, None)),
    ("gated-uses-cpu", [gpu(used=95), cpu()], [], 0, AdmissionConfig(policy=Policy.GATED), (100, 100),
     (Placement.CPU, "cpu")),
    ("unhealthy-gpu-skipped", [gpu(healthy=False), cpu()], [], 0, DEFAULT, (100, 100), (Placement.CPU, "cpu")),
    ("unhealthy-cpu-skipped", [gpu(used=95), cpu(healthy=False)], [], 0, DEFAULT, (100, 100),
     (Placement.WAIT, None)),
    ("no-healthy-engine", [gpu(healthy=False), cpu(healthy=False)], [], 0, DEFAULT, (100, 100),
     (Placement.REJECT, None)),
    ("no-engine-at-all", [], [], 0, DEFAULT, (100, 100), (Placement.REJECT, None)),
    ("engine-not-ready-zero-pool", [gpu(total=0), cpu(total=0)], [], 0, DEFAULT, (100, 100),
     (Placement.REJECT, None)),
    ("itl-target-gpu-over", [gpu(p50=30.0), cpu(p50=15.0)], [], 0, AdmissionConfig(itl_target_ms=20.0),
     (100, 100), (Placement.CPU, "cpu")),
    ("itl-target-at-limit", [gpu(p50=20.0), cpu()], [], 0, AdmissionConfig(itl_target_ms=20.0),
     (100, 100), (Placement.GPU, "gpu")),
    ("itl-target-both-over", [gpu(p50=30.0), cpu(p50=25.0)], [], 0, AdmissionConfig(itl_target_ms=20.0),
     (100, 100), (Placement.WAIT, None)),
    ("itl-ignored-without-target", [gpu(p50=500.0), cpu()], [], 0, DEFAULT, (100, 100), (Placement.GPU, "gpu")),
    ("cpu-max-running-snapshot", [gpu(used=95), cpu(running=64)], [], 0, DEFAULT, (100, 100),
     (Placement.WAIT, None)),
    ("cpu-max-running-placed", [gpu(used=95), cpu(running=0)], held("cpu", 64, 10), 0, DEFAULT,
     (100, 100), (Placement.WAIT, None)),
    ("cpu-below-max-running", [gpu(used=95), cpu(running=63)], [], 0, DEFAULT, (100, 100),
     (Placement.CPU, "cpu")),
    ("cpu-kv-full", [gpu(used=95), cpu(total=100, used=90)], [], 0, DEFAULT, (100, 100),
     (Placement.WAIT, None)),
    ("cpu-kv-lag", [gpu(used=95), cpu(total=100)], held("cpu", 6), 0, DEFAULT, (100, 100),
     (Placement.WAIT, None)),
    ("queue-has-room", [gpu(used=95), cpu(healthy=False)], [], 255, DEFAULT, (100, 100),
     (Placement.WAIT, None)),
    ("queue-full", [gpu(used=95), cpu(healthy=False)], [], 256, DEFAULT, (100, 100),
     (Placement.REJECT, None)),
    ("custom-queue-bound", [gpu(used=95)], [], 3, AdmissionConfig(max_queue=3), (100, 100),
     (Placement.REJECT, None)),
    ("never-fits-anywhere", [gpu(), cpu(total=100)], [], 0, DEFAULT, (BS * 100, 1), (Placement.REJECT, None)),
    ("fits-cpu-pool-only", [gpu(), cpu()], [], 0, DEFAULT, (BS * 100, 1), (Placement.CPU, "cpu")),
    ("gpu-only-fits-cpu-pool-only", [gpu(), cpu()], [], 0, GPU_ONLY, (BS * 100, 1), (Placement.REJECT, None)),
    ("fits-unhealthy-pool-waits", [gpu(healthy=False, total=1000), cpu(total=100)], [], 0, DEFAULT,
     (BS * 200, 1), (Placement.WAIT, None)),
    ("whole-pool-exact-fit", [gpu(used=0), cpu(healthy=False)], [], 0, DEFAULT, (BS * 99, BS),
     (Placement.GPU, "gpu")),
    ("most-free-gpu", [gpu("g-a", used=50), gpu("g-b", used=20), cpu()], [], 0, DEFAULT, (100, 100),
     (Placement.GPU, "g-b")),
    ("most-free-gpu-tie-by-name", [gpu("g-b", used=20), gpu("g-a", used=20), cpu()], [], 0, DEFAULT,
     (100, 100), (Placement.GPU, "g-a")),
    ("most-free-counts-placed", [gpu("g-a", used=0), gpu("g-b", used=20), cpu()], held("g-a", 3), 0, DEFAULT,
     (100, 100), (Placement.GPU, "g-b")),
    ("most-free-cpu", [gpu(used=95), cpu("c-a", used=500), cpu("c-b", used=100)], [], 0, DEFAULT,
     (100, 100), (Placement.CPU, "c-b")),
    ("skips-full-gpu-for-other", [gpu("g-a", used=95), gpu("g-b", used=50), cpu()], [], 0, DEFAULT,
     (100, 100), (Placement.GPU, "g-b")),
]


@pytest.mark.parametrize(("engines", "placed", "num_queued", "config", "request_tokens", "expected"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_admit(engines, placed, num_queued, config, request_tokens, expected):
    views = {e.name: e for e in engines}
    num_prompt_tokens, max_tokens = request_tokens
    assert admit(num_prompt_tokens, max_tokens, views, placed, num_queued, config) == expected


@pytest.mark.parametrize(("num_tokens", "block_size", "blocks"),
                         [(0, 16, 0), (-3, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (200, 16, 13)])
def test_blocks_for(num_tokens, block_size, blocks):
    assert blocks_for(num_tokens, block_size) == blocks


def test_blocks_for_rejects_zero_block_size():
    with pytest.raises(ValueError, match="block_size"):
        blocks_for(10, 0)


def test_views_properties():
    assert gpu(total=100, used=30).kv_blocks_free == 70
    request = RoutedRequest("r", "gpu", num_prompt_tokens=10, num_generated_tokens=7, max_tokens=5)
    assert (request.num_tokens, request.remaining_tokens) == (17, 0)
    assert RoutedRequest("r", "gpu", 10, 2, 5).remaining_tokens == 3
    assert Policy("gpu-only") is Policy.GPU_ONLY and Placement("wait") is Placement.WAIT


def test_could_ever_hold_compares_the_final_size_with_the_whole_pool():
    # A CPU-placed request is prefilled on a GPU only if that GPU's whole pool could hold it:
    # the GPU engine refuses (INVALID_ARGUMENT) a request larger than its pool, even to hand it off.
    engine = gpu(total=24, used=24)
    assert engine.could_ever_hold(24 * BS)
    assert not engine.could_ever_hold(24 * BS + 1)


def test_placed_requests_count_at_their_final_size():
    """A burst of short prompts with long outputs: once the GPU's placed requests will fill it
    when they finish, new ones go to the CPU even though the snapshot still shows room."""
    engines = {"gpu": gpu(total=100), "cpu": cpu()}
    placed = [RoutedRequest(f"r{i}", "gpu", BS, 0, BS * 29) for i in range(3)]  # 3 x 30 blocks at the end
    assert admit(BS, BS * 29, engines, placed[:2], 0, AdmissionConfig())[0] == Placement.GPU
    assert admit(BS, BS * 29, engines, placed, 0, AdmissionConfig())[0] == Placement.CPU


# -- with a profile's cost model (a predictor) ---------------------------------------------------


class LinearItl:
    """ITL = base + per_sequence * batch + per_token * mean context; transfer = fixed + per token."""

    def __init__(self, base=5.0, per_sequence=10.0, per_token=0.0, fixed_ms=2.0, per_token_ms=0.01):
        self.base, self.per_sequence, self.per_token = base, per_sequence, per_token
        self.fixed_ms, self.per_token_ms = fixed_ms, per_token_ms
        self.calls = []

    def itl_ms(self, kind, context_tokens):
        self.calls.append((kind, list(context_tokens)))
        n = len(context_tokens)
        mean = sum(context_tokens) / n if n else 0
        scale = 0.2 if kind == "gpu" else 1.0
        return scale * (self.base + self.per_sequence * n + self.per_token * mean)

    def kv_transfer_ms(self, num_tokens):
        return self.fixed_ms + self.per_token_ms * num_tokens

    def prefill_ms(self, kind, num_tokens):
        return 0.0  # a GPU that is never behind on time: these cases test the ITL rules alone


def with_predictor(target, predictor=None, **kwargs):
    return AdmissionConfig(itl_target_ms=target, predictor=predictor or LinearItl(), **kwargs)


def test_predicted_cpu_itl_with_one_more_admits_within_target():
    # GPU full (spills to CPU); CPU holds 3 -> with one more, predicted 5 + 10 * 4 = 45 ms.
    engines = {e.name: e for e in (gpu(used=95), cpu())}
    placed = held("cpu", 3)
    assert admit(100, 100, engines, placed, 0, with_predictor(45.0)) == (Placement.CPU, "cpu")
    assert admit(100, 100, engines, placed, 0, with_predictor(44.9)) == (Placement.WAIT, None)


def test_predictor_replaces_the_measured_p50_check():
    # Measured p50 far above the target, prediction within it: the prediction decides.
    engines = {e.name: e for e in (gpu(used=95), cpu(p50=500.0))}
    assert admit(100, 100, engines, [], 0, with_predictor(20.0)) == (Placement.CPU, "cpu")
    assert admit(100, 100, engines, [], 0, AdmissionConfig(itl_target_ms=20.0)) == (Placement.WAIT, None)


def test_prediction_sees_held_contexts_and_the_new_prompt():
    predictor = LinearItl(base=0.0, per_sequence=0.0, per_token=0.1)
    engines = {e.name: e for e in (gpu(used=95), cpu())}
    placed = [RoutedRequest("a", "cpu", 300, 100, 200)]  # context 400
    # mean context of [400, 200] = 300 -> 30 ms
    assert admit(200, 10, engines, placed, 0, with_predictor(30.0, predictor)) == (Placement.CPU, "cpu")
    assert ("cpu", [400, 200]) in predictor.calls
    assert admit(200, 10, engines, placed, 0, with_predictor(29.0, predictor)) == (Placement.WAIT, None)


def test_snapshot_requests_unknown_to_the_router_count_in_the_prediction():
    engines = {e.name: e for e in (gpu(used=95), cpu(running=4))}
    # the router relays none of the 4: ITL with one more = 5 + 10 * 5 = 55
    assert admit(100, 100, engines, [], 0, with_predictor(55.0)) == (Placement.CPU, "cpu")
    assert admit(100, 100, engines, [], 0, with_predictor(54.0)) == (Placement.WAIT, None)


def test_gpu_is_checked_by_prediction_too():
    engines = {e.name: e for e in (gpu(), cpu())}
    # GPU: 0.2 * (5 + 10 * 1) = 3 ms; CPU: 15 ms
    assert admit(100, 100, engines, [], 0, with_predictor(3.0)) == (Placement.GPU, "gpu")
    assert admit(100, 100, engines, [], 0, with_predictor(2.9)) == (Placement.WAIT, None)


def test_predictor_without_target_keeps_capacity_rules():
    engines = {e.name: e for e in (gpu(used=95), cpu())}
    predictor = LinearItl()
    config = AdmissionConfig(predictor=predictor, cpu_max_running=2)
    assert admit(100, 100, engines, held("cpu", 1), 0, config) == (Placement.CPU, "cpu")
    assert admit(100, 100, engines, held("cpu", 2), 0, config) == (Placement.WAIT, None)
    assert predictor.calls == []


def test_the_engine_holding_the_longest_cached_prefix_is_preferred_within_its_limits():
    engines = {e.name: e for e in (gpu("g1", used=0), gpu("g2", used=50), cpu())}
    assert admit(100, 100, engines, [], 0, DEFAULT) == (Placement.GPU, "g1")  # most free blocks
    assert admit(100, 100, engines, [], 0, DEFAULT, {"g1": 16, "g2": 96}) == (Placement.GPU, "g2")
    full = {**engines, "g2": gpu("g2", used=90)}  # the cached engine has no room: limits come first
    assert admit(100, 100, full, [], 0, DEFAULT, {"g2": 96}) == (Placement.GPU, "g1")
    slow = {**engines, "g2": gpu("g2", used=50, p50=500.0)}
    assert admit(100, 100, slow, [], 0, AdmissionConfig(itl_target_ms=100.0), {"g2": 96}) == (Placement.GPU, "g1")
