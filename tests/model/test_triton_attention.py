"""The paged Triton attention kernel, run by Triton's interpreter on CPU tensors, against the gather
path (dualpace.model.attention) that CPU and CUDA used before it: a whole step of decode tokens and
prefill chunks of varied lengths in one call, GQA and MQA, chunks starting mid-block, block tables
out of order. On CUDA the same kernel is compiled; its logic is what these tests check."""

from __future__ import annotations

import pytest
import torch

from tests.model.triton_interpreter import use_kernels  # sets TRITON_INTERPRET=1 before triton loads

from dualpace.generation import OfflineGenerator  # noqa: E402
from dualpace.kv.storage import KVStorage  # noqa: E402
from dualpace.model import triton_attention  # noqa: E402
from dualpace.model.attention import decode_attention, prefill_attention  # noqa: E402
from dualpace.model.loader import load_model  # noqa: E402
from dualpace.model.paged_forward import PagedForward, SequenceWork  # noqa: E402
from dualpace.sampling import SamplingParams  # noqa: E402


# (start_pos, num_new, block table): decode tokens and prefill chunks, some starting mid-block,
# tables out of order and of different lengths.
SEQUENCES = [
    (0, 1, [3, 7]),
    (5, 1, [9]),
    (0, 20, [1, 2]),
    (18, 7, [30, 4, 22]),  # a chunk starting inside the second block
    (33, 1, [11, 12, 13]),
    (40, 16, [25, 5, 17, 28]),  # a chunk after a cached prefix, crossing a block boundary
]


def _reference_and_kernel(num_heads, num_kv_heads, head_dim, dtype, block_size=16, scale=0.3):
    torch.manual_seed(0)
    num_blocks = 32
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    queries, references, query_start = [], [], [0]
    for start_pos, num_new, blocks in SEQUENCES:
        q = torch.randn(num_new, num_heads, head_dim).to(dtype)
        table = torch.tensor(blocks)
        if num_new == 1:
            references.append(decode_attention(q, k_cache, v_cache, table[None], torch.tensor([start_pos + 1]), scale))
        else:
            references.append(prefill_attention(q, k_cache, v_cache, table, start_pos, scale))
        queries.append(q)
        query_start.append(query_start[-1] + num_new)
    longest = max(len(blocks) for _, _, blocks in SEQUENCES)
    batch = triton_attention.VarlenBatch(
        query_start=torch.tensor(query_start), start_pos=torch.tensor([s for s, _, _ in SEQUENCES]),
        block_tables=torch.tensor([b + [b[0]] * (longest - len(b)) for _, _, b in SEQUENCES]),
        max_new_tokens=max(n for _, n, _ in SEQUENCES))
    q_all = torch.cat(queries)
    assert triton_attention.supported(q_all, k_cache)
    out = triton_attention.paged_attention(q_all, k_cache, v_cache, batch, scale)
    return out.float(), torch.cat(references).float()


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [
    (4, 2, 16),  # GQA, group 2
    (6, 2, 16),  # group 3, padded to 4 rows per token
    (4, 1, 32),  # MQA
    (4, 4, 24),  # MHA, head_dim not a power of two
])
def test_kernel_equals_gather_path_fp32(num_heads, num_kv_heads, head_dim):
    out, reference = _reference_and_kernel(num_heads, num_kv_heads, head_dim, torch.float32)
    assert out.shape == reference.shape
    assert (out - reference).abs().max().item() < 1e-5


def test_kernel_bf16_is_close_to_gather_path():
    out, reference = _reference_and_kernel(4, 2, 16, torch.bfloat16)
    assert (out - reference).abs().max().item() < 3e-2


def test_unsupported_shapes_are_refused_so_the_gather_path_runs():
    q = torch.zeros(1, 4, 16)
    assert not triton_attention.supported(q, torch.zeros(2, 8, 2, 16))  # block size under 16
    assert not triton_attention.supported(q, torch.zeros(2, 24, 2, 16))  # not a power of two
    assert not triton_attention.supported(q.double(), torch.zeros(2, 16, 2, 16).double())


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-qwen3", "tiny-phi3", "tiny-gemma3"])
def test_whole_model_step_and_greedy_generation_match_gather(preset, synth_checkpoint, monkeypatch):
    loaded = load_model(str(synth_checkpoint(preset)), dtype="fp32")
    cfg = loaded.config
    prompts = [[5, 9, 2, 11, 40, 3, 3, 8, 1, 17, 19, 21, 22, 23, 24, 25, 26, 2], [7, 7, 1], [30] * 5]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts)
    results = {}
    for backend in ("gather", "triton"):
        use_kernels(monkeypatch, attention_backend=backend)
        kv = KVStorage(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, loaded.model.device)
        logits = PagedForward(loaded.model, kv).forward([
            SequenceWork(prompts[0], 0, [5, 2], all_logits=True),
            SequenceWork(prompts[1], 0, [0]),
        ])
        outputs = [r.output_token_ids for r in OfflineGenerator(loaded).generate(prompts, params)]
        results[backend] = logits, outputs
    # Attention itself matches to 1e-5 (above); logits of magnitude ~10 after the rest of the
    # layers differ by fp32 rounding, so they are compared relative to their size.
    triton_logits, gather_logits = results["triton"][0], results["gather"][0]
    assert (triton_logits - gather_logits).abs().max().item() < 1e-5 * gather_logits.abs().max().item()
    assert results["triton"][1] == results["gather"][1]
