"""Text <-> token ids for a model: a thin wrapper around a `tokenizers.Tokenizer`.

Two sources:

- a Hugging Face folder: `tokenizer.json`, plus `tokenizer_config.json`,
  `chat_template.jinja` and `generation_config.json` when present;
- a GGUF file: the vocabulary, merges and special ids stored as metadata. The
  backend built from it reproduces what transformers builds from the same file
  (`AutoTokenizer.from_pretrained(folder, gguf_file=name)`), so token ids match
  the reference the model parity tests compare against.

The wrapper adds what serving needs on top: the BOS rule, the stop ids of a chat
turn and chat-template rendering (see `chat_template.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from dualpace.errors import ModelLoadError
from dualpace.model.chat_template import render_chat_template

# Tokens that end an assistant turn in common chat formats; when present in the
# vocabulary they stop generation of a chat request besides the model's EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

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


class Tokenizer:
    """Encodes text, decodes ids and renders chat prompts for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_stop_token_ids: Iterable[int] = (),
    ):
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        # A tokenizer.json post-processor may already add BOS; prepend it only when it does not.
        backend_adds_bos = bos_token_id is not None and backend.encode("").ids[:1] == [bos_token_id]
        self._prepend_bos = add_bos_token and bos_token_id is not None and not backend_adds_bos
        self._add_bos_token = self._prepend_bos or backend_adds_bos
        self._chat_template = chat_template
        end_of_turn_ids = [backend.token_to_id(token) for token in END_OF_TURN_TOKENS]
        stop_ids = [*self._eos_token_ids, *extra_stop_token_ids, *(i for i in end_of_turn_ids if i is not None)]
        self._chat_stop_token_ids = tuple(dict.fromkeys(stop_ids))

    # -- construction -------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face folder or a .gguf file."""
        path = Path(path)
        if path.is_dir():
            return cls.from_hf_folder(path)
        if path.is_file() and path.suffix == ".gguf":
            import gguf

            try:
                reader = gguf.GGUFReader(path)
            except Exception as error:  # gguf raises bare ValueError/OSError on a bad file
                raise ModelLoadError(f"{path}: not a readable GGUF file ({error})") from error
            return cls.from_gguf(reader)
        raise ModelLoadError(f"{path}: expected a Hugging Face folder or a .gguf file")

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and the settings beside it from a Hugging Face folder."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json (only fast-tokenizer folders are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a plain Exception on bad JSON
            raise ModelLoadError(f"{tokenizer_file}: cannot be parsed ({error})") from error
        config = _read_json(folder / "tokenizer_config.json")
        generation_config = _read_json(folder / "generation_config.json")

        bos_token_id = _special_token_id(backend, config.get("bos_token"))
        eos_token_ids = _as_id_list(generation_config.get("eos_token_id"))
        eos_token_id = _special_token_id(backend, config.get("eos_token"))
        if eos_token_id is not None:
            eos_token_ids.insert(0, eos_token_id)
        if bos_token_id is None:
            bos_token_id = _first_id(generation_config.get("bos_token_id"))
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=_hf_chat_template(folder, config),
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (`reader` is a `gguf.GGUFReader`)."""
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
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_ids=[] if eos_token_id is None else [eos_token_id],
            add_bos_token=default_add_bos if add_bos_token is None else bool(add_bos_token),
            chat_template=_gguf_value(reader, "tokenizer.chat_template"),
            extra_stop_token_ids=[i for i in turn_end_ids if i is not None],
        )

    # -- properties -----------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence ids (several when generation_config lists several)."""
        return self._eos_token_ids

    @property
    def chat_stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids plus the end-of-turn tokens of chat formats present in the vocabulary."""
        return self._chat_stop_token_ids

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS."""
        return self._add_bos_token

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # -- encode / decode ------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text (like `<|im_start|>`) maps to its id.

        With `add_special_tokens`, the backend's post-processor runs and BOS is
        prepended when the model asks for it, even before a BOS in the text
        (as transformers and llama.cpp do).
        """
        token_ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            token_ids.insert(0, self._bos_token_id)
        return token_ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`; incomplete UTF-8 at the end shows as U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # -- chat -----------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role", "content"}, ...]) with the model's chat template."""
        special_tokens = {
            "bos_token": self._token_text(self._bos_token_id),
            "eos_token": self._token_text(self._eos_token_ids[0] if self._eos_token_ids else None),
        }
        return render_chat_template(
            self._chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=special_tokens,
            **template_kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes any BOS itself."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._backend.id_to_token(token_id) or ""


# -- Hugging Face folder helpers ---------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: cannot be read as JSON ({error})") from error
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value


def _special_token_id(backend: tokenizers.Tokenizer, token: Any) -> int | None:
    """Id of a token given as text or as an AddedToken dict ({"content": ...})."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return backend.token_to_id(token)


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _first_id(value: Any) -> int | None:
    ids = _as_id_list(value)
    return ids[0] if ids else None


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja` if present, else the config's template (a string or named list)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# -- GGUF helpers ---------------------------------------------------------------


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
