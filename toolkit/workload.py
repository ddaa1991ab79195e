"""What a benchmark sends and when: length SPECs, JSONL traces, seeded arrivals and prompts. Pure.

A length SPEC is one of
    N                    every request has length N
    LO:HI                uniform over LO..HI, both inclusive
    lognormal:MEAN:SIGMA lognormal with mean MEAN tokens (SIGMA: the sigma of the underlying
                         normal), rounded, at least 1

Every random draw comes from its own `random.Random` stream derived from the seed, so the
lengths and prompts of request i do not depend on the rate (a rate sweep replays the same
trace) and the arrival pattern at rate R is the pattern at rate 1 scaled by 1/R.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from dualpace.errors import InvalidArgument

# Separate streams per purpose (see the module docstring).
_ARRIVALS, _INPUT_LENGTHS, _OUTPUT_LENGTHS, _PROMPTS = 1, 2, 3, 4


@dataclass(frozen=True)
class LengthSpec:
    kind: str  # "fixed" | "uniform" | "lognormal"
    a: float  # fixed: N; uniform: LO; lognormal: MEAN
    b: float = 0.0  # uniform: HI; lognormal: SIGMA

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        mu = math.log(self.a) - self.b**2 / 2  # so that the mean is MEAN
        return max(1, round(rng.lognormvariate(mu, self.b)))


def parse_length_spec(text: str, flag: str) -> LengthSpec:
    """'N', 'LO:HI' or 'lognormal:MEAN:SIGMA' -> LengthSpec; InvalidArgument naming `flag` otherwise."""
    usage = "expected N, LO:HI or lognormal:MEAN:SIGMA"
    parts = text.strip().split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            if n < 1:
                raise InvalidArgument(flag, f"length must be >= 1, got {text!r}")
            return LengthSpec("fixed", n)
        if len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
            if lo < 1 or hi < lo:
                raise InvalidArgument(flag, f"need 1 <= LO <= HI, got {text!r}")
            return LengthSpec("uniform", lo, hi)
        if len(parts) == 3 and parts[0] == "lognormal":
            mean, sigma = float(parts[1]), float(parts[2])
            if not (math.isfinite(mean) and mean >= 1 and math.isfinite(sigma) and sigma >= 0):
                raise InvalidArgument(flag, f"need MEAN >= 1 and SIGMA >= 0, got {text!r}")
            return LengthSpec("lognormal", mean, sigma)
    except ValueError:
        pass
    raise InvalidArgument(flag, f"{usage}, got {text!r}")


@dataclass(frozen=True)
class RequestSpec:
    """One request of a benchmark: when it is due (s after the start) and what it sends."""

    index: int
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def _stream(seed: int, purpose: int) -> random.Random:
    return random.Random(seed * 1_000_003 + purpose)


def arrival_times(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Arrival times (s, the first at 0) of a gamma process: shape 1/burstiness, mean gap 1/rate.
    burstiness 1 is Poisson; above 1 burstier, below 1 more regular. rate inf: all at 0."""
    if not rate > 0:
        raise InvalidArgument("--rate", f"must be > 0, got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise InvalidArgument("--burstiness", f"must be > 0, got {burstiness}")
    rng = _stream(seed, _ARRIVALS)
    times, now = [], 0.0
    for i in range(num_requests):
        if i > 0:
            gap = rng.gammavariate(1.0 / burstiness, burstiness)  # mean 1
            now += gap / rate if math.isfinite(rate) else 0.0
        times.append(now)
    return times


def random_prompt(length: int, vocab_size: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(1, vocab_size) for _ in range(length))


def load_trace(path: str | Path) -> list[tuple]:
    """A JSONL trace -> [(input_len or prompt token ids, output_len)], or, when its lines give
    arrival times, [(input_len or prompt token ids, output_len, arrival_s)]. Each line has
    output_len and either input_len or prompt_token_ids, and optionally arrival_s (seconds after
    the first request is due; all lines or none, non-decreasing); errors name the line."""
    entries = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidArgument("--trace", f"cannot read {path}: {exc.strerror}") from None
    arrivals: list[float | None] = []
    lines_of: list[int] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgument("--trace", f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise InvalidArgument("--trace", f"{where}: expected an object")
        output_len = item.get("output_len")
        if not isinstance(output_len, int) or output_len < 1:
            raise InvalidArgument("--trace", f"{where}: output_len must be an integer >= 1")
        arrival = item.get("arrival_s")
        if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, (int, float))
                                    or not math.isfinite(arrival) or arrival < 0):
            raise InvalidArgument("--trace", f"{where}: arrival_s must be a number >= 0")
        arrivals.append(None if arrival is None else float(arrival))
        lines_of.append(number)
        if "prompt_token_ids" in item:
            ids = item["prompt_token_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
                raise InvalidArgument("--trace", f"{where}: prompt_token_ids must be a non-empty list of ids")
            entries.append((tuple(ids), output_len))
        else:
            input_len = item.get("input_len")
            if not isinstance(input_len, int) or input_len < 1:
                raise InvalidArgument("--trace", f"{where}: needs input_len (integer >= 1) or prompt_token_ids")
            entries.append((input_len, output_len))
    if not entries:
        raise InvalidArgument("--trace", f"{path} has no requests")
    timed = [arrival is not None for arrival in arrivals]
    if any(timed):
        if not all(timed):
            number = lines_of[timed.index(False)]
            raise InvalidArgument("--trace", f"{path}:{number}: arrival_s missing (give it on every line or none)")
        for k in range(1, len(arrivals)):
            if arrivals[k] < arrivals[k - 1]:
                raise InvalidArgument("--trace", f"{path}:{lines_of[k]}: arrival_s goes back in time")
        entries = [(*entry, arrival) for entry, arrival in zip(entries, arrivals)]
    return entries


def trace_has_arrivals(trace: list | None) -> bool:
    return bool(trace) and len(trace[0]) == 3


def write_trace(path: str | Path, specs: list[RequestSpec]) -> None:
    """Write requests as a JSONL trace that load_trace reads back exactly: prompt_token_ids,
    output_len and arrival_s per line (so a replay, or `dualpace sim --trace`, sees the same
    requests at the same times)."""
    Path(path).write_text("".join(json.dumps({"arrival_s": round(s.arrival_s, 9), "output_len": s.output_len,
                                              "prompt_token_ids": list(s.prompt_token_ids)}) + "\n"
                                  for s in specs))


def build_requests(num_requests: int, rate: float, burstiness: float, seed: int, vocab_size: int,
                   input_len: LengthSpec | None = None, output_len: LengthSpec | None = None,
                   trace: list | None = None) -> list[RequestSpec]:
    """The benchmark's requests. With a trace, request i is trace line i mod len(trace); a trace
    with arrival times (see load_trace) also gives when each request is due, rate and
    burstiness are then unused, and num_requests may not exceed its lines."""
    if num_requests < 1:
        raise InvalidArgument("--num-requests", f"must be >= 1, got {num_requests}")
    if vocab_size < 2:
        raise InvalidArgument("--vocab-size", f"must be >= 2, got {vocab_size}")
    if trace is None and (input_len is None or output_len is None):
        raise InvalidArgument("--input-len", "give --input-len and --output-len, or --trace")
    if trace_has_arrivals(trace):
        if num_requests > len(trace):
            raise InvalidArgument("--num-requests", f"the trace gives arrival times for {len(trace)} requests, "
                                  f"got {num_requests}")
        start = trace[0][2]
        times = [entry[2] - start for entry in trace[:num_requests]]
    else:
        times = arrival_times(num_requests, rate, burstiness, seed)
    in_rng, out_rng, prompt_rng = (_stream(seed, p) for p in (_INPUT_LENGTHS, _OUTPUT_LENGTHS, _PROMPTS))
    requests = []
    for i, at in enumerate(times):
        if trace is not None:
            prompt, n_out = trace[i % len(trace)][:2]
            ids = prompt if isinstance(prompt, tuple) else random_prompt(prompt, vocab_size, prompt_rng)
        else:
            ids = random_prompt(input_len.sample(in_rng), vocab_size, prompt_rng)
            n_out = output_len.sample(out_rng)
        requests.append(RequestSpec(i, at, ids, n_out))
    return requests


def parse_rates(text: str, flag: str = "--rates") -> list[float]:
    """'0.5,1,inf' -> [0.5, 1.0, inf]."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidArgument(flag, f"expected comma-separated numbers, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise InvalidArgument(flag, f"rates must be > 0, got {text!r}")
    return rates
