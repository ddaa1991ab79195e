"""Prometheus metrics: the registry helpers, and a gpu_service process scraped on --metrics-port."""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dualpace.errors import InvalidArgument
from dualpace.sampling import SamplingParams
from dualpace.serve import metrics
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from toolkit.processes import start_daemon

ENGINE_FAMILIES = [
    "dualpace_num_requests_running", "dualpace_num_requests_waiting", "dualpace_kv_blocks_used",
    "dualpace_kv_blocks_total", "dualpace_time_to_first_token_seconds", "dualpace_inter_token_latency_seconds",
    "dualpace_e2e_request_latency_seconds", "dualpace_iteration_latency_seconds", "dualpace_prompt_tokens_total",
    "dualpace_generation_tokens_total", "dualpace_requests_total", "dualpace_preemptions_total",
    "dualpace_migrations_total", "dualpace_dense_assist_calls_total", "dualpace_dense_assist_round_trip_seconds",
    "dualpace_errors_total", "dualpace_kv_blocks_cached", "dualpace_prefix_cache_queries_total",
    "dualpace_prefix_cache_hits_total",
]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped.get((name, tuple(sorted(labels.items()))), 0.0)


# ---------------------------------------------------------------------- helpers


def test_request_clock_observes_ttft_itl_e2e_and_tokens():
    engine = metrics.engine_metrics("unit-clock")
    before = samples(metrics.render().decode())
    clock = metrics.RequestClock(now_s=10.0)
    clock.tokens(engine, 1, now_s=10.5)  # first token: TTFT 0.5 s
    clock.tokens(engine, 2, now_s=10.7)  # two tokens in one event: two ITLs of 0.1 s
    clock.tokens(engine, 0, now_s=11.0)  # no tokens: nothing observed
    clock.finished(engine, "length", now_s=11.0)
    after = samples(metrics.render().decode())

    def delta(name: str, **labels: str) -> float:
        return value(after, name, engine="unit-clock", **labels) - value(before, name, engine="unit-clock", **labels)

    assert delta("dualpace_generation_tokens_total") == 3
    assert delta("dualpace_time_to_first_token_seconds_count") == 1
    assert delta("dualpace_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert delta("dualpace_inter_token_latency_seconds_count") == 2
    assert delta("dualpace_inter_token_latency_seconds_sum") == pytest.approx(0.2)
    assert delta("dualpace_e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert delta("dualpace_requests_total", finish_reason="length") == 1


def test_imported_request_has_no_ttft_or_e2e():
    engine = metrics.engine_metrics("unit-import")
    clock = metrics.RequestClock(now_s=0.0, arrived=False)
    clock.tokens(engine, 1, now_s=0.25)  # an ITL from the import
    clock.finished(engine, "stop", now_s=1.0)
    after = samples(metrics.render().decode())
    assert value(after, "dualpace_time_to_first_token_seconds_count", engine="unit-import") == 0
    assert value(after, "dualpace_e2e_request_latency_seconds_count", engine="unit-import") == 0
    assert value(after, "dualpace_inter_token_latency_seconds_sum", engine="unit-import") == pytest.approx(0.25)
    assert value(after, "dualpace_requests_total", engine="unit-import", finish_reason="stop") == 1


def test_state_gauges_and_preemption_deltas():
    engine = metrics.EngineMetrics("unit-state")
    engine.set_state(2, 1, 10, 64, num_preemptions=3)
    engine.set_state(1, 0, 7, 64, num_preemptions=5)
    engine.iteration("local", 0.01)
    scraped = samples(metrics.render().decode())
    assert value(scraped, "dualpace_num_requests_running", engine="unit-state") == 1
    assert value(scraped, "dualpace_num_requests_waiting", engine="unit-state") == 0
    assert value(scraped, "dualpace_kv_blocks_used", engine="unit-state") == 7
    assert value(scraped, "dualpace_kv_blocks_total", engine="unit-state") == 64
    assert value(scraped, "dualpace_preemptions_total", engine="unit-state") == 5
    assert value(scraped, "dualpace_iteration_latency_seconds_count", engine="unit-state", mode="local") == 1


def test_token_counts_alone_export_no_state_gauges():
    # The router counts tokens by engine; it must not export zero gauges for the engines' state.
    metrics.RequestClock().tokens(metrics.engine_metrics("unit-router-view"), 1)
    text = metrics.render().decode()
    assert 'dualpace_generation_tokens_total{engine="unit-router-view"} 1.0' in text
    assert 'dualpace_num_requests_running{engine="unit-router-view"}' not in text


def test_migrations_errors_and_callback_gauges():
    metrics.migration("gpu", "cpu", "committed")
    metrics.error("RESOURCE_EXHAUSTED")
    state = {"a": 1.0}
    metrics.register_callback_gauges(metrics.CallbackGauges("dualpace_unit_gauge", "test", ("engine",),
                                                            lambda: {(k,): v for k, v in state.items()}))
    metrics.register_callback_gauges(metrics.CallbackGauges("dualpace_unit_gauge", "test", ("engine",),
                                                            lambda: {(k,): 2 * v for k, v in state.items()}))
    scraped = samples(metrics.render().decode())
    assert value(scraped, "dualpace_migrations_total", direction="gpu_to_cpu", outcome="committed") >= 1
    assert value(scraped, "dualpace_errors_total", code="RESOURCE_EXHAUSTED") >= 1
    assert value(scraped, "dualpace_unit_gauge", engine="a") == 2.0  # the second replaced the first


def test_metrics_server_port_zero_and_bad_port():
    address = metrics.start_metrics_server(0)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address) and not address.endswith(":0")
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        assert b"dualpace_generation_tokens_total" in response.read()
    with pytest.raises(InvalidArgument, match="--metrics-port"):
        metrics.start_metrics_server(70000)
    with pytest.raises(InvalidArgument, match="cannot bind"):
        metrics.start_metrics_server(int(address.rsplit(":", 1)[1]))


# ---------------------------------------------------------------------- a daemon


def test_gpu_service_exposes_metrics(synth_checkpoint):
    folder = str(synth_checkpoint("tiny-llama"))
    daemon = start_daemon("gpu_service", "--model", folder, "--dtype", "fp32", "--threads", "1",
                          "--kv-blocks", "64", "--block-size", "8", "--metrics-port", "0")
    try:
        match = re.search(r"gpu_service metrics on (\S+)", daemon.log())
        assert match, daemon.log()
        # 20 tokens: the second time, its first two blocks of 8 come from the prefix cache.
        prompt, params = [5, 9, 2, 11, 40] * 4, SamplingParams(max_tokens=7, ignore_eos=True)
        outputs, usages = [], []
        with grpc.insecure_channel(daemon.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            for request_id in ("m", "m2"):
                responses = list(stub.Generate(new_request_to_pb(request_id, prompt, params), timeout=60))
                outputs.append([t for r in responses for t in r.token_ids])
                usages.append(responses[-1].usage)
            load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        assert len(outputs[0]) == 7 and outputs[1] == outputs[0]
        assert [u.cached_tokens for u in usages] == [0, 16]
        assert (load.kv_blocks_used, load.kv_blocks_cached) == (0, 3)  # two prompt blocks and one decoded
        with urllib.request.urlopen(f"http://{match.group(1)}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert [name for name in ENGINE_FAMILIES if f"# TYPE {name} " not in text] == []
    scraped = samples(text)
    assert value(scraped, "dualpace_generation_tokens_total", engine="gpu") == 14  # warm-up is not counted
    assert value(scraped, "dualpace_prompt_tokens_total", engine="gpu") == 2 * len(prompt)
    assert value(scraped, "dualpace_prefix_cache_queries_total", engine="gpu", medium="gpu") == 2 * len(prompt)
    assert value(scraped, "dualpace_prefix_cache_hits_total", engine="gpu", medium="gpu") == 16
    assert value(scraped, "dualpace_kv_blocks_cached", engine="gpu") == 3
    assert value(scraped, "dualpace_requests_total", engine="gpu", finish_reason="length") == 2
    assert value(scraped, "dualpace_time_to_first_token_seconds_count", engine="gpu") == 2
    assert value(scraped, "dualpace_inter_token_latency_seconds_count", engine="gpu") == 12
    assert value(scraped, "dualpace_iteration_latency_seconds_count", engine="gpu", mode="gpu") >= 7
    assert value(scraped, "dualpace_kv_blocks_total", engine="gpu") == 64
    assert value(scraped, "dualpace_kv_blocks_used", engine="gpu") == 0
    assert value(scraped, "dualpace_num_requests_running", engine="gpu") == 0


def test_router_exposes_metrics_by_engine(synth_checkpoint):
    folder = str(synth_checkpoint("tiny-llama"))
    gpu = start_daemon("gpu_service", "--model", folder, "--dtype", "fp32", "--threads", "1", "--kv-blocks", "64")
    router = None
    try:
        router = start_daemon("router", "serve", "--gpu", gpu.address, "--model", folder, "--metrics-port", "0")
        match = re.search(r"router metrics on (\S+)", router.log())
        assert match, router.log()
        message = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7]),
                                             sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
        with grpc.insecure_channel(router.address) as channel:
            responses = list(router_pb2_grpc.RouterStub(channel).Generate(message, timeout=60))
        assert sum(len(r.token_ids) for r in responses) == 4
        with urllib.request.urlopen(f"http://{match.group(1)}/metrics", timeout=5) as response:
            scraped = samples(response.read().decode())
    finally:
        if router is not None:
            assert router.stop() == 0, router.log()
        assert gpu.stop() == 0, gpu.log()
    assert value(scraped, "dualpace_generation_tokens_total", engine="gpu") == 4
    assert value(scraped, "dualpace_prompt_tokens_total", engine="gpu") == 3
    assert value(scraped, "dualpace_requests_total", engine="gpu", finish_reason="length") == 1
    assert value(scraped, "dualpace_e2e_request_latency_seconds_count", engine="gpu") == 1
    assert value(scraped, "dualpace_router_engine_healthy", engine="gpu") == 1
    assert ("dualpace_num_requests_running", (("engine", "gpu"),)) not in scraped  # engine state: engines only
