"""The node's load on the worker's /metrics (bridged into Dynamo's): dualpace_ names with a
tier label, and the vLLM names llm-d's endpoint picker scrapes (GPU tier for KV usage)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dynamo_worker.load import NodeLoad, llm_d_gauges


class NodeLoadCollector(Collector):
    def __init__(self, read: Callable[[], NodeLoad | None]):
        self.read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        load = self.read()
        if load is None:
            return []
        requests = GaugeMetricFamily("dualpace_node_requests", "Requests in the node's engines.", labels=["state"])
        requests.add_metric(["running"], load.num_running)
        requests.add_metric(["waiting"], load.num_waiting)
        usage = GaugeMetricFamily("dualpace_node_kv_usage_ratio",
                                  "Share of the tier's KV blocks in use (gpu: the GPU engine's pool, "
                                  "host: the CPU engine's).", labels=["tier"])
        for tier, value in (("gpu", load.gpu), ("host", load.host)):
            if value is not None:
                usage.add_metric([tier], value.usage_ratio)
        families = [requests, usage]
        for name, value in llm_d_gauges(load).items():
            families.append(GaugeMetricFamily(name, f"{name} as vLLM names it (KV usage: GPU tier).", value=value))
        return families
