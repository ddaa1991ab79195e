"""The soak's extra chaos, run on a thread beside the load (bench/soak.py):

- **orphans**: a second router on the same engines takes a few long requests and is SIGKILLed,
  not restarted; the engines must drop them within their orphan lease (`--orphan-timeout-s`),
  checked by ListRequests at the end;
- **a stalled assist client**: a Dense Assist session to gpu_service whose first layer's attention
  never returns; the server must end it on `--assist-idle-timeout-s` while the load goes
  on (ungated: a gated session would hold the device for that long by design, which
  tests/gpu_service/test_assist_stall.py covers);
- **a 10 MB prompt** through the soak's router while a probe stream runs: refused with
  RESOURCE_EXHAUSTED by gRPC ("larger than max": the router's receive bound, `--max-request-bytes`)
  before the router reads it; then **a prompt one character over `--max-prompt-chars`** (1 MiB),
  within that bound, refused by the router with INVALID_ARGUMENT naming the limit. Reported for
  each (figures, not a verdict: the machine is shared and the probe may be handed off or
  migrated) are its probe's largest gap between two tokens over its median: over the whole
  probe, over the gaps overlapping the call, and over a stretch as long just before it (the
  noise floor of the same stream);
- **threads and file descriptors** of every daemon, counted after the warm-up (for a restarted
  engine: after its own warm-up) and at the end.

Each check adds to `problems` when it fails; `summary()` goes into the result's "chaos" object.
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
import time

import grpc
import torch

from router.prompt_work import DEFAULT_MAX_PROMPT_CHARS
from toolkit.processes import Daemon, start_daemon
from cpu_service.assist_client import AssistClient, AssistUnavailable
from dualpace.wire.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

NUM_ORPHANS = 3
ORPHAN_MAX_TOKENS = 280  # with a 10 ms step floor: about 3 s, beyond the soak's short lease
HUGE_PROMPT_CHARS = 10_000_000  # beyond the router's gRPC receive bound: refused before the router reads it
LONG_PROMPT_CHARS = DEFAULT_MAX_PROMPT_CHARS + 1  # within that bound, one character over --max-prompt-chars
PROBE_MAX_TOKENS = 120
PROBE_TOKENS_BEFORE = 40  # the probe's tokens before the prompt is sent
HANG_GUARD_S = 60.0
ASSIST_SESSION_ENDED = "dense assist session ended"  # gpu_service's log line when it ends a session
MAX_FD_GROWTH = 16  # slack for lazily opened files (metrics, sockets of reconnecting channels)
MAX_THREAD_GROWTH = 8  # slack for worker pools that grow to their bound on first use


def count_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def count_threads(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _generate(stub, request_id: str, prompt: list[int] | None, max_tokens: int, text: str | None = None):
    request = router_pb2.GenerateRequest(request_id=request_id, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))
    if text is not None:
        request.text = text
    else:
        request.prompt_token_ids.token_ids.extend(prompt)
    return stub.Generate(request, timeout=HANG_GUARD_S)


class Chaos:
    def __init__(self, soak) -> None:
        self.soak = soak
        self.problems: list[str] = []
        self.orphans: dict = {}
        self.assist_stall: dict = {}
        self.huge_prompt: dict = {}
        self.long_prompt: dict = {}
        self.counts: dict[str, dict] = {}

    # -- scheduling --------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Threads and descriptors counted after the warm-up; then at 20%, 35% and 55% of the
        load one action each (unless the load ended first)."""
        duration_s = self.soak.args.duration_s
        while self.soak.clock() < self.soak.args.warmup_s:
            if stop.wait(0.2):
                return
        self.sample("start")
        for fraction, action in ((0.2, self.kill_a_router), (0.35, self.stall_an_assist_session),
                                 (0.8, self.send_oversized_prompts)):  # away from the engine restart at 50%
            while self.soak.clock() < fraction * duration_s:
                if stop.wait(0.2):
                    return
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - a broken action is a problem to report, not a crash
                self.problems.append(f"chaos {action.__name__} failed: {type(exc).__name__}: {exc}")
        while not stop.wait(0.5):  # a restarted engine: counted again once the soak has its RSS baseline
            for role, slot in self.soak.slots.items():
                entry = self.counts.get(role, {})
                if entry.get("pid") != slot.daemon.process.pid and slot.rss_start_kib is not None:
                    self.sample_one(role, "start")

    def sample(self, which: str) -> None:
        for role in self.soak.slots:
            self.sample_one(role, which)

    def sample_one(self, role: str, which: str) -> None:
        pid = self.soak.slots[role].daemon.process.pid
        entry = self.counts.setdefault(role, {})
        if which == "start":
            entry.clear()
            entry.update(pid=pid, fds_start=count_fds(pid), threads_start=count_threads(pid))
        elif entry.get("pid") == pid:  # else restarted since its start was counted: not comparable
            entry.update(fds_end=count_fds(pid), threads_end=count_threads(pid))

    # -- the actions -------------------------------------------------------------------------------

    def kill_a_router(self) -> None:
        slots = self.soak.slots
        doomed = start_daemon("router", "serve", "--gpu", slots["gpu"].daemon.address, "--cpu",
                              slots["cpu"].daemon.address, "--model", self.soak.model, "--no-migrate")
        channel = grpc.insecure_channel(doomed.address)
        stub = router_pb2_grpc.RouterStub(channel)
        ids = [f"orphan-{i}" for i in range(NUM_ORPHANS)]
        calls = [_generate(stub, rid, [7 + i, 11, 13, 17, 19, 23, 29, 31], ORPHAN_MAX_TOKENS)
                 for i, rid in enumerate(ids)]
        first_tokens = []
        for call in calls:  # each has started streaming: it is running on an engine
            try:
                first_tokens.append(next(iter(call)).token_ids is not None)
            except (grpc.RpcError, StopIteration):
                first_tokens.append(False)
        doomed.kill()
        channel.close()
        self.orphans = {"request_ids": ids, "streaming_when_killed": sum(first_tokens),
                        "killed_at_s": round(self.soak.clock(), 1)}

    def stall_an_assist_session(self) -> None:
        """An ungated assist session whose first layer's attention never returns: the server hears
        nothing more through its rings and must end the session on its idle timeout."""
        gpu = self.soak.slots["gpu"].daemon
        num_ended = gpu.log().count(ASSIST_SESSION_ENDED)
        in_attend, release = threading.Event(), threading.Event()
        outcome: dict = {}

        def stalled_attend(layer, q, k, v):
            in_attend.set()
            release.wait(HANG_GUARD_S)
            return torch.zeros(q.shape[0], q[0].numel())

        def run() -> None:
            with AssistClient(gpu.address, iteration_timeout_s=HANG_GUARD_S) as client:
                try:
                    client.run_iteration([1, 2], [0, 0], stalled_attend)
                    outcome["error"] = None
                except AssistUnavailable as exc:
                    outcome["error"] = str(exc)

        started = time.monotonic()
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        reached = in_attend.wait(HANG_GUARD_S)
        deadline = time.monotonic() + HANG_GUARD_S
        ended_line = None
        while reached and ended_line is None and time.monotonic() < deadline:
            lines = [line for line in gpu.log().splitlines() if ASSIST_SESSION_ENDED in line]
            if len(lines) > num_ended:
                ended_line = lines[-1]
            else:
                time.sleep(0.1)  # polling the daemon's log, bounded by the deadline
        release.set()
        worker.join(HANG_GUARD_S)
        by_idle_timeout = ended_line is not None and "--assist-idle-timeout-s" in ended_line
        self.assist_stall = {"reached_attention": reached, "ended_by_idle_timeout": by_idle_timeout,
                             "client_error": outcome.get("error"),
                             "ended_after_s": round(time.monotonic() - started, 1)}
        if not by_idle_timeout:
            self.problems.append(f"the stalled assist session did not end on the idle timeout: {ended_line!r}")
        if outcome.get("error") is None:
            self.problems.append("the stalled assist session's iteration did not fail after the server ended it")

    def send_oversized_prompts(self) -> None:
        """A 10 MB prompt, then one of --max-prompt-chars + 1 characters, each beside a probe stream."""
        self.huge_prompt = self._refuse_beside_a_probe(
            "chaos-huge", HUGE_PROMPT_CHARS, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
        self.long_prompt = self._refuse_beside_a_probe(
            "chaos-long", LONG_PROMPT_CHARS, grpc.StatusCode.INVALID_ARGUMENT, "--max-prompt-chars")

    def _refuse_beside_a_probe(self, request_id: str, num_chars: int, code_expected: grpc.StatusCode,
                               named: str) -> dict:
        """Sends a text prompt of num_chars while a probe stream runs; the prompt must be refused
        with code_expected and a detail naming `named`. Returns the figures: the probe's largest
        gap between two tokens over its median, over the whole probe, over the gaps overlapping
        the call and over a stretch as long just before it."""
        with grpc.insecure_channel(self.soak.slots["router"].daemon.address,
                                   options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            arrivals: list[float] = []
            probe = _generate(stub, f"{request_id}-probe", [5, 6, 7, 8], PROBE_MAX_TOKENS)

            def read_probe() -> None:
                try:
                    for response in probe:
                        arrivals.extend([time.monotonic()] * len(response.token_ids))
                except grpc.RpcError:
                    pass

            reader = threading.Thread(target=read_probe, daemon=True)
            reader.start()
            while len(arrivals) < PROBE_TOKENS_BEFORE and reader.is_alive():  # a stretch to compare with
                time.sleep(0.01)
            code, detail = None, ""
            # Serialized beforehand, so that the time measured is the router's, not this process's
            # (it reads the probe too, and building 10 MB of protobuf here would hold its GIL).
            text = ("lorem ipsum " * (num_chars // 12 + 1))[:num_chars]
            data = router_pb2.GenerateRequest(request_id=request_id, text=text,
                                              sampling=common_pb2.SamplingParams(max_tokens=4)).SerializeToString()
            call = channel.unary_stream("/dualpace.v1.Router/Generate", request_serializer=lambda b: b,
                                        response_deserializer=router_pb2.GenerateResponse.FromString)
            sent_at = time.monotonic()
            try:
                for _ in call(data, timeout=HANG_GUARD_S):
                    pass
            except grpc.RpcError as exc:
                code, detail = exc.code(), exc.details() or ""
            answered_at = time.monotonic()
            reader.join(HANG_GUARD_S)
        gaps = [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:]) if b > a]
        median = statistics.median(g for g, _, _ in gaps) if gaps else None
        during = [g for g, start, end in gaps if end >= sent_at and start <= answered_at]  # overlapping the call
        before = [g for g, _, end in gaps if sent_at - max(answered_at - sent_at, 0.2) <= end < sent_at]
        if code != code_expected or named not in detail:
            self.problems.append(f"the {len(data)}-byte prompt got {code} ({detail[:80]!r}), not "
                                 f"{code_expected.name} naming {named!r}")
        if len(arrivals) != PROBE_MAX_TOKENS:
            self.problems.append(f"the probe stream beside the {len(data)}-byte prompt got {len(arrivals)} of "
                                 f"{PROBE_MAX_TOKENS} tokens")
        return {
            "bytes": len(data), "code": None if code is None else code.name, "detail": detail[:160],
            "probe_tokens": len(arrivals), "call_s": round(answered_at - sent_at, 3),
            "probe_gap_median_ms": round(median * 1e3, 2) if median else None,
            "probe_gap_max_over_median": round(max(g for g, _, _ in gaps) / median, 2) if median else None,
            "probe_gap_max_during_call_over_median": round(max(during) / median, 2) if median and during else None,
            # the same over a stretch as long as the call (at least 0.2 s) just before it: the noise floor
            "probe_gap_max_before_call_over_median": round(max(before) / median, 2) if median and before else None,
        }

    # -- the verdict -------------------------------------------------------------------------------

    def verify(self, lease_s: float) -> None:
        """After the load: the orphans are gone from both engines (within the lease plus a hang
        guard), and no daemon's threads or descriptors grew past the slack."""
        if self.orphans:
            ids = set(self.orphans["request_ids"])
            deadline = time.monotonic() + lease_s + HANG_GUARD_S
            left = ids
            while time.monotonic() < deadline:
                left = ids & self._listed_everywhere()
                if not left:
                    break
                time.sleep(0.2)
            self.orphans["left_on_engines"] = sorted(left)
            if left:
                self.problems.append(f"orphaned requests still on the engines: {sorted(left)}")
            self.orphans["aborted_by_lease"] = sum(
                slot.daemon.log().count("orphaned request aborted") for role, slot in self.soak.slots.items()
                if role != "router")
        for role, entry in self.counts.items():
            for kind, slack in (("fds", MAX_FD_GROWTH), ("threads", MAX_THREAD_GROWTH)):
                start, end = entry.get(f"{kind}_start"), entry.get(f"{kind}_end")
                if start is not None and end is not None and end - start > slack:
                    self.problems.append(f"{role}: {kind} grew from {start} to {end} (slack {slack})")

    def _listed_everywhere(self) -> set[str]:
        listed: set[str] = set()
        for role in ("gpu", "cpu"):
            daemon: Daemon = self.soak.slots[role].daemon
            with grpc.insecure_channel(daemon.address) as channel:
                try:
                    reply = engine_pb2_grpc.EngineStub(channel).ListRequests(engine_pb2.ListRequestsRequest(),
                                                                             timeout=10)
                except grpc.RpcError:
                    continue
            listed |= {info.request_id for info in reply.requests}
        return listed

    def summary(self) -> dict:
        return {"orphans": self.orphans, "assist_stall": self.assist_stall, "huge_prompt": self.huge_prompt,
                "long_prompt": self.long_prompt,
                "threads_and_fds": self.counts, "problems": self.problems}
