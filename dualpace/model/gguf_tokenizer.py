"""The tokenizer a GGUF file describes, built from its metadata.

A GGUF file stores the vocabulary, merges, token types and special ids under
`tokenizer.ggml.*`. The `tokenizers` backend built here reproduces what
transformers builds from the same file (`AutoTokenizer.from_pretrained(folder,
gguf_file=name)`), so token ids match the reference the model parity tests
compare against. `Tokenizer.from_gguf` wraps the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from dualpace.errors import ModelLoadError

# GGUF token types (llama.cpp's `llama_token_type`).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split rules for byte-level GGUF vocabularies, keyed by
# `tokenizer.ggml.pre`. Others use the GPT-2 rule built into `ByteLevel`, as
# transformers does (for SmolLM's "smollm" that is exact: its merges hold no digits).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


@dataclass(frozen=True)
class GgufTokenizerParts:
    """What `Tokenizer.__init__` needs, read from a GGUF file's metadata."""

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None
    extra_stop_token_ids: list[int]


def read_gguf_tokenizer(reader: Any) -> GgufTokenizerParts:
    """Build the tokenizer backend and settings a GGUF file describes (`reader` is a `gguf.GGUFReader`)."""
    tokenizer_model = _gguf_value(reader, "tokenizer.ggml.model")
    tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
    if tokenizer_model is None or not tokens:
        raise ModelLoadError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    token_types = list(_gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = _gguf_value(reader, "tokenizer.ggml.merges")
    if tokenizer_model == "gpt2":
        pre = _gguf_value(reader, "tokenizer.ggml.pre")
        backend, vocab_tokens = _byte_level_backend(tokens, merges, pre)
        default_add_bos = False
    elif tokenizer_model == "llama":
        scores = _gguf_value(reader, "tokenizer.ggml.scores")
        add_space_prefix = _gguf_value(reader, "tokenizer.ggml.add_space_prefix")
        unk_id = _gguf_value(reader, "tokenizer.ggml.unknown_token_id")
        backend, vocab_tokens = _sentencepiece_bpe_backend(
            tokens, merges, scores, add_space_prefix=add_space_prefix is not False, unk_id=unk_id
        )
        default_add_bos = True  # llama.cpp's default for sentencepiece vocabularies
    else:
        raise ModelLoadError(f"unsupported GGUF tokenizer model {tokenizer_model!r} (supported: gpt2, llama)")
    _add_gguf_added_tokens(backend, tokens, vocab_tokens, token_types)

    bos_token_id = _gguf_value(reader, "tokenizer.ggml.bos_token_id")
    eos_token_id = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
    turn_end_ids = [_gguf_value(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")]
    add_bos_token = _gguf_value(reader, "tokenizer.ggml.add_bos_token")
    return GgufTokenizerParts(
        backend=backend,
        bos_token_id=bos_token_id,
        eos_token_ids=[] if eos_token_id is None else [eos_token_id],
        add_bos_token=default_add_bos if add_bos_token is None else bool(add_bos_token),
        chat_template=_gguf_value(reader, "tokenizer.chat_template"),
        extra_stop_token_ids=[i for i in turn_end_ids if i is not None],
    )


def _gguf_value(reader: Any, name: str) -> Any:
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible spelling of bytes as printable characters.

    Printable Latin-1 bytes stand for themselves; every other byte maps, in
    order, to the code points from 256 up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(next_code_point)
            next_code_point += 1
    return spelling


def _parse_merges(merges: Sequence[Any] | None) -> list[tuple[str, str]]:
    """Merges as pairs; the file may store "left right" strings or pairs."""
    pairs = []
    for merge in merges or ():
        parts = merge.split(" ", 1) if isinstance(merge, str) else list(merge)
        if len(parts) != 2:
            raise ModelLoadError(f"GGUF tokenizer merge {merge!r} is not a pair")
        pairs.append((parts[0], parts[1]))
    return pairs


def _byte_level_backend(
    tokens: Sequence[str], merges: Sequence[Any] | None, pre: str | None
) -> tuple[tokenizers.Tokenizer, list[str]]:
    """Byte-level BPE (GPT-2 style); returns the backend and each id's vocabulary spelling."""
    spelling = _byte_to_unicode()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet is respelled from its UTF-8 bytes.
    vocab_tokens = [
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")) for token in tokens
    ]
    vocab = {token: index for index, token in enumerate(vocab_tokens)}
    bpe = models.BPE(
        vocab=vocab,
        merges=_parse_merges(merges),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = tokenizers.Tokenizer(bpe)
    split = _GGUF_PRE_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend, vocab_tokens


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a sentencepiece vocabulary: every split of a token
    into two known pieces, best-scored merged token first."""
    ids = {token: index for index, token in enumerate(tokens)}
    candidates = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ids and token[i:] in ids]
        local.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates.extend((left, right, score) for left, right in local)
    candidates.sort(key=lambda c: (-c[2], -len(c[0]), -len(c[1])))
    return [(left, right) for left, right, _ in candidates]


def _sentencepiece_bpe_backend(
    tokens: Sequence[str],
    merges: Sequence[Any] | None,
    scores: Sequence[float] | None,
    *,
    add_space_prefix: bool,
    unk_id: int | None,
) -> tuple[tokenizers.Tokenizer, list[str]]:
    """llama.cpp's "llama" vocabulary: sentencepiece BPE with byte fallback, `▁` for spaces."""
    if merges:
        merge_pairs = _parse_merges(merges)
    elif scores is not None:
        merge_pairs = _merges_from_scores(tokens, scores)
    else:
        raise ModelLoadError("GGUF llama tokenizer has neither merges nor scores")
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_token = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    bpe = models.BPE(vocab=vocab, merges=merge_pairs, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    backend = tokenizers.Tokenizer(bpe)
    prepend_scheme = "first" if add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, list(tokens)


def _add_gguf_added_tokens(
    backend: tokenizers.Tokenizer, tokens: Sequence[str], vocab_tokens: Sequence[str], token_types: Sequence[int]
) -> None:
    """Control tokens become special tokens, user-defined ones plain added tokens,
    so both are matched whole in text instead of being cut into pieces.

    A control token whose spelling had to change is a mislabel in the file; adding
    it would grow the vocabulary past the model's, so it is skipped.
    """
    specials = [
        AddedToken(token, normalized=False, special=True)
        for token, spelled, kind in zip(tokens, vocab_tokens, token_types)
        if kind == _TOKEN_TYPE_CONTROL and token == spelled
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, spelled, kind in zip(tokens, vocab_tokens, token_types)
        if kind == _TOKEN_TYPE_USER_DEFINED and token == spelled
    ]
    if specials:
        backend.add_special_tokens(specials)
    if user_defined:
        backend.add_tokens(user_defined)
