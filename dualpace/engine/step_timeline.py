"""Step timelines: one record per engine step, kept in a bounded ring and, with
`--step-timeline PATH`, written as JSON lines by a writer thread (never by the step thread).

A record says when a step ran (`time.monotonic_ns`: CLOCK_MONOTONIC, one clock for every
daemon on a host, so two engines' timelines can be laid side by side), how (its mode: gpu,
local, assisted or cooperative) and with whom:

- the GPU engine's record of a step that carried remote rows lists each join as
  `JoinedRows(peer, iteration_id, rows)`, says how the layer loop ran (`how`: JOINED, SPLIT)
  and how long the step blocked on the CPU's attention (`gpu_wait_ns`);
- the CPU engine's record of a cooperative iteration carries the assist `iteration_id` it
  sent and the result's join info: the GPU step that made its token (`engine_step_id`), how,
  the GPU's wait and the GPU step's own start and end; `attention_ns` is the CPU's time
  computing that iteration's attention, the denominator of the GPU-wait share.

bench/cooperative_timeline.py reads both daemons' files and checks gated's two points on them.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO

from dualpace.errors import InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_RING_RECORDS = 4096  # records kept in memory (the newest)
DEFAULT_MAX_PENDING_RECORDS = 65536  # records waiting for the writer; past it the oldest are dropped
FLUSH_INTERVAL_S = 0.2
MODES = ("gpu", "local", "assisted", "cooperative")
HOWS = ("", "JOINED", "SPLIT", "STAGED")  # "": the step carried no remote rows


@dataclass(frozen=True)
class JoinedRows:
    """One assisted CPU iteration's rows inside a GPU step."""

    peer: str  # the CPU engine as the GPU side knows it (its stream)
    iteration_id: int  # AssistBegin.iteration_id
    rows: int


@dataclass(frozen=True)
class StepRecord:
    engine: str
    step_id: int
    start_ns: int
    end_ns: int
    mode: str
    num_own_rows: int
    joins: tuple[JoinedRows, ...] = ()
    how: str = ""
    gpu_wait_ns: int = 0
    # A joined GPU step: its time in the work that overlaps the CPU's attention (S0's layers, D1's
    # attention), summed over layers (SplitForward.last_cover_s).
    cover_ns: int = 0
    # A joined GPU step's per-layer round trips, summed over its joins' stamped layers
    # (dualpace/engine/assist/ring_pacing.py LayerMarks): q/k/v post -> the CPU saw them; the CPU's own time;
    # the GPU's wait before the CPU answered; the CPU's answer -> the GPU's receive returned; and
    # how many of the GPU's waits went to a futex sleep.
    num_marked_layers: int = 0
    down_hop_ns: int = 0
    cpu_layer_ns: int = 0
    wait_before_answer_ns: int = 0
    up_hop_ns: int = 0
    num_wait_sleeps: int = 0
    num_long_waits: int = 0  # of those layers, the GPU waits of 1 ms or more (ring_pacing.LONG_WAIT_NS)
    long_wait_ns: int = 0
    # The step's thread runnable without a core during the step (GPU: the joined step's layers;
    # CPU: the assisted iteration), from /proc/thread-self/schedstat (dualpace/engine/run_delay.py).
    runqueue_delay_ns: int = 0
    num_weight_passes: int = 1
    # The CPU engine's side of a cooperative (or assisted) iteration; None on GPU records.
    num_prefill_rows: int = 0
    iteration_id: int | None = None
    engine_step_id: int | None = None
    engine_step_start_ns: int | None = None
    engine_step_end_ns: int | None = None
    attention_ns: int = 0

    def __post_init__(self) -> None:
        # Modes as ExecutionMode's values (lower case), hows as JoinHow's names (upper case), either given.
        object.__setattr__(self, "mode", str(getattr(self.mode, "value", self.mode)).lower())
        object.__setattr__(self, "how", how_name(self.how))
        object.__setattr__(self, "joins", tuple(self.joins))
        if self.mode not in MODES:
            raise InvalidArgument("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.how not in HOWS:
            raise InvalidArgument("how", f"must be one of {', '.join(h for h in HOWS if h)} or empty, got {self.how!r}")
        if self.end_ns < self.start_ns:
            raise InvalidArgument("end_ns", f"step {self.step_id} of {self.engine} ends before it starts")
        for name in ("num_own_rows", "gpu_wait_ns", "cover_ns", "num_weight_passes", "num_prefill_rows",
                     "attention_ns", "num_marked_layers", "down_hop_ns", "cpu_layer_ns", "wait_before_answer_ns",
                     "up_hop_ns", "num_wait_sleeps", "num_long_waits", "long_wait_ns", "runqueue_delay_ns"):
            if getattr(self, name) < 0:
                raise InvalidArgument(name, f"must be >= 0, got {getattr(self, name)}")

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def is_decode_only(self) -> bool:
        return self.num_own_rows > 0 and self.num_prefill_rows == 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> StepRecord:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgument("step record", f"unknown fields {unknown}")
        joins = tuple(JoinedRows(str(j["peer"]), int(j["iteration_id"]), int(j["rows"])) for j in data.get("joins", ()))
        return cls(**{**data, "joins": joins})


def how_name(how) -> str:
    """JoinHow (an IntEnum: its name), the join desk's lower-case how, or nothing -> a HOWS entry."""
    name = how.name if isinstance(how, enum.Enum) else str(how or "")
    return "" if name.upper() == "UNSPECIFIED" else name.upper()


def assisted_record_fields(iteration_id: int | None, join_info, attention_ns: int, runqueue_delay_ns: int = 0) -> dict:
    """The CPU engine's StepRecord fields of an assisted or cooperative iteration: the assist
    iteration id it sent, the result's join info (AssistJoinInfo: the GPU step that made it and
    that step's times; engine_step_id 0 or no info: it ran staged) and this side's attention time.
    A runner sets them as its `last_step_record_fields`; EngineLoop adds the rest."""
    values = {"iteration_id": iteration_id, "attention_ns": max(0, int(attention_ns)),
              "runqueue_delay_ns": max(0, int(runqueue_delay_ns))}
    if join_info is None or not getattr(join_info, "engine_step_id", 0):
        return values
    return {**values, "how": how_name(join_info.how), "engine_step_id": int(join_info.engine_step_id),
            "engine_step_start_ns": int(join_info.step_start_ns), "engine_step_end_ns": int(join_info.step_end_ns),
            "gpu_wait_ns": int(join_info.gpu_wait_us) * 1000}


def read_timeline(path: str | Path) -> list[StepRecord]:
    """Every record of a JSON-lines timeline file; a malformed line is an InvalidArgument naming it.
    A last line cut short (the daemon was killed mid-write) is skipped."""
    records: list[StepRecord] = []
    with open(path, encoding="utf-8") as file:
        lines = file.read().split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(StepRecord.from_dict(json.loads(line)))
        except json.JSONDecodeError as exc:
            if number == len(lines):  # no newline after it: a write cut short
                break
            raise InvalidArgument(f"{path}:{number}", f"not JSON: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{path}:{number}", f"not a step record: {exc}") from None
    return records


@dataclass
class StepTimeline:
    """The newest records in memory; with a file, every record goes to the writer thread.
    `append` only takes a lock and appends: the step thread never formats or writes."""

    path: str | None = None
    ring_records: int = DEFAULT_RING_RECORDS
    max_pending_records: int = DEFAULT_MAX_PENDING_RECORDS
    num_dropped: int = 0  # records the writer never got (it fell behind by max_pending_records)
    num_invalid: int = 0  # record_step calls whose fields made no StepRecord (skipped)
    _ring: deque = field(init=False, repr=False)
    _pending: deque = field(init=False, repr=False)
    _wake: threading.Condition = field(init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)
    _writer: threading.Thread | None = field(default=None, init=False, repr=False)
    _file: IO[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.ring_records < 1:
            raise InvalidArgument("ring_records", f"must be >= 1, got {self.ring_records}")
        if self.max_pending_records < 1:
            raise InvalidArgument("max_pending_records", f"must be >= 1, got {self.max_pending_records}")
        self._ring = deque(maxlen=self.ring_records)
        self._pending = deque()
        self._wake = threading.Condition()
        if self.path is not None:
            try:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
            except OSError as exc:
                raise InvalidArgument("--step-timeline", f"cannot open {self.path}: {exc.strerror}") from None
            self._writer = threading.Thread(target=self._write_loop, name="step-timeline", daemon=True)
            self._writer.start()

    def append(self, record: StepRecord) -> None:
        with self._wake:
            self._ring.append(record)
            if self._file is None or self._closed:
                return
            if len(self._pending) >= self.max_pending_records:
                self._pending.popleft()
                self.num_dropped += 1
            self._pending.append(record)
            self._wake.notify()

    def record_step(self, **values) -> StepRecord | None:
        """Build a StepRecord from keyword fields and append it; returns it. Called on the step
        thread, so a record it cannot build is counted and logged once, never raised: a timeline
        must not stop the engine."""
        try:
            record = StepRecord(**values)
        except (InvalidArgument, TypeError, ValueError) as exc:
            self.num_invalid += 1
            if self.num_invalid == 1:
                log.warning("step timeline: a step record could not be built (%s); such records are skipped", exc)
            return None
        self.append(record)
        return record

    def records(self) -> list[StepRecord]:
        """The newest records kept in memory, oldest first."""
        with self._wake:
            return list(self._ring)

    def close(self) -> None:
        """Write what is pending, then close the file (idempotent)."""
        with self._wake:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
        if self._writer is not None:
            self._writer.join()
        if self._file is not None:
            self._file.close()
        if self.num_dropped:
            log.warning("step timeline %s: %d records dropped (the writer fell behind)", self.path, self.num_dropped)

    def _write_loop(self) -> None:
        assert self._file is not None
        while True:
            with self._wake:
                if not self._pending and not self._closed:
                    self._wake.wait(FLUSH_INTERVAL_S)
                batch = list(self._pending)
                self._pending.clear()
                closed = self._closed
            if batch:
                try:
                    self._file.write("".join(record.to_json() + "\n" for record in batch))
                    self._file.flush()
                except OSError:  # a full disk must not stop the engine
                    log.exception("step timeline %s: write failed; records lost", self.path)
            if closed:
                with self._wake:
                    if not self._pending:
                        return
