"""Conversions for the dualpace.v1.Engine service: engine core types <-> protobuf.

Part of the wire layer (with common.py): servicers and clients of the Engine
service convert here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpace import __version__
from dualpace.engine.channel import ChannelUpdate
from dualpace.engine.transfer.kv_transfer import KvLayout, KvTransferHeader, PrefixCopy
from dualpace.errors import InvalidArgument
from dualpace.engine.load import EngineLoad, RequestSummary
from dualpace.engine.request import EngineRequest, RequestState
from dualpace.policy.views import EngineView
from dualpace.wire.common import (
    finish_reason_from_pb,
    finish_reason_to_pb,
    sampling_params_from_pb,
    sampling_params_to_pb,
    token_ids_to_list,
)
from dualpace.wire.logprob_messages import logprobs_list_from_pb, logprobs_list_to_pb, token_logprobs_to_pb
from dualpace.wire.v1 import common_pb2, engine_pb2

ENGINE_KIND_TO_PB = {"gpu": common_pb2.ENGINE_KIND_GPU, "cpu": common_pb2.ENGINE_KIND_CPU}
ENGINE_KIND_FROM_PB = {value: name for name, value in ENGINE_KIND_TO_PB.items()}
_STATE_TO_PB = {
    RequestState.WAITING: common_pb2.REQUEST_STATE_WAITING,
    RequestState.RUNNING: common_pb2.REQUEST_STATE_RUNNING,
    RequestState.PAUSED: common_pb2.REQUEST_STATE_PAUSED,
    RequestState.FINISHED: common_pb2.REQUEST_STATE_FINISHED,
}
_STATE_FROM_PB = {value: state for state, value in _STATE_TO_PB.items()}


def generate_response_to_pb(
    request_id: str, update: ChannelUpdate, engine_name: str, num_prompt_tokens: int, num_output_tokens: int,
    num_cached_tokens: int = 0,
) -> engine_pb2.EngineGenerateResponse:
    message = engine_pb2.EngineGenerateResponse(
        request_id=request_id,
        token_ids=list(update.new_token_ids),
        first_token_index=update.first_token_index,
        finish_reason=finish_reason_to_pb(update.finish_reason),
        engine=engine_name,
        migrated_to=update.migrated_to or "",
        logprobs=logprobs_list_to_pb(update.logprobs, update.new_token_ids),
        prompt_logprobs=[token_logprobs_to_pb(entry, entry.token_id) for entry in update.prompt_logprobs or ()],
    )
    if update.finish_reason is not None:
        message.usage.prompt_tokens = num_prompt_tokens
        message.usage.completion_tokens = num_output_tokens
        message.usage.cached_tokens = num_cached_tokens
    return message


def generate_update_from_pb(message: engine_pb2.EngineGenerateResponse) -> ChannelUpdate:
    return ChannelUpdate(
        first_token_index=message.first_token_index,
        new_token_ids=tuple(message.token_ids),
        finish_reason=finish_reason_from_pb(message.finish_reason),
        migrated_to=message.migrated_to or None,
        num_cached_tokens=message.usage.cached_tokens if message.HasField("usage") else None,
        logprobs=_aligned_logprobs(message),
        prompt_logprobs=logprobs_list_from_pb(message.prompt_logprobs) if message.prompt_logprobs else None,
    )


def _aligned_logprobs(message: engine_pb2.EngineGenerateResponse) -> tuple:
    if message.logprobs and len(message.logprobs) != len(message.token_ids):
        raise ValueError(f"logprobs: {len(message.logprobs)} entries for {len(message.token_ids)} token_ids")
    return logprobs_list_from_pb(message.logprobs)


def new_request_from_pb(message: engine_pb2.NewEngineRequest):
    """(request_id, prompt_token_ids, SamplingParams) of a new request (its
    num_prior_output_tokens is read apart, from the message)."""
    return (
        message.request_id,
        token_ids_to_list(message.prompt_token_ids, field="prompt_token_ids"),
        sampling_params_from_pb(message.sampling),
    )


def new_request_to_pb(request_id: str, prompt_token_ids, params, keep_running_on_disconnect: bool = False,
                      num_prior_output_tokens: int = 0,
                      hold_after_first_token: bool = False) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        new_request=engine_pb2.NewEngineRequest(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=sampling_params_to_pb(params),
            keep_running_on_disconnect=keep_running_on_disconnect, num_prior_output_tokens=num_prior_output_tokens,
            hold_after_first_token=hold_after_first_token,
        )
    )


@dataclass(frozen=True)
class NewRequestOptions:
    """How a new request runs, beside its prompt and sampling (NewEngineRequest's other fields)."""

    keep_running_on_disconnect: bool
    num_prior_output_tokens: int
    hold_after_first_token: bool  # paused after its first token for the router's hand-off


def new_request_options_from_pb(message: engine_pb2.NewEngineRequest) -> NewRequestOptions:
    return NewRequestOptions(message.keep_running_on_disconnect, message.num_prior_output_tokens,
                             message.hold_after_first_token)


def resume_request_to_pb(request_id: str, from_token_index: int) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        resume=engine_pb2.ResumeEngineRequest(request_id=request_id, from_token_index=from_token_index))


def load_to_pb(load: EngineLoad) -> engine_pb2.LoadSnapshot:
    return engine_pb2.LoadSnapshot(
        engine=load.name,
        kind=ENGINE_KIND_TO_PB.get(load.kind, common_pb2.ENGINE_KIND_UNSPECIFIED),
        serving=load.serving,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        kv_blocks_total=load.kv_blocks_total,
        kv_blocks_used=load.kv_blocks_used,
        block_size=load.block_size,
        itl_p50_ms=load.itl_p50_ms,
        itl_p99_ms=load.itl_p99_ms,
        num_iterations=load.num_iterations,
        timestamp_unix_ms=load.timestamp_unix_ms,
        kv_blocks_cached=load.kv_blocks_cached,
        num_preemptions=load.num_preemptions,
    )


def request_info_to_pb(request: EngineRequest, num_kv_blocks: int) -> engine_pb2.RequestInfo:
    return engine_pb2.RequestInfo(
        request_id=request.request_id,
        state=request_state_to_pb(request.state),
        prompt_tokens=len(request.prompt_token_ids),
        generated_tokens=len(request.output_token_ids),
        kv_blocks=num_kv_blocks,
    )


def request_summary_from_pb(message: engine_pb2.RequestInfo) -> RequestSummary:
    return RequestSummary(request_id=message.request_id, state=_STATE_FROM_PB.get(message.state),
                          prompt_tokens=message.prompt_tokens, generated_tokens=message.generated_tokens,
                          kv_blocks=message.kv_blocks)


def request_state_to_pb(state: RequestState | None) -> int:
    return _STATE_TO_PB.get(state, common_pb2.REQUEST_STATE_UNSPECIFIED)


def engine_view_from_pb(snapshot: engine_pb2.LoadSnapshot, expected_kind: str) -> EngineView:
    """The router's view of an engine from its load snapshot (`expected_kind` when it names none)."""
    return EngineView(
        name=snapshot.engine,
        kind=ENGINE_KIND_FROM_PB.get(snapshot.kind, expected_kind),
        healthy=snapshot.serving,
        kv_blocks_total=snapshot.kv_blocks_total,
        kv_blocks_used=snapshot.kv_blocks_used,
        block_size=snapshot.block_size,
        num_running=snapshot.num_running,
        num_waiting=snapshot.num_waiting,
        itl_p50_ms=snapshot.itl_p50_ms,
        itl_p99_ms=snapshot.itl_p99_ms,
        kv_blocks_cached=snapshot.kv_blocks_cached,
        num_preemptions=snapshot.num_preemptions,
    )


def kv_layout_to_pb(layout: KvLayout) -> engine_pb2.KvLayout:
    return engine_pb2.KvLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, block_size=layout.block_size, dtype=layout.dtype)


def kv_layout_from_pb(layout: engine_pb2.KvLayout) -> KvLayout:
    return KvLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype)


def kv_header_to_pb(header: KvTransferHeader) -> engine_pb2.ImportKvMessage:
    message = engine_pb2.ImportKvMessage()
    # Filled in place: a header built apart and passed in would be copied, its token ids included
    # (12 us of a 1024-token header's 40, on a transfer's path).
    fields = message.header
    fields.request_id = header.request_id
    fields.prompt_token_ids.extend(header.prompt_token_ids)
    fields.output_token_ids.extend(header.output_token_ids)
    fields.sampling.CopyFrom(sampling_params_to_pb(header.params))
    fields.num_computed_tokens = header.num_computed_tokens
    fields.num_tokens_emitted = len(header.output_token_ids)
    fields.layout.CopyFrom(kv_layout_to_pb(header.layout))
    fields.total_bytes = header.total_bytes
    fields.source_engine = header.source_engine
    fields.num_cached_tokens = header.num_cached_tokens
    fields.cache_only = header.cache_only
    fields.cache_salt = header.cache_salt
    fields.num_prior_output_tokens = header.num_prior_output_tokens
    fields.skip_cached = header.skip_cached
    return message


def kv_header_from_pb(message: engine_pb2.ImportKvHeader) -> KvTransferHeader:
    if not message.HasField("sampling") or not message.sampling.HasField("seed"):
        raise ValueError("header.sampling: the request's seed must be set")
    return KvTransferHeader(
        request_id=message.request_id,
        # uint32 fields hold valid ids already (the importer checks them against its vocabulary)
        prompt_token_ids=tuple(message.prompt_token_ids),
        output_token_ids=tuple(message.output_token_ids),
        params=sampling_params_from_pb(message.sampling),
        num_computed_tokens=message.num_computed_tokens,
        layout=kv_layout_from_pb(message.layout),
        total_bytes=message.total_bytes,
        source_engine=message.source_engine,
        num_cached_tokens=message.num_cached_tokens,
        cache_only=message.cache_only,
        cache_salt=message.cache_salt,
        num_prior_output_tokens=message.num_prior_output_tokens,
        skip_cached=message.skip_cached,
    )


def cache_held_to_pb(num_held_tokens: int) -> engine_pb2.ImportKvReply:
    return engine_pb2.ImportKvReply(cache_held=engine_pb2.ImportKvCacheHeld(num_held_tokens=num_held_tokens))


def copy_prefix_request_to_pb(token_ids: list[int], target_address: str) -> engine_pb2.CopyPrefixRequest:
    return engine_pb2.CopyPrefixRequest(token_ids=token_ids_to_list(token_ids), target_address=target_address)


def copy_prefix_request_from_pb(message: engine_pb2.CopyPrefixRequest) -> tuple[tuple[int, ...], str]:
    """(token ids, target address) of a CopyPrefix call; InvalidArgument for an empty one."""
    if not message.target_address:
        raise InvalidArgument("target_address", "must be set")
    token_ids = tuple(token_ids_to_list(message.token_ids, field="token_ids"))
    if not token_ids:
        raise InvalidArgument("token_ids", "must not be empty")
    return token_ids, message.target_address


def copy_prefix_response_to_pb(copy: PrefixCopy, duration_ms: float) -> engine_pb2.CopyPrefixResponse:
    return engine_pb2.CopyPrefixResponse(num_tokens=copy.num_tokens, num_sent_tokens=copy.num_sent_tokens,
                                         duration_ms=duration_ms, target_engine=copy.target_engine)


def engine_info_to_pb(core) -> engine_pb2.EngineInfo:
    """The identity and model shape of an EngineCore."""
    cfg = core.loaded.config
    model = core.loaded.model
    return engine_pb2.EngineInfo(
        engine=core.config.name,
        kind=ENGINE_KIND_TO_PB[core.config.kind],
        model=core.loaded.name,
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        max_context_tokens=core.loaded.max_context_tokens,
        block_size=core.config.block_size,
        dtype=str(model.dtype).removeprefix("torch."),
        device=str(model.device),
        version=__version__,
        cpu_kernel_variant=core.config.cpu_kernel_variant,
    )


def migrate_out_request_to_pb(request_id: str, target_address: str) -> engine_pb2.MigrateOutRequest:
    return engine_pb2.MigrateOutRequest(request_id=request_id, target_address=target_address)


def migrate_out_response_to_pb(stats, transport: str) -> engine_pb2.MigrateOutResponse:
    """From dualpace.engine.transfer.migration.MigrationStats and the data path the KV took
    ("shm", "tcp", or "none" for a request moved without KV)."""
    return engine_pb2.MigrateOutResponse(target_engine=stats.target_engine, total_bytes=stats.total_bytes,
                                         duration_ms=stats.duration_ms, transport=transport)


def import_prepared_to_pb(progress, num_kv_blocks: int) -> engine_pb2.ImportKvReply:
    """From dualpace.engine.transfer.kv_transfer.ImportProgress, once the KV is verified."""
    return engine_pb2.ImportKvReply(prepared=engine_pb2.ImportKvPrepared(
        total_bytes=progress.num_bytes, kv_blocks=num_kv_blocks))


def import_committed_to_pb(request_id: str, engine_name: str) -> engine_pb2.ImportKvReply:
    return engine_pb2.ImportKvReply(committed=engine_pb2.ImportKvCommitted(request_id=request_id, engine=engine_name))


def abort_request_to_pb(request_id: str) -> engine_pb2.AbortRequest:
    return engine_pb2.AbortRequest(request_id=request_id)


def list_requests_to_pb() -> engine_pb2.ListRequestsRequest:
    return engine_pb2.ListRequestsRequest()


def info_request_to_pb() -> engine_pb2.InfoRequest:
    return engine_pb2.InfoRequest()


def watch_load_request_to_pb(interval_ms: int) -> engine_pb2.WatchLoadRequest:
    return engine_pb2.WatchLoadRequest(interval_ms=interval_ms)
