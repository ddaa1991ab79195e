"""Text <-> token ids for a model: a thin wrapper around a `tokenizers.Tokenizer`.

Two sources:

- a Hugging Face folder: `tokenizer.json`, plus `tokenizer_config.json`,
  `chat_template.jinja` and `generation_config.json` when present;
- a GGUF file: the vocabulary, merges and special ids stored as metadata, turned
  into a backend by `gguf_tokenizer.py`.

The wrapper adds what serving needs on top: the BOS rule, the stop ids of a chat
turn and chat-template rendering (see `chat_template.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from dualpace.errors import ModelLoadError
from dualpace.model.chat_template import render_chat_template
from dualpace.model.gguf_tokenizer import read_gguf_tokenizer

# Tokens that end an assistant turn in common chat formats; when present in the
# vocabulary they stop generation of a chat request besides the model's EOS.
# From this many characters on, encode() tokenizes without holding the GIL (see there); below,
# the plain call, which does not touch the backend's thread pool.
GIL_FREE_ENCODE_CHARS = 4096
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


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
        parts = read_gguf_tokenizer(reader)
        return cls(
            parts.backend,
            bos_token_id=parts.bos_token_id,
            eos_token_ids=parts.eos_token_ids,
            add_bos_token=parts.add_bos_token,
            chat_template=parts.chat_template,
            extra_stop_token_ids=parts.extra_stop_token_ids,
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
        if len(text) >= GIL_FREE_ENCODE_CHARS:
            # The same encoding; `encode_batch` alone releases the GIL while it runs, so a long
            # prompt tokenized on a worker thread (the router's prompt pool) leaves the event loop
            # running: `encode` holds it throughout (seconds for a megabyte of text).
            encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        token_ids = encoding.ids
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
