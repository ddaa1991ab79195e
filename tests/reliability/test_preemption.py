"""A KV pool that fits one request, two greedy requests at once.

Both are admitted (their prompts fit), then they grow until the pool runs out and the newer
one is preempted (its blocks freed, recomputed later from prompt + generated tokens).
Criteria: the engine really preempted (its Prometheus counter moved), both outputs equal
their solo runs, and no KV block or request is left afterwards. On gpu_service and
cpu_service (the same scheduler behind a different runner).
"""

from __future__ import annotations

import re
import urllib.request

import pytest

from dualpace.sampling import FinishReason
from tests.reliability.conftest import (
    EngineProbe,
    EngineStream,
    assert_clean_exit,
    prompt_for,
    start_all,
    start_cpu,
    start_gpu,
)

BLOCK_SIZE = 8
PROMPT_TOKENS = 16
MAX_TOKENS = 48
# One request needs ceil((16 - 1 + 48) / 8) = 8 blocks at its longest; two need 16.
KV_BLOCKS = 10
METRICS_LINE = re.compile(r"metrics on (\S+)")
PREEMPTIONS = re.compile(r"^dualpace_preemptions_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def engines(tiny_folder):
    flags = ("--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK_SIZE), "--metrics-port", "0")
    daemons = start_all(gpu=lambda: start_gpu(tiny_folder, "--name", "gpu-one-fit", *flags),
                        cpu=lambda: start_cpu(tiny_folder, "--name", "cpu-one-fit", *flags))
    try:
        yield {name: (daemon, EngineProbe(daemon.address)) for name, daemon in daemons.items()}
    finally:
        assert_clean_exit(daemons.values())


def num_preemptions(daemon) -> float:
    match = METRICS_LINE.search(daemon.log())
    assert match, "the daemon did not print its metrics address"
    with urllib.request.urlopen(f"http://{match.group(1)}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(value) for value in PREEMPTIONS.findall(text))


@pytest.mark.parametrize("engine", ["gpu", "cpu"])
def test_two_requests_in_a_pool_for_one_equal_their_solo_runs(engines, reference, engine):
    daemon, probe = engines[engine]
    load = probe.wait_idle()
    assert (load.kv_blocks_total, load.kv_blocks_used) == (KV_BLOCKS, 0)
    before = num_preemptions(daemon)
    prompts = {f"{engine}-a": prompt_for(1, PROMPT_TOKENS), f"{engine}-b": prompt_for(2, PROMPT_TOKENS)}
    streams = {rid: EngineStream.run(probe.stub, rid, prompt, MAX_TOKENS) for rid, prompt in prompts.items()}
    for rid, stream in streams.items():
        assert stream.wait(), rid
    for rid, stream in streams.items():
        assert stream.error is None, (rid, stream.error)
        assert not stream.problems, (rid, stream.problems)
        assert stream.finish_reason == FinishReason.LENGTH, rid
        assert stream.tokens == reference(prompts[rid], MAX_TOKENS), rid
    assert num_preemptions(daemon) > before, "no request was preempted: the test did not test preemption"
    load = probe.wait_idle()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    assert probe.requests() == {}
