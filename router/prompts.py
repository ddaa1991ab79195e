"""Turn a client request into prompt token ids and fixed sampling parameters."""

from __future__ import annotations

import re
import uuid
from dataclasses import replace

from dualpace.client_request import ClientRequest
from dualpace.errors import InvalidArgument
from dualpace.model.config import ModelConfig
from dualpace.model.tokenizer import Tokenizer
from dualpace.sampling_params import SamplingParams, pick_seed
from dualpace.validation import validate_request
from router.prompt_checks import check_messages, check_text

REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id_for(client: ClientRequest) -> str:
    if client.request_id is None:
        return uuid.uuid4().hex
    if not REQUEST_ID_PATTERN.match(client.request_id):
        raise InvalidArgument("request_id", "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    return client.request_id


def prepare_prompt(client: ClientRequest, tokenizer: Tokenizer, config: ModelConfig) -> tuple[list[int], SamplingParams]:
    """Tokenize (text, ids or chat messages), validate everything, fix the seed."""
    params = client.params
    if client.text is not None:
        if not client.text:
            raise InvalidArgument("text", "the prompt is empty")
        check_text(client.text, "text")
        prompt_ids, field = tokenizer.encode(client.text, add_special_tokens=True), "text"
    elif client.prompt_token_ids is not None:
        prompt_ids, field = client.prompt_token_ids, "prompt_token_ids"
    elif client.messages is not None:
        if not client.messages:
            raise InvalidArgument("messages", "no messages")
        check_messages(client.messages)
        template_kwargs = {"tools": client.tools} if client.tools else {}
        prompt_ids, field = tokenizer.encode_chat(client.messages, **template_kwargs), "messages"
        if not params.ignore_eos:  # a chat turn ends at the template's end-of-turn token
            params = replace(params, stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids
                                                                        + tokenizer.chat_stop_token_ids)))
    else:
        raise InvalidArgument("prompt", "set one of text, prompt_token_ids or messages")
    validate_request(prompt_ids, params, config.vocab_size, config.max_position_embeddings, prompt_field=field)
    return prompt_ids, replace(params, seed=pick_seed(params))
