"""What `pagedkv serve` does with each request field it does not implement: nothing is dropped
silently.

A field is implemented (a member of a request model in frontend/serve/openai_api.py), or listed here:
``Refused`` (400 naming it, unless its value is one of the neutral ones that ask for nothing, e.g.
``store: false``), or ``Ignored`` with the reason ignoring it cannot change what the client gets
back. Any other field is refused as unknown (the request models forbid extras). docs/serve.md's
field table says the same for every field of OpenAI's completions and chat requests and of vLLM's
(``VLLM_COMMON``, ``VLLM_CHAT``: the neutral values include vLLM's defaults, so a client that sends
every field at its default is never refused). tests/frontend/serve/test_openai_fields.py walks the
`openai` SDK's request types, and tests/frontend/serve/test_vllm_fields.py vLLM's field list
(tests/frontend/serve/data/vllm_request_fields.json), to check each one is honoured or refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class FieldRefused(ValueError):
    """A refused field that asked for something: ``param`` names it (frontend/serve/openai_api.py
    answers 400 with it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Ignored:
    """Accepted and not acted on; ``reason`` says why the response cannot differ."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """400 naming the field unless its value is in ``neutral`` (values that ask for nothing)."""

    reason: str
    neutral: tuple[Any, ...] = (None,)


Policy = Mapping[str, Ignored | Refused]

_CACHE_HINT = Ignored(
    "a prompt-caching hint: the prefix cache is automatic and shared, and usage's cached_tokens "
    "reports what it found"
)
_USER_ID = Ignored("an end-user id for OpenAI's abuse monitoring; pagedkv neither uses nor logs it")

COMMON: Policy = {
    "user": _USER_ID,
}

_MULTIMODAL = "pagedkv serves text-only models: no images, audio or video"

# vLLM's extensions of both requests that pagedkv does not act on (the others are request-model
# fields in frontend/serve/openai_api.py).
VLLM_COMMON: Policy = {
    "kv_transfer_params": Refused(
        "disaggregated prefill (KV transfer between vLLM instances) is not supported", (None, {})
    ),
    "ec_transfer_params": Refused(
        "encoder-cache transfer between instances is not supported (no multimodal encoders)", (None, {})
    ),
    "mm_payload": Refused(_MULTIMODAL, (None, "tensors")),
    "return_mm_kwargs": Refused(_MULTIMODAL, (None, False)),
    "logprob_token_ids": Refused(
        "the logprobs of chosen token ids are not computed: the worker returns the chosen token's "
        "and the top_logprobs most likely",
        (None, []),
    ),
    "repetition_detection": Refused("no repetition detector stops a sample early", (None,)),
    "return_token_offsets": Refused("tokens' character offsets are not returned", (None, False)),
    "routed_experts_prompt_start": Refused(
        "pagedkv's models are dense: no expert routing to return", (None, 0)
    ),
    "session_id": Refused("sessions (a prompt streamed in over several requests) are not supported"),
    "stream_interval": Refused("a stream sends every token as it is produced", (None, 1)),
    "thinking_token_budget": Refused(
        "no reasoning parser: a model's thinking is not told from its answer, so it cannot be budgeted"
    ),
    "vllm_xargs": Refused("no custom logits processors take extra arguments", (None, {})),
    "watermarking": Refused("outputs are not watermarked"),
}

VLLM_CHAT: Policy = {
    **VLLM_COMMON,
    "chat_template": Refused(
        "a request's own chat template is not run: the model's template renders every chat "
        "(vLLM too refuses one unless started with --trust-request-chat-template)"
    ),
    "include_reasoning": Refused(
        "no reasoning parser: a model's reasoning stays in content, so it cannot be left out",
        (None, True),
    ),
    "return_prompt_text": Refused(
        "the rendered prompt's text is not returned (POST /tokenize with the messages gives its "
        "tokens, and return_token_ids the prompt's ids)",
        (None, False),
    ),
    "media_io_kwargs": Refused(_MULTIMODAL, (None, {})),
    "mm_processor_kwargs": Refused(_MULTIMODAL, (None, {})),
}

COMPLETION: Policy = {
    **COMMON,
    **VLLM_COMMON,
    "prompt_embeds": Refused("prompts are tokens or text: embeddings cannot be given instead"),
    "suffix": Refused("text after the completion (insertion) is not supported", (None, "")),
}

CHAT: Policy = {
    **COMMON,
    **VLLM_CHAT,
    "audio": Refused("audio output is not supported: pagedkv generates text"),
    "modalities": Refused("only text output is supported", (None, ["text"])),
    "functions": Refused("deprecated by OpenAI and not supported: send tools"),
    "function_call": Refused("deprecated by OpenAI and not supported: send tool_choice"),
    "moderation": Refused("pagedkv runs no moderation model"),
    "reasoning_effort": Refused("the served model has no reasoning-effort control"),
    "verbosity": Refused("only max_tokens bounds the output's length"),
    "web_search_options": Refused("pagedkv has no web search"),
    "store": Refused("pagedkv stores no completions", (None, False)),
    "metadata": Ignored("it tags stored completions, and pagedkv stores none (store: true is refused)"),
    "prediction": Ignored(
        "predicted output only lets a server skip ahead; the output is the same without it"
    ),
    "prompt_cache_key": _CACHE_HINT,
    "prompt_cache_retention": _CACHE_HINT,
    "prompt_cache_options": _CACHE_HINT,
    "safety_identifier": _USER_ID,
    "service_tier": Ignored("one tier: every request goes to the same engine, in arrival order"),
}

STREAM_OPTIONS: Policy = {
    "include_obfuscation": Ignored(
        "obfuscation pads chunks against length side channels on OpenAI's network; pagedkv adds no "
        "padding either way"
    ),
}

# Per content part of a message.
CONTENT_PART: Policy = {"prompt_cache_breakpoint": _CACHE_HINT}

# Per message (every role): what a field not given to the chat template does.
MESSAGE: Policy = {
    "audio": Refused("audio is not supported"),
    "function_call": Refused("deprecated by OpenAI and not supported: send tool_calls"),
}


def screen(
    raw: Mapping[str, Any], policy: Mapping[str, Ignored | Refused], where: str = ""
) -> dict[str, Any]:
    """``raw`` without the ignored fields and the neutral refused ones; 400 for a refused field
    that asks for something (``where`` prefixes the field in ``param``, e.g. ``messages.2.``)."""
    out = {}
    for name, value in raw.items():
        rule = policy.get(name)
        if rule is None:
            out[name] = value
        elif isinstance(rule, Refused) and not any(
            value == n and type(value) is type(n) for n in rule.neutral
        ):
            param = f"{where}{name}"
            raise FieldRefused(param, f"{param}: not supported by pagedkv ({rule.reason})")
    return out
