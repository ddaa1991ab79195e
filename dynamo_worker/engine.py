"""DualPaceEngine: Dynamo's LLMEngine contract over one DualPace node's router.

Dynamo's Worker drives it: from_args (flags), start (reach the router, register the model's
context length and the GPU engine's KV block size), generate (token ids in, token ids out, one
call per request, many at once), abort (cancel the router call, which aborts the request in
its engine), cleanup. A load loop polls the router's ListPlacements and feeds Dynamo's snapshot
publisher (the GPU tier's KV blocks, which Dynamo's router reads) and the worker's /metrics.
With --engine given for the node's engines, both engines' KV events go to Dynamo's
KvEventPublisher (kv_relay, through a PushSource), so its KV router knows which prefixes the node holds.
When the node's router stays unreachable, the worker stops itself (SIGTERM to its own process,
which the Rust Worker turns into a clean unregister), so Dynamo stops routing to a dead node."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
from pathlib import Path

from dynamo.common.backend import EngineConfig, LLMEngine, WorkerConfig
from dynamo.common.backend.engine import LlmRegistration
from dynamo.common.backend.metrics import register_engine_registry
from dynamo.common.backend.publisher import ComponentSnapshot, PushSource
from dynamo.llm import exceptions as dynamo_errors
from prometheus_client import CollectorRegistry

from dualpace.errors import InvalidArgument
from dualpace.serve.auth import read_token_file
from dynamo_worker.engine_client import EngineKvClient
from dynamo_worker.errors import dynamo_error_name, error_message
from dynamo_worker.kv_events import NodeKvView
from dynamo_worker.kv_relay import KvRelay
from dynamo_worker.load import NodeLoad, kv_block_size, node_load
from dynamo_worker.metrics import NodeLoadCollector
from dynamo_worker.requests import dynamo_chunk, node_request_from_dynamo
from dynamo_worker.router_client import RouterClient, RouterError

log = logging.getLogger("dualpace.dynamo")

ROUTER_READY_TIMEOUT_S = 120.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpace-dynamo",
                                description="Serve one DualPace node (its router) as an NVIDIA Dynamo worker")
    p.add_argument("--router", required=True, help="the node's router, HOST:PORT (printed by `dualpace up`)")
    p.add_argument("--model-path", required=True, type=Path,
                   help="Hugging Face-style folder with tokenizer.json, tokenizer_config.json and config.json "
                        "(for a GGUF model: `dualpace model export --tokenizer-only`); the frontend tokenizes from it")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the folder's name)")
    p.add_argument("--router-auth-token-file", default=None, help="the router's --auth-token-file")
    p.add_argument("--engine", action="append", default=[], metavar="ADDRESS",
                   help="an engine of the node (gpu_service, cpu_service: HOST:PORT or unix:PATH, as `dualpace up` "
                        "prints them), repeated; their KV events go to Dynamo's KV router (none: no KV events)")
    p.add_argument("--engine-auth-token-file", default=None,
                   help="the engines' --auth-token-file (default: --router-auth-token-file)")
    p.add_argument("--namespace", default="dynamo")
    p.add_argument("--component", default="dualpace")
    p.add_argument("--endpoint", default="generate")
    p.add_argument("--endpoint-types", default="chat,completions")
    p.add_argument("--discovery-backend", default="etcd", choices=["etcd", "file", "kubernetes", "mem"],
                   help="Dynamo's discovery (file: a folder named by DYN_FILE_KV, one host)")
    p.add_argument("--request-plane", default="tcp", choices=["tcp", "nats"])
    p.add_argument("--event-plane", default=None, choices=["nats", "zmq"])
    p.add_argument("--load-interval-s", type=float, default=0.5, help="how often the node's load is read")
    p.add_argument("--router-lost-after-s", type=float, default=5.0,
                   help="stop the worker when the router has not answered for this long")
    return p


def check_model_path(folder: Path) -> int:
    """The folder's context length; InvalidArgument when it is not a tokenizer folder."""
    missing = [name for name in ("tokenizer.json", "tokenizer_config.json", "config.json")
               if not (folder / name).is_file()]
    if not folder.is_dir() or missing:
        raise InvalidArgument("--model-path", f"{folder} is not a Hugging Face-style folder (missing: "
                              f"{', '.join(missing) or 'the folder'}); for a GGUF model write one with "
                              "`dualpace model export --tokenizer-only`")
    config = json.loads((folder / "config.json").read_text())
    context = config.get("max_position_embeddings")
    if not isinstance(context, int) or context < 2:
        raise InvalidArgument("--model-path", f"{folder / 'config.json'} has no max_position_embeddings")
    return context


def _dynamo_error(name: str, message: str) -> Exception:
    return getattr(dynamo_errors, name, dynamo_errors.Unknown)(message)


class DualPaceEngine(LLMEngine):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.context_length = check_model_path(args.model_path)
        self.served_model_name = args.served_model_name or args.model_path.name
        router_token = read_token_file(args.router_auth_token_file, "--router-auth-token-file")
        self.client = RouterClient(args.router, router_token)
        self.engine_token = (read_token_file(args.engine_auth_token_file, "--engine-auth-token-file")
                             if args.engine_auth_token_file else router_token)
        self.load: NodeLoad | None = None
        self.block_size: int | None = None
        self.kv_relay: KvRelay | None = None
        self._snapshots = None
        self._load_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    @classmethod
    async def from_args(cls, argv: list[str] | None = None):
        args = build_parser().parse_args(argv)
        for name in ("load_interval_s", "router_lost_after_s"):
            if getattr(args, name) <= 0:
                raise InvalidArgument(f"--{name.replace('_', '-')}", "must be > 0")
        for address in args.engine:
            if not (address.startswith("unix:") and len(address) > 5) and not address.rpartition(":")[2].isdigit():
                raise InvalidArgument("--engine", f"{address!r} is not HOST:PORT or unix:PATH")
        engine = cls(args)
        config = WorkerConfig(
            namespace=args.namespace, component=args.component, endpoint=args.endpoint,
            model_name=str(args.model_path.resolve()), served_model_name=engine.served_model_name,
            endpoint_types=args.endpoint_types, discovery_backend=args.discovery_backend,
            request_plane=args.request_plane, event_plane=args.event_plane,
        )
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        del worker_id
        try:
            await self.client.wait_ready(ROUTER_READY_TIMEOUT_S)
            placements = await self.client.placements()
        except RouterError as exc:
            raise _dynamo_error("EngineShutdown", error_message(exc.code_name, exc.details, self.args.router)) from None
        self.load = node_load(placements)
        self.block_size = kv_block_size(placements)
        self._loop = asyncio.get_running_loop()
        self._load_task = asyncio.create_task(self._watch_load())
        gpu = self.load.gpu
        log.info("dualpace-dynamo: node %s ready (context %d, block size %s)", self.args.router,
                 self.context_length, self.block_size)
        return EngineConfig(
            model=str(self.args.model_path.resolve()), served_model_name=self.served_model_name,
            llm=LlmRegistration(context_length=self.context_length, kv_cache_block_size=self.block_size,
                                total_kv_blocks=gpu.kv_blocks_total if gpu is not None else None),
        )

    async def generate(self, request, context):
        request_id = context.id()
        try:
            node_request = node_request_from_dynamo(request, self.context_length)
        except InvalidArgument as exc:
            raise dynamo_errors.InvalidArgument(str(exc)) from None
        num_prompt = len(node_request.prompt_token_ids)
        streamed = finished = False
        try:
            async for piece in self.client.generate(request_id, node_request.prompt_token_ids, node_request.params):
                chunk = dynamo_chunk(piece, num_prompt)
                streamed = streamed or bool(chunk["token_ids"])
                finished = "finish_reason" in chunk
                yield chunk
                if finished:
                    return
        except RouterError as exc:
            raise _dynamo_error(dynamo_error_name(exc.code_name, streamed),
                                error_message(exc.code_name, exc.details, self.args.router)) from None
        if not finished and not context.is_stopped():
            raise dynamo_errors.StreamIncomplete(f"dualpace node {self.args.router}: the stream ended without a finish")

    async def abort(self, context) -> None:
        self.client.cancel(context.id())

    async def cleanup(self) -> None:
        self._closing = True
        if self.kv_relay is not None:
            await self.kv_relay.close()
        if self._load_task is not None:
            self._load_task.cancel()
            self._load_task = None
        await self.client.close()

    # ---- KV events ----

    async def kv_event_sources(self) -> list:
        if not self.args.engine:
            log.info("dualpace-dynamo: no --engine given: no KV events (Dynamo's KV router weighs load only)")
            return []
        if not self.block_size:
            log.warning("dualpace-dynamo: the node reports no KV block size: no KV events")
            return []
        return [PushSource(on_ready=self._on_kv_publisher, dp_rank=0)]

    def _on_kv_publisher(self, publisher) -> None:
        """Dynamo's Worker hands over the publisher (possibly from another thread)."""
        self._loop.call_soon_threadsafe(self._start_kv_relay, publisher)

    def _start_kv_relay(self, publisher) -> None:
        if self._closing or self.kv_relay is not None:
            return
        clients = [EngineKvClient(address, self.engine_token) for address in self.args.engine]
        self.kv_relay = KvRelay(NodeKvView(self.block_size), publisher.publish_batch, clients)
        self.kv_relay.start()
        log.info("dualpace-dynamo: relaying the KV events of %s (block size %d)", ", ".join(self.args.engine),
                 self.block_size)

    # ---- load signals ----

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher) -> None:
        self._snapshots = publisher

    async def register_prometheus(self, metrics) -> None:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(NodeLoadCollector(lambda: self.load))
        register_engine_registry(metrics, registry)

    async def _watch_load(self) -> None:
        loop = asyncio.get_running_loop()
        last_answer = loop.time()
        while True:
            await asyncio.sleep(self.args.load_interval_s)
            try:
                self.load = node_load(await self.client.placements(timeout_s=self.args.load_interval_s * 4))
                last_answer = loop.time()
            except RouterError as exc:
                if loop.time() - last_answer > self.args.router_lost_after_s:
                    log.error("dualpace-dynamo: router %s lost (%s); stopping this worker", self.args.router, exc)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                continue
            gpu = self.load.gpu
            if self._snapshots is not None and gpu is not None:
                self._snapshots.publish(0, ComponentSnapshot(kv_used_blocks=gpu.kv_blocks_used,
                                                             kv_total_blocks=gpu.kv_blocks_total,
                                                             gpu_cache_usage=gpu.usage_ratio, dp_rank=0))
