"""Log-probabilities and penalties on the engine, checked against Hugging Face transformers on the
same tiny checkpoint (fp32): the logprobs of every generated and prompt token, and greedy output
with penalties against a plain reference implementation of vLLM's formulas on HF's logits,
locally, with chunked prefill, and across a migration mid-generation."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.migration import migrate_out
from dualpace.engine.scheduler import SchedulerConfig
from dualpace.sampling import SamplingParams
from tests.engine.test_migration import stop, wait_tokens
from tests.helpers import data_socket_send

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

TOLERANCE = 1e-4
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]


@pytest.fixture(scope="module")
def hf_model(synth_checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(synth_checkpoint("tiny-llama")),
                                                              dtype=torch.float32)
    return model.eval()


def hf_log_probs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row i is the distribution of the token at position i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=1)


def assert_entry_matches(entry, reference_row: torch.Tensor, token_id: int, num_top: int) -> None:
    assert entry is not None and entry.token_id == token_id
    assert abs(entry.logprob - float(reference_row[token_id])) < TOLERANCE
    assert entry.rank == int((reference_row > reference_row[token_id]).sum()) + 1
    top_values, top_ids = torch.topk(reference_row, num_top)
    assert list(entry.top_token_ids) == top_ids.tolist()
    assert max((abs(a - b) for a, b in zip(entry.top_logprobs, top_values.tolist())), default=0.0) < TOLERANCE


def assert_output_logprobs(hf_model, prompt, output, entries, num_top) -> None:
    reference = hf_log_probs(hf_model, prompt + output)
    assert len(entries) == len(output)
    for i, (token_id, entry) in enumerate(zip(output, entries)):
        assert_entry_matches(entry, reference[len(prompt) + i - 1], token_id, num_top)


async def started(tiny, name: str, max_batch_tokens: int = 512, block_size: int = 8):
    import asyncio

    config = EngineConfig(name=name, num_kv_blocks=64, block_size=block_size,
                          scheduler=SchedulerConfig(max_batch_tokens=max_batch_tokens))
    loop = EngineLoop(EngineCore(tiny, config))
    return loop, asyncio.create_task(loop.run())


async def run_to_end(channel):
    async for _ in channel.follow():
        pass
    return channel


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("max_batch_tokens", [512, 5])  # 5: the prompt is prefilled in chunks
async def test_logprobs_equal_transformers(tiny, hf_model, temperature, max_batch_tokens):
    engine = await started(tiny, "e", max_batch_tokens)
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=temperature, seed=7, logprobs=5,
                            prompt_logprobs=3)
    channel = await run_to_end(await engine[0].add_request("r", PROMPT, params))
    output = channel.output_token_ids
    assert_output_logprobs(hf_model, PROMPT, output, channel.token_logprobs, 5)
    reference = hf_log_probs(hf_model, PROMPT)
    prompt_entries = channel.prompt_logprobs
    assert prompt_entries is not None and len(prompt_entries) == len(PROMPT) - 1
    for position, entry in enumerate(prompt_entries, start=1):
        assert_entry_matches(entry, reference[position - 1], PROMPT[position], 3)
    await stop(engine)


async def test_prompt_logprobs_skip_the_prefix_cache(tiny, hf_model):
    """A second identical prompt would hit the cache; with prompt_logprobs it is computed in full."""
    engine = await started(tiny, "e")
    await run_to_end(await engine[0].add_request("warm", PROMPT, SamplingParams(max_tokens=2)))
    params = SamplingParams(max_tokens=2, prompt_logprobs=0)
    channel = await run_to_end(await engine[0].add_request("again", PROMPT, params))
    assert channel.num_cached_tokens == 0 and len(channel.prompt_logprobs) == len(PROMPT) - 1
    reference = hf_log_probs(hf_model, PROMPT)
    assert all(abs(e.logprob - float(reference[i][PROMPT[i + 1]])) < TOLERANCE
               for i, e in enumerate(channel.prompt_logprobs))
    await stop(engine)


async def test_logprobs_across_a_migration_mid_generation(tiny, hf_model):
    source, target = await started(tiny, "src"), await started(tiny, "dst", block_size=4)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, seed=3, logprobs=4)
    channel = await source[0].add_request("m", PROMPT, params)
    await wait_tokens(channel, 5)
    await migrate_out(source[0], "m", data_socket_send(target[0]))
    emitted = len(channel.output_token_ids)
    updates = [u async for u in target[0].channel("m").follow(emitted)]
    output = channel.output_token_ids + [t for u in updates for t in u.new_token_ids]
    entries = channel.token_logprobs + [e for u in updates for e in u.logprobs]
    assert len(output) == 16
    assert_output_logprobs(hf_model, PROMPT, output, entries, 4)
    await stop(source, target)


# ---- penalties -------------------------------------------------------------------------------


def reference_penalized(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                        eos_ids: set[int]) -> torch.Tensor:
    """vLLM's definitions, one token at a time (an implementation independent of the engine's)."""
    scores = logits.clone()
    for token_id, bias in params.logit_bias:
        scores[token_id] += bias
    if len(output) < params.min_tokens:
        for token_id in set(params.stop_token_ids) | eos_ids:
            scores[token_id] = -math.inf
    for token_id in set(prompt) | set(output):
        value = float(scores[token_id])
        scores[token_id] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token_id, count in Counter(output).items():
        scores[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return scores


def reference_greedy(hf_model, prompt: list[int], params: SamplingParams, eos_ids: set[int]) -> list[int]:
    output: list[int] = []
    with torch.no_grad():
        while len(output) < params.max_tokens:
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1].float()
            token_id = int(reference_penalized(logits, prompt, output, params, eos_ids).argmax())
            output.append(token_id)
            if token_id in eos_ids and len(output) > params.min_tokens:
                break
    return output


# The tiny model never repeats itself in 24 greedy tokens, so a logit_bias makes tokens 11 and 40
# attractive enough to repeat; each case is checked to change the output of its baseline.
BIAS = ((11, 5.0), (40, 4.5))
PENALTY_CASES = {  # name -> (params, the params whose output it must differ from)
    "presence+frequency": (dict(presence_penalty=2.0, frequency_penalty=2.0), dict()),
    "repetition": (dict(repetition_penalty=1.8), dict()),
    "negative": (dict(presence_penalty=-0.5, frequency_penalty=-1.0), dict()),
    "repetition<1": (dict(repetition_penalty=0.6, frequency_penalty=0.3), dict()),
    "logit_bias": (dict(), None),
}


def case_params(extra: dict | None, bias=BIAS) -> SamplingParams:
    return SamplingParams(max_tokens=24, ignore_eos=True, logit_bias=bias, **(extra or {}))


@pytest.mark.parametrize("case", sorted(PENALTY_CASES))
async def test_greedy_with_penalties_equals_the_reference(tiny, hf_model, case):
    extra, baseline = PENALTY_CASES[case]
    params = case_params(extra)
    expected = reference_greedy(hf_model, PROMPT, params, set())
    baseline_params = case_params(baseline) if baseline is not None else case_params({}, bias=())
    assert expected != reference_greedy(hf_model, PROMPT, baseline_params, set())  # the case changes the output
    engine = await started(tiny, "e")
    channel = await run_to_end(await engine[0].add_request("p", PROMPT, params))
    assert channel.output_token_ids == expected
    await stop(engine)


async def test_min_tokens_holds_back_eos(tiny, hf_model):
    """The request's EOS is the token greedy decoding picks first: min_tokens forbids it until reached."""
    from tests.helpers import reference_tokens

    eos = reference_tokens(tiny, PROMPT, SamplingParams(max_tokens=1))[0]
    params = SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=(eos,))
    expected = reference_greedy(hf_model, PROMPT, params, {eos})
    engine = await started(tiny, "e")
    channel = await run_to_end(await engine[0].add_request("p", PROMPT, params))
    assert channel.output_token_ids == expected and len(expected) >= 6 and eos not in expected[:6]
    await stop(engine)


async def test_penalties_continue_exactly_across_a_migration(tiny, hf_model):
    params = case_params(dict(presence_penalty=1.0, frequency_penalty=-0.6, repetition_penalty=1.4))
    expected = reference_greedy(hf_model, PROMPT, params, set())
    source, target = await started(tiny, "src"), await started(tiny, "dst", block_size=4)
    channel = await source[0].add_request("m", PROMPT, params)
    await wait_tokens(channel, 8)
    await migrate_out(source[0], "m", data_socket_send(target[0]))
    emitted = len(channel.output_token_ids)
    rest = [t async for u in target[0].channel("m").follow(emitted) for t in u.new_token_ids]
    assert channel.output_token_ids + rest == expected
    await stop(source, target)


async def test_a_resubmission_counts_its_prior_outputs_as_output(tiny, hf_model):
    """Recovery re-submits prompt + outputs as the prompt: with num_prior_output_tokens the
    frequency counts (output only) come out as if the request had never moved."""
    params = case_params(dict(frequency_penalty=-1.0, presence_penalty=-0.5))
    expected = reference_greedy(hf_model, PROMPT, params, set())
    engine = await started(tiny, "e")
    prior = expected[:10]
    channel = await run_to_end(await engine[0].add_request(
        "again", PROMPT + prior, replace(params, max_tokens=14), num_prior_output_tokens=10))
    assert prior + channel.output_token_ids == expected
    # Without it the prior outputs would count as prompt, which only the repetition penalty sees.
    channel = await run_to_end(await engine[0].add_request("as-prompt", PROMPT + prior, replace(params, max_tokens=14)))
    assert prior + channel.output_token_ids != expected
    await stop(engine)
