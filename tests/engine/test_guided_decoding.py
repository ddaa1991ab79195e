"""Structured outputs in the engine: sampled outputs at temperature 1 on the tiny (random-weight)
model match the constraint, the matcher follows a preempted or re-submitted request, and a bad
spec is refused naming the field."""

from __future__ import annotations

import json
import re

import pytest

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.scheduler import SchedulerConfig
from dualpace.errors import InvalidArgument
from dualpace.guided_spec import GuidedKind, GuidedSpec
from dualpace.sampling import SamplingParams
from tests.engine.test_engine_core import run_to_completion

jsonschema = pytest.importorskip("jsonschema")

# Bounded everywhere (string lengths, integer range, enum), so every valid document has at most
# a few dozen tokens and a max_tokens of 96 always lets the grammar close it.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}


def _decode(tiny, token_ids: list[int]) -> str:
    return tiny.tokenizer.decode(token_ids, skip_special_tokens=True)


def _core(tiny, num_blocks: int = 256, max_batch_tokens: int = 512) -> EngineCore:
    return EngineCore(tiny, EngineConfig(num_kv_blocks=num_blocks, block_size=8,
                                         scheduler=SchedulerConfig(max_batch_tokens=max_batch_tokens)))


def test_json_schema_outputs_validate_on_20_seeded_samples(tiny):
    core = _core(tiny)
    prompt = tiny.tokenizer.encode("Give me a person as JSON:")
    guided = GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))
    for seed in range(20):
        core.add_request(f"r{seed}", prompt, SamplingParams(max_tokens=96, temperature=1.0, seed=seed, guided=guided))
    outputs = run_to_completion(core)
    documents = set()
    for seed in range(20):
        text = _decode(tiny, outputs[f"r{seed}"])
        jsonschema.validate(json.loads(text), SCHEMA)  # parses and validates
        documents.add(text)
    assert len(documents) > 1  # sampled, not one forced answer


def test_regex_and_unconstrained_rows_share_a_batch(tiny):
    core = _core(tiny)
    prompt = tiny.tokenizer.encode("Phone:")
    regex = GuidedSpec(GuidedKind.REGEX, r"[0-9]{3}-[0-9]{4}")
    core.add_request("guided", prompt, SamplingParams(max_tokens=32, temperature=1.0, seed=3, guided=regex))
    core.add_request("free", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))
    outputs = run_to_completion(core)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", _decode(tiny, outputs["guided"]))
    assert len(outputs["free"]) == 8


def test_preemption_by_recompute_keeps_the_constraint(tiny):
    """A pool so small that requests are preempted and recomputed: the matcher is rebuilt from
    the tokens, and every output still validates (same outputs as with room to spare)."""
    guided = GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))
    prompt = tiny.tokenizer.encode("JSON:")
    requests = [(f"r{i}", SamplingParams(max_tokens=48, temperature=1.0, seed=i, guided=guided)) for i in range(6)]
    roomy, tight = _core(tiny), _core(tiny, num_blocks=14, max_batch_tokens=16)
    for core in (roomy, tight):
        for request_id, params in requests:
            core.add_request(request_id, prompt, params)
    expected, outputs = run_to_completion(roomy), run_to_completion(tight)
    assert tight.scheduler.num_preemptions > 0
    assert outputs == expected


def test_resubmitted_outputs_continue_under_the_grammar(tiny):
    """Recovery re-submits prompt + outputs so far: with num_output_tokens_in_prompt the grammar
    consumes those first, and the continuation equals the uninterrupted run."""
    guided = GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))
    prompt = tiny.tokenizer.encode("JSON:")
    core = _core(tiny)
    core.add_request("whole", prompt, SamplingParams(max_tokens=96, temperature=1.0, seed=5, guided=guided))
    whole = run_to_completion(core)["whole"]
    cut = len(whole) // 2
    resumed_guided = GuidedSpec(guided.kind, guided.spec, num_output_tokens_in_prompt=cut)
    core.add_request("rest", prompt + whole[:cut],
                     SamplingParams(max_tokens=96 - cut, temperature=1.0, seed=5, guided=resumed_guided))
    assert whole[:cut] + run_to_completion(core)["rest"] == whole


@pytest.mark.parametrize("spec", [
    GuidedSpec(GuidedKind.JSON_SCHEMA, '{"type": "objectx"}'),
    GuidedSpec(GuidedKind.JSON_SCHEMA, "{not json"),
    GuidedSpec(GuidedKind.REGEX, "a("),
    GuidedSpec(GuidedKind.LARK, "start: missing_rule"),
])
def test_a_bad_spec_is_refused_naming_guided(tiny, spec):
    core = _core(tiny)
    with pytest.raises(InvalidArgument) as refused:
        core.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, guided=spec))
    assert refused.value.field == "guided"


def test_ignore_eos_is_refused_with_a_constraint(tiny):
    guided = GuidedSpec(GuidedKind.REGEX, "[a-z]{2}")
    with pytest.raises(InvalidArgument) as refused:
        _core(tiny).add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, guided=guided, ignore_eos=True))
    assert refused.value.field == "ignore_eos"


async def test_a_migrated_request_keeps_its_constraint(tiny):
    """Moved mid-generation (KV and parameters over the migration protocol, the spec in the
    proto): the target rebuilds the matcher from the tokens and continues exactly."""
    from tests.engine.test_migration import started, stop, wait_tokens
    from tests.helpers import data_socket_send
    from dualpace.engine.transfer.migration import migrate_out

    guided = GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA))
    prompt = tiny.tokenizer.encode("JSON:")
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=9, guided=guided)
    alone = _core(tiny)
    alone.add_request("m", prompt, params)
    expected = run_to_completion(alone)["m"]

    source, target = await started(tiny, "src"), await started(tiny, "dst", block_size=4)
    channel = await source[0].add_request("m", prompt, params)
    await wait_tokens(channel, 5)
    await migrate_out(source[0], "m", data_socket_send(target[0]))
    assert channel.migrated_to == "dst"
    emitted = len(channel.output_token_ids)
    assert emitted < len(expected)  # it moved mid-document
    rest = [t async for update in target[0].channel("m").follow(emitted) for t in update.new_token_ids]
    assert channel.output_token_ids + rest == expected
    jsonschema.validate(json.loads(_decode(tiny, expected)), SCHEMA)
    await stop(source, target)
