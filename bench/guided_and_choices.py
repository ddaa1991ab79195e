"""Two figures behind the OpenAI front's extras (docs/http_api.md), in one short run:

- guided decoding: the time llguidance takes to build its view of the vocabulary (done once, at
  an engine's warm-up) and to compute one token mask, per token of a JSON document, on a real
  vocabulary (the default model's tokenizer), beside the engine's decode step on the same model
  (batch 1): the mask runs on a worker thread during the forward pass, so it is hidden while it
  stays below the step;
- n choices: KV blocks held by three choices of one prompt started as router/fan_out.py starts
  them (the first, then its siblings after its first token), beside three requests of the same
  size that share nothing, and three copies of the prompt started together (no sharing either:
  the prompt's blocks are not in the cache until one of them has computed them).

    python -m bench.guided_and_choices --out bench/results/guided_and_choices.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import llguidance

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.guided_grammar import grammar_for
from dualpace.guided_spec import GuidedKind, GuidedSpec
from dualpace.model.loader import load_model
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.sampling import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
DOCUMENT = '{"name":"Ann Smith","age":33,"tags":["engineer","runner","cellist"]}'
PROMPT = "The committee met on a grey morning to discuss the budget for the coming year. " * 4


def mask_times(loaded) -> dict:
    tokenizer = loaded.tokenizer
    start = time.perf_counter()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                          eos_token=list(tokenizer.eos_token_ids))
    build_ms = (time.perf_counter() - start) * 1e3
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar_for(GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))),
                                   log_level=0)
    token_ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    times_us = []
    for token_id in token_ids:
        start = time.perf_counter()
        matcher.compute_bitmask()
        times_us.append((time.perf_counter() - start) * 1e6)
        if not matcher.consume_token(token_id):
            raise RuntimeError(f"the document's token {token_id} is outside the grammar")
    return {"vocab_size": tokenizer.vocab_size, "tokenizer_build_ms": round(build_ms),
            "num_mask_tokens": len(token_ids), "mask_median_us": round(statistics.median(times_us)),
            "mask_first_us": round(times_us[0]), "mask_max_after_first_us": round(max(times_us[1:]))}


def decode_step_ms(loaded) -> float:
    core = EngineCore(loaded, EngineConfig(num_kv_blocks=64, block_size=16))
    core.add_request("d", loaded.tokenizer.encode("Hello"), SamplingParams(max_tokens=40, ignore_eos=True))
    core.step()  # the prefill
    times = []
    while core.has_work:
        start = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 2)


def blocks_held(loaded, prompts: list[list[int]], staged: bool, num_decode_steps: int = 10) -> int:
    core = EngineCore(loaded, EngineConfig(num_kv_blocks=256, block_size=16))
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=3 + i, ignore_eos=True) for i in range(3)]
    core.add_request("c0", prompts[0], params[0])
    if staged:
        while not core.step()[1]:  # until the first choice's first token
            pass
    for index in (1, 2):
        core.add_request(f"c{index}", prompts[index], params[index])
    for _ in range(num_decode_steps):
        core.step()
    return core.scheduler.blocks.num_used_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    loaded = load_model(args.model, dtype="fp32")
    prompt = loaded.tokenizer.encode(PROMPT)
    other = [(t + 1) % loaded.config.vocab_size for t in prompt]
    third = [(t + 2) % loaded.config.vocab_size for t in prompt]
    result = {
        "model": args.model,
        "guided_masks": mask_times(loaded),
        "decode_step_batch1_ms": decode_step_ms(loaded),
        "n3_kv_blocks": {"prompt_tokens": len(prompt), "block_size": 16,
                         "fan_out_staged": blocks_held(loaded, [prompt] * 3, staged=True),
                         "same_prompt_started_together": blocks_held(loaded, [prompt] * 3, staged=False),
                         "three_unrelated_prompts": blocks_held(loaded, [prompt, other, third], staged=False)},
        "load_average": [load_start, os.getloadavg()[0]],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
