"""A deterministic byte-level BPE tokenizer for synthetic checkpoints.

Layout of the vocabulary (ids):

- 0..4: the special tokens below (ChatML markers, BOS/EOS);
- 5..260: the 256 byte tokens, in byte order, spelt in the GPT-2 byte-level alphabet;
- then merges learnt from a small built-in English corpus (most frequent pair
  first, ties broken by the pair's spelling), then synthetic merges of existing
  tokens until the vocabulary has exactly `vocab_size` tokens, so every id a
  model can emit decodes to something.

The text pipeline is Qwen2's (NFC, its split regex, byte-level without its
own regex), because transformers' AutoTokenizer rebuilds exactly that pipeline
for model_type "qwen2" whatever tokenizer.json says; with it, the raw
tokenizer.json and transformers agree for every preset. No BOS is added
automatically (no post-processor): the ChatML chat template carries its own
markers, as in Qwen2 and SmolLM2.
"""

from __future__ import annotations

import itertools
from collections import Counter

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
BOS_TOKEN = "<s>"
EOS_TOKEN_ALT = "</s>"
SPECIAL_TOKENS = (ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, BOS_TOKEN, EOS_TOKEN_ALT)

ENDOFTEXT_ID = SPECIAL_TOKENS.index(ENDOFTEXT_TOKEN)
IM_START_ID = SPECIAL_TOKENS.index(IM_START_TOKEN)
IM_END_ID = SPECIAL_TOKENS.index(IM_END_TOKEN)
BOS_ID = SPECIAL_TOKENS.index(BOS_TOKEN)
# Generation stops at <|im_end|> (end of a chat turn) or <|endoftext|>.
EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)
PAD_ID = ENDOFTEXT_ID

# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving runtime schedules requests,
keeps their key and value caches in blocks, and streams the generated tokens back
to the client as soon as they are sampled. When the accelerator is busy, the other
engine decodes on the processor cores; the router moves a request from one engine
to the other when the load changes, and the client sees one stream without a gap.
The user asked the assistant a question, and the assistant answered it in a short
and helpful way. The system message says who the assistant is and what it should do.
Once upon a time there was a little model that wanted to write stories. It read the
words of many books, and it learnt that the most common words are the, of, and, to,
in, is, that, it, for, was, on, with, as, he, she, they, at, be, this, have, from.
def generate(prompt, max_tokens=16):
    tokens = tokenize(prompt)
    for step in range(max_tokens):
        logits = model(tokens)
        tokens.append(int(logits[-1].argmax()))
    return detokenize(tokens)
Numbers like 0, 1, 2, 3, 10, 42, 100, 2024 and 3.14 appear in text, and so do
punctuation marks: commas, periods, colons; quotes "like this" and (parentheses)!
"""


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: each byte value maps to one printable character."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {byte: chr(byte) for byte in printable}
    num_extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + num_extra)
            num_extra += 1
    return mapping


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _learn_corpus_merges(vocab: dict[str, int], num_merges_max: int) -> list[tuple[str, str]]:
    """Classic BPE on the built-in corpus; adds the new tokens to `vocab`."""
    word_counts = Counter(piece for piece, _ in _pre_tokenizer().pre_tokenize_str(_CORPUS))
    words = {tuple(word): count for word, count in word_counts.items()}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges_max:
        pair_counts: Counter = Counter()
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] += count
        candidates = [(count, pair) for pair, count in pair_counts.items() if "".join(pair) not in vocab]
        if not candidates:
            break
        # Most frequent first; ties broken by spelling so the result never depends on dict order.
        best_count, best = min(candidates, key=lambda item: (-item[0], item[1]))
        if best_count < 2:
            break
        merged = "".join(best)
        vocab[merged] = len(vocab)
        merges.append(best)
        words = {_apply_merge(symbols, best, merged): count for symbols, count in words.items()}
    return merges


def _apply_merge(symbols: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out: list[str] = []
    index = 0
    while index < len(symbols):
        if index + 1 < len(symbols) and (symbols[index], symbols[index + 1]) == pair:
            out.append(merged)
            index += 2
        else:
            out.append(symbols[index])
            index += 1
    return tuple(out)


def _fill_synthetic_merges(vocab: dict[str, int], vocab_size: int) -> list[tuple[str, str]]:
    """Merge pairs of existing tokens, in a fixed order, until the vocabulary is full."""
    base = [token for token in vocab if token not in SPECIAL_TOKENS]
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        num_before = len(vocab)
        for left, right in itertools.product(base, repeat=2):
            if len(vocab) >= vocab_size:
                break
            merged = left + right
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((left, right))
        if len(vocab) == num_before:  # cannot happen with a non-empty base; guards the loop
            break
        base = [token for token in vocab if token not in SPECIAL_TOKENS]
    return merges


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens (deterministic)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    vocab: dict[str, int] = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    byte_chars = bytes_to_unicode()
    for byte in range(NUM_BYTE_TOKENS):
        vocab[byte_chars[byte]] = len(vocab)
    merges = _learn_corpus_merges(vocab, vocab_size - len(vocab))
    merges += _fill_synthetic_merges(vocab, vocab_size)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return tokenizer


def tokenizer_config_dict(model_max_length: int) -> dict:
    """The tokenizer_config.json that goes with `build_tokenizer`'s tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END_TOKEN,
        "pad_token": ENDOFTEXT_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(index): {
                "content": token,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for index, token in enumerate(SPECIAL_TOKENS)
        },
    }
