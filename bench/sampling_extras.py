"""What logprobs and penalties add to a step's sampling, beside plain sampling in the same run.

    python -m bench.sampling_extras --out bench/results/sampling_extras.json

Per batch size: `sample_next_tokens` over random float32 logits [batch, vocab] (SmolLM2's
vocabulary, 49152), every row seeded at temperature 0.8 with top-p 0.95, as
- plain: nothing else;
- logprobs: logprobs=20 on every row (log_softmax + top-20 + rank);
- penalties: presence, frequency and repetition penalties, a 10-entry logit_bias and min_tokens
  on every row, with a history of --history-tokens prompt and output tokens each;
- both;
and apply_penalties alone (the rest of "penalties" is the draw from a flatter distribution).
Reported: the median of --repeats calls, and each variant / plain (the ratio is what to read:
the machines are shared, so the load average at start and end goes in the JSON too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from dualpace.logits_processing import apply_penalties
from dualpace.penalties import SamplingContext
from dualpace.sampling import SamplingParams, sample_next_tokens

VOCAB_SIZE = 49152


def _median_ms(call, repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(batch: int, history_tokens: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, VOCAB_SIZE, generator=generator) * 3
    rng = random.Random(batch)
    base = SamplingParams(max_tokens=4096, temperature=0.8, top_p=0.95)
    penalized = SamplingParams(max_tokens=4096, temperature=0.8, top_p=0.95, presence_penalty=0.5,
                               frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=1,
                               logit_bias=tuple((rng.randrange(VOCAB_SIZE), 1.0) for _ in range(10)))
    contexts = [SamplingContext([rng.randrange(VOCAB_SIZE) for _ in range(history_tokens // 2)],
                                [rng.randrange(VOCAB_SIZE) for _ in range(history_tokens // 2)], 0, (0,), False)
                for _ in range(batch)]
    seeds, positions = list(range(batch)), [history_tokens] * batch
    variants = {
        "plain": ([base] * batch, None),
        "logprobs": ([SamplingParams(**{**base.__dict__, "logprobs": 20})] * batch, None),
        "penalties": ([penalized] * batch, contexts),
        "both": ([SamplingParams(**{**penalized.__dict__, "logprobs": 20})] * batch, contexts),
    }
    row = {"batch": batch}
    for name, (params, row_contexts) in variants.items():
        row[f"{name}_ms"] = round(_median_ms(
            lambda: sample_next_tokens(logits, params, seeds, positions, row_contexts), repeats), 3)
    # The penalties alone: the rest of "penalties" is the draw over the penalized (flatter)
    # distribution, whose top-p nucleus is larger than the random logits' own.
    row["apply_penalties_ms"] = round(_median_ms(lambda: apply_penalties(logits, variants["penalties"][0], contexts),
                                                 repeats), 3)
    for name in ("logprobs", "penalties", "both", "apply_penalties"):
        row[f"{name}_vs_plain"] = round(row[f"{name}_ms"] / row["plain_ms"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--history-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    rows = [measure(int(b), args.history_tokens, args.repeats) for b in args.batches.split(",")]
    result = {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
              "vocab_size": VOCAB_SIZE, "history_tokens": args.history_tokens, "repeats": args.repeats,
              "load_average_start": load_start, "load_average_end": os.getloadavg()[0], "rows": rows}
    for row in rows:
        print(row)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
