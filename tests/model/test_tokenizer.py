"""Tokenizer parity with Hugging Face transformers on the same files.

The default model's GGUF is read once per module for transformers (its own GGUF tokenizer build
takes a few seconds) and once per session for ours (tests/conftest.py's default_tokenizer).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from dualpace.errors import InvalidArgument, ModelLoadError
from dualpace.model.tokenizer import GIL_FREE_ENCODE_CHARS, Tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "12345 3.14159 1,000,000 and 2024-01-31",
    "  leading and   inner   spaces\t\ttabs\n\n\nnewlines   ",
    "emoji 😀🎉 skin 👍🏽 family 👨‍👩‍👧",
    "中文字符测试，日本語のテキスト、한국어",
    "café naïve résumé Ωμέγα Привет",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|><repo_name>dualpace<file_sep>",
    "don't I'll we've they're",
    "",
    " ",
]

ONE_MESSAGE = [{"role": "user", "content": "What is the capital of France?"}]
THREE_MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "2 + 2 = ?"},
    {"role": "assistant", "content": "Four."},
]


@pytest.fixture(scope="module")
def ours(default_tokenizer) -> Tokenizer:
    return default_tokenizer


@pytest.fixture(scope="module")
def reference(default_model_path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent),
                                                      gguf_file=default_model_path.name)


def test_gguf_metadata(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == (2,)
    assert ours.add_bos_token is False
    im_end, endoftext = ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")
    assert set(ours.chat_stop_token_ids) == {2, im_end, endoftext}
    assert ours.id_to_token(1) == "<|im_start|>"
    assert ours.chat_template is not None and "<|im_start|>" in ours.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, reference, text: str) -> None:
    assert ours.encode(text) == reference.encode(text)


def test_a_long_text_matches_transformers(ours: Tokenizer, reference) -> None:
    """From GIL_FREE_ENCODE_CHARS on, encode() takes the backend's batch call: the same ids."""
    text = "".join(TEXTS) * 16
    assert len(text) >= GIL_FREE_ENCODE_CHARS
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


def test_a_long_text_is_tokenized_without_holding_the_gil(ours: Tokenizer) -> None:
    """Turns, not time: while a worker thread tokenizes a megabyte, this thread counts how often
    it gets to run (sleeping a millisecond between turns, which gives up the GIL). Holding the GIL
    the tokenizer would let it in only at its edges, a turn or two; released, every millisecond
    or so (hundreds of turns here, seconds of tokenizing)."""
    text = ("The quick brown fox jumps over the lazy dog. " * 25_000)[:1_000_000]
    about_to_encode, finished = threading.Event(), threading.Event()

    def work() -> None:
        about_to_encode.set()
        ours.encode(text)
        finished.set()

    worker = threading.Thread(target=work)
    worker.start()
    assert about_to_encode.wait(60)
    turns = 0
    while not finished.is_set() and worker.is_alive():
        turns += 1
        time.sleep(0.001)
    worker.join(120)
    assert finished.is_set() and turns >= 20, turns


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours: Tokenizer, reference, text: str) -> None:
    token_ids = ours.encode(text)
    assert ours.decode(token_ids) == text
    assert ours.decode(token_ids) == reference.decode(token_ids)


def test_special_tokens_are_single_ids(ours: Tokenizer) -> None:
    token_ids = ours.encode("<|im_start|>assistant\n")
    assert token_ids[0] == ours.token_to_id("<|im_start|>")
    assert ours.decode(token_ids, skip_special_tokens=True) == "assistant\n"


@pytest.mark.parametrize("messages", [ONE_MESSAGE, THREE_MESSAGES], ids=["one", "three"])
def test_chat_matches_transformers(ours: Tokenizer, reference, messages) -> None:
    expected_text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected_text
    expected_ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected_ids, list):
        expected_ids = expected_ids["input_ids"]
    assert ours.encode_chat(messages) == expected_ids


def test_chat_without_generation_prompt(ours: Tokenizer, reference) -> None:
    expected = reference.apply_chat_template(THREE_MESSAGES, add_generation_prompt=False, tokenize=False)
    assert ours.apply_chat_template(THREE_MESSAGES, add_generation_prompt=False) == expected


def test_hf_folder_matches(ours: Tokenizer, reference, tmp_path: Path) -> None:
    reference.save_pretrained(tmp_path)
    from_folder = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert from_folder.encode(text) == ours.encode(text)
    assert from_folder.bos_token_id == ours.bos_token_id
    assert from_folder.eos_token_ids == ours.eos_token_ids
    assert from_folder.encode_chat(THREE_MESSAGES) == ours.encode_chat(THREE_MESSAGES)
    assert Tokenizer.from_path(tmp_path).encode("hi") == ours.encode("hi")


def test_hf_folder_add_bos_and_generation_eos(ours: Tokenizer, tmp_path: Path) -> None:
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.eos_token_ids == (2, 0)
    assert tokenizer.encode("hi") == [1, *ours.encode("hi")]
    assert tokenizer.encode("hi", add_special_tokens=False) == ours.encode("hi")
    assert tokenizer.chat_template is None
    with pytest.raises(InvalidArgument, match="no chat template"):
        tokenizer.encode_chat(ONE_MESSAGE)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_bad_message_is_invalid_argument(ours: Tokenizer) -> None:
    with pytest.raises(InvalidArgument, match=r"messages\[0\]\.role"):
        ours.apply_chat_template([{"content": "no role"}])


def _write_gguf(path: Path, tokenizer_model: str, tokens: list[str], token_types: list[int], scores=None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("unused", np.zeros((4,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    pieces = ["▁", "e", "t", "h", "l", "o", "▁t", "he", "▁the", "ll", "llo", "▁he", "▁hello"]
    pieces += ["w", "r", "d", "▁w", "or", "▁wor", "ld", "▁world", "é", "c", "a", "f", "▁c", "af", "▁caf"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    token_types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    _write_gguf(tmp_path / "tiny.gguf", "llama", tokens, token_types, scores)
    ours = Tokenizer.from_path(tmp_path / "tiny.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    assert ours.add_bos_token is True
    for text in ["hello world", "the café", " hello  the world\n", "xyz 😀", "<s>hi</s>", ""]:
        assert ours.encode(text) == reference.encode(text)
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))


def test_unsupported_gguf_tokenizer_model(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "bert.gguf", "bert", ["[UNK]", "[CLS]", "[SEP]"], [2, 3, 3])
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_path(tmp_path / "bert.gguf")
