"""OpenAI's completion and chat request shapes: parsing and validation for `pagedkv serve`.

Every check happens here, before anything reaches the engine, so a bad request is answered 400
with the offending field named (``param``) and nothing is allocated. Types are strict (``"5"`` is
not a number, ``true`` is not an integer), ranges are OpenAI's (temperature 0..2, top_p (0, 1],
penalties -2..2, logit_bias -100..100), plus vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``bad_words``,
``allowed_token_ids``, ``structured_outputs``, the tokenization and detokenization switches...).
A field sent as null means its default, as in vLLM. Nothing is silently dropped: a field the request
models here do not implement is refused or ignored as frontend/serve/openai_fields.py says (ignored
only where the response cannot differ), and any other field is refused as unknown.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagedkv.frontend.engine import MAX_TOP_LOGPROBS, BeamParams, SamplingOptions
from pagedkv.frontend.engine.beam import candidates_per_beam
from pagedkv.frontend.serve.grammar import Grammar, GrammarCompiler
from pagedkv.frontend.serve.openai_fields import (
    CHAT,
    COMPLETION,
    CONTENT_PART,
    MESSAGE,
    STREAM_OPTIONS,
    FieldRefused,
    Ignored,
    Refused,
    screen,
)
from pagedkv.frontend.serve.structured_output import (
    ResponseFormat,
    StructuredOutputError,
    StructuredOutputs,
    requested_grammar,
)
from pagedkv.frontend.serve.text import ContinuationError, ModelText
from pagedkv.frontend.serve.token_constraints import TokenConstraints
from pagedkv.frontend.serve.tools import (
    AUTO_PARSER,
    ToolCalling,
    ToolCallParam,
    ToolDef,
    ToolError,
    ToolRequest,
    calls_as_text,
    renders_tool_calls,
    template_source,
    tool_request,
)

MAX_N = 64
MAX_STOP = 16
MAX_SEED = 2**63 - 1
MAX_BAD_WORDS = 64
MAX_REQUEST_ID = 256
SCHEDULING_POLICIES = ("fcfs", "priority")


class ApiError(Exception):
    """An HTTP error in OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


def _accepts_none(annotation: Any) -> bool:
    return annotation is None or (
        typing.get_origin(annotation) in (typing.Union, types.UnionType)
        and type(None) in typing.get_args(annotation)
    )


class _Sampling(BaseModel):
    # Every field is implemented here or listed in frontend/serve/openai_fields.py; the rest are unknown.
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, raw: Any) -> Any:
        """A field sent as null takes its default (vLLM's request models default most to None)."""
        if not isinstance(raw, dict):
            return raw
        fields = cls.model_fields
        return {
            k: v
            for k, v in raw.items()
            if not (v is None and k in fields and not _accepts_none(fields[k].annotation))
        }

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's extension
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's extension
    # Structured output (frontend/serve/structured_output.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # vLLM's sampling extensions (frontend/serve/token_constraints.py).
    min_tokens: int = Field(0, ge=0)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's tokenization and detokenization switches.
    add_special_tokens: bool | None = None  # default: completions true, chat false (the template's)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    echo: bool = False
    # What the response carries.
    prompt_logprobs: int | None = None  # vLLM's: checked by _prompt_logprobs
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID, pattern=r"^[!-~]+$")
    # Scheduling and the prefix cache.
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's beam search: the n best of n beams (frontend/engine/beam.py), checked by _beam.
    use_beam_search: bool = False
    length_penalty: float = 1.0


class CompletionBody(_Sampling):
    prompt: Any = None
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    # Given to the chat template with the message (rendered where the template uses them).
    name: str | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant's earlier refusal: its text when content is null
    tool_calls: list[ToolCallParam] | None = None  # an assistant's earlier calls (frontend/serve/tools.py)


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # How the chat template renders them (vLLM's extensions).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tool calling (frontend/serve/tools.py).
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None  # checked by frontend/serve/tools.py
    parallel_tool_calls: bool | None = None


@dataclass(slots=True)
class RequestLimits:
    """What a request is checked against: the served model and the pool."""

    model_name: str
    vocab_size: int
    block_size: int
    num_gpu_blocks: int
    text: ModelText
    grammars: GrammarCompiler | None = None  # built on first use (needs the tokenizer)
    tool_call_parser: str = AUTO_PARSER  # --tool-call-parser: the family of `auto` tool calls
    scheduling_policy: str = "fcfs"  # --scheduling-policy: "priority" honours a request's priority

    def grammar_compiler(self) -> GrammarCompiler | None:
        """Compiles structured-output grammars for this model; None without a tokenizer."""
        if self.grammars is None and self.text.tokenizer is not None:
            self.grammars = GrammarCompiler(self.text.tokenizer, self.vocab_size, self.text.eos_token_ids)
        return self.grammars

    @property
    def max_tokens_in_pool(self) -> int:
        return self.block_size * self.num_gpu_blocks

    @property
    def max_model_len(self) -> int:
        """The model's context length (its config's max_position_embeddings); the pool's size when
        the server has no model config. /v1/models reports it, as vLLM does."""
        return self.text.max_model_len or self.max_tokens_in_pool

    @property
    def max_context(self) -> int:
        """What one request can use: the model's context, or less when the pool holds less."""
        pool = self.max_tokens_in_pool
        return min(pool, self.text.max_model_len) if self.text.max_model_len else pool


@dataclass(slots=True)
class Parsed:
    """A validated request: one engine request per prompt, with what the response needs."""

    prompts: list[list[int]]
    max_tokens: int
    n: int
    sampling: SamplingOptions
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int = 0  # alternatives per token (completions: logprobs=N; chat: top_logprobs)
    echo: tuple[str, ...] = ()  # with echo: each prompt's text, put before its choices' text
    tools: ToolCalling | None = None  # chat with tools: how each answer is read for tool calls
    # Detokenization (frontend/serve/detokenize.py).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # stop strings count from this many tokens on
    return_token_ids: bool = False  # the prompt's ids too (prompt_token_ids)
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:<id>"
    # vLLM's prompt_logprobs: score each prompt token with this many alternatives (None: not asked,
    # or a stream, which carries none).
    prompt_logprobs: int | None = None
    request_id: str | None = None  # the client's: the response's id and X-Request-Id
    priority: int = 0  # vLLM's: lower is served first (with --scheduling-policy priority)
    cache_salt: str = ""  # the prefix cache shares blocks only between requests of the same salt
    beam: BeamParams | None = None  # use_beam_search: n beams, the n best returned (None: sampling)


def validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"]]
    # Union members show up in the location (e.g. stop.str / stop.list[str]); keep the field path.
    path = [p for p in loc if not (p in ("str", "int", "float", "bool") or p.startswith(("list[", "dict[")))]
    param = ".".join(path) or None
    msg = err["msg"]
    if err["type"] == "missing":
        msg = "this field is required"
    elif err["type"] == "extra_forbidden":
        msg = (
            "unknown field: not a field of OpenAI's or vLLM's request that pagedkv implements "
            "(docs/serve.md says what happens to each)"
        )
    return ApiError(400, f"{param}: {msg}" if param else msg, param)


def check_model(model: str | None, limits: RequestLimits) -> None:
    if model is not None and model != limits.model_name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist (this server serves `{limits.model_name}`).",
            "model",
            "invalid_request_error",
            "model_not_found",
        )


def _token_list(value: Any, param: str, limits: RequestLimits) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"{param}: expected a list of integer token ids", param)
    bad = next((t for t in value if t < 0 or t >= limits.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"{param}: token id {bad} is out of range [0, {limits.vocab_size})", param)
    return list(value)


def _prompts(prompt: Any, limits: RequestLimits, add_special_tokens: bool = True) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists (text encoded with
    the model's BOS/EOS where it takes them unless ``add_special_tokens`` is false)."""
    if prompt is None:
        raise ApiError(400, "prompt: this field is required", "prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
    ):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if limits.text.tokenizer is None:
            raise ApiError(
                400,
                "prompt: text prompts need a tokenizer, and this server has none (start it with "
                "--model DIR for a model directory with a tokenizer, or send token ids)",
                "prompt",
            )
        out = []
        for t in texts:
            if not t:
                raise ApiError(400, "prompt: the prompt is empty", "prompt")
            out.append(_token_list(limits.text.encode(t, add_special_tokens), "prompt", limits))
        return out
    if not isinstance(prompt, list):
        raise ApiError(
            400,
            "prompt: expected a string, a list of strings, a list of token ids or a list of token-id lists",
            "prompt",
        )
    if not prompt:
        raise ApiError(400, "prompt: the prompt is empty", "prompt")
    if all(isinstance(p, list) for p in prompt):
        out = [_token_list(p, "prompt", limits) for p in prompt]
    else:
        out = [_token_list(prompt, "prompt", limits)]
    if any(not p for p in out):
        raise ApiError(400, "prompt: the prompt is empty", "prompt")
    return out


def _stop(stop: str | list[str] | None, limits: RequestLimits) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if len(items) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} stop strings", "stop")
    if any(not s for s in items):
        raise ApiError(400, "stop: stop strings must not be empty", "stop")
    if items and limits.text.tokenizer is None:
        raise ApiError(
            400, "stop: stop strings need a tokenizer, and this server has none (use stop_token_ids)", "stop"
        )
    return tuple(items)


MAX_LOGIT_BIAS = 100.0
# JSON parsing accepts NaN and Infinity: numbers that must be finite.
_FINITE = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


def _logit_bias(bias: dict[str, float] | None, limits: RequestLimits) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids (as JSON object keys) to a bias in -100..100."""
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        if not key.strip().isdigit() or not 0 <= int(key) < limits.vocab_size:
            raise ApiError(
                400,
                f"logit_bias: key {key!r} is not a token id in [0, {limits.vocab_size})",
                "logit_bias",
            )
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ApiError(400, f"logit_bias: the bias of token {key} must be in [-100, 100]", "logit_bias")
        out.append((int(key), float(value)))
    if len({t for t, _ in out}) != len(out):
        raise ApiError(400, "logit_bias: a token id appears twice", "logit_bias")
    return tuple(out)


_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")


def _grammar(body: _Sampling, limits: RequestLimits) -> Grammar | None:
    try:
        return requested_grammar(
            limits.grammar_compiler() if limits.text.tokenizer is not None else None,
            body.response_format,
            body.guided_json,
            body.guided_regex,
            body.guided_choice,
            body.structured_outputs,
        )
    except StructuredOutputError as e:
        raise ApiError(400, str(e), e.param) from None


def _token_constraints(
    body: _Sampling, grammar: Grammar | None, stop_ids: tuple[int, ...], limits: RequestLimits
) -> Any:
    """The grammar, or the grammar with vLLM's token-level constraints on top
    (frontend/serve/token_constraints.py) when the request has any."""
    allowed = None
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:
            raise ApiError(400, "allowed_token_ids: at least one token id", "allowed_token_ids")
        allowed = tuple(dict.fromkeys(_token_list(body.allowed_token_ids, "allowed_token_ids", limits)))
    bad: list[tuple[int, ...]] = []
    if body.bad_words:
        if len(body.bad_words) > MAX_BAD_WORDS:
            raise ApiError(400, f"bad_words: at most {MAX_BAD_WORDS} words", "bad_words")
        tok = limits.text.tokenizer
        if tok is None:
            raise ApiError(400, "bad_words: needs a tokenizer, and this server has none", "bad_words")
        for word in body.bad_words:
            if not word.strip():
                raise ApiError(400, "bad_words: a word must not be empty", "bad_words")
            # As vLLM: the word as it is and, after a space, as it reads inside a text.
            for text in dict.fromkeys((word, word if word.startswith(" ") else " " + word)):
                ids = tuple(int(t) for t in tok.encode(text, add_special_tokens=False))
                if ids and all(t < limits.vocab_size for t in ids):
                    bad.append(ids)
    min_stop = stop_ids if body.min_tokens else ()
    if allowed is None and not bad and not min_stop:
        return grammar
    return TokenConstraints(
        limits.vocab_size, grammar, allowed, tuple(dict.fromkeys(bad)), body.min_tokens, min_stop
    )


def _startable(grammar: Grammar | None, param: str) -> Grammar | None:
    """``grammar``, unless no token of the model's vocabulary can begin a text it allows (a step
    with nothing allowed cannot be sampled): then a 400 naming ``param``."""
    if grammar is not None and not any(grammar.matcher().mask()):
        raise ApiError(
            400,
            f"{param}: no token of this model's vocabulary can begin an output the constraint allows",
            param,
        )
    return grammar


def _forced_or_asked(forced: Grammar | None, body: _Sampling, limits: RequestLimits) -> Grammar | None:
    asked = _grammar(body, limits)
    if forced is None:
        if asked is None:
            return None
        return _startable(asked, next(n for n in _STRUCTURED if getattr(body, n, None) is not None))
    if asked is not None:
        names = [n for n in _STRUCTURED if getattr(body, n, None) is not None]
        raise ApiError(
            400,
            f"{names[0]}: not with a tool_choice that forces a call, nor with 'auto' where the chat "
            "template renders no tools (the calls' shape is the constraint)",
            names[0],
        )
    return _startable(forced, "tool_choice")


def _common(
    body: _Sampling,
    prompts: list[list[int]],
    max_tokens: int | None,
    limits: RequestLimits,
    logprobs: bool,
    top_logprobs: int,
    forced: Grammar | None = None,
) -> Parsed:
    """``forced``: a grammar the request's tool_choice imposes (no structured output beside it)."""
    for name in (
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
    ):
        if not math.isfinite(getattr(body, name)):
            raise ApiError(400, f"{name}: must be a finite number", name)
    if body.top_k > limits.vocab_size:
        raise ApiError(
            400, f"top_k: must be -1 (off) or at most the vocabulary size {limits.vocab_size}", "top_k"
        )
    stop_ids = (
        tuple(_token_list(body.stop_token_ids, "stop_token_ids", limits)) if body.stop_token_ids else ()
    )
    stop = _stop(body.stop, limits)
    longest = max(len(p) for p in prompts)
    ctx = limits.max_context
    if longest >= ctx:
        raise ApiError(
            400,
            f"prompt: {longest} tokens do not fit: this server holds at most {ctx} tokens per "
            f"sequence ({limits.num_gpu_blocks} blocks of {limits.block_size} tokens"
            + (f", model context {limits.text.max_model_len}" if limits.text.max_model_len else "")
            + ") including the output",
            "prompt",
        )
    param = "max_tokens"
    if max_tokens is None:
        max_tokens = ctx - longest
    elif longest + max_tokens > ctx:
        raise ApiError(
            400,
            f"{param}: prompt ({longest} tokens) + max_tokens ({max_tokens}) = "
            f"{longest + max_tokens} exceeds the {ctx} tokens one sequence can hold",
            param,
        )
    if not body.ignore_eos:
        stop_ids = tuple(dict.fromkeys(stop_ids + limits.text.eos_token_ids))
    if body.min_tokens > max_tokens:
        raise ApiError(
            400, f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})", "min_tokens"
        )
    if body.priority and limits.scheduling_policy != "priority":
        raise ApiError(
            400,
            "priority: this server schedules first come, first served (start it with "
            "--scheduling-policy priority to honour priorities)",
            "priority",
        )
    grammar = _token_constraints(body, _forced_or_asked(forced, body, limits), stop_ids, limits)
    beam = _beam(body, stop, stop_ids, grammar, limits)
    sampling = SamplingOptions(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(0, body.top_k),
        seed=body.seed,
        logprobs=top_logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        logit_bias=_logit_bias(body.logit_bias, limits),
        grammar=grammar,
    )
    if beam is not None:  # nothing is drawn: the sampling knobs do not apply (docs/serve.md)
        sampling = SamplingOptions(logprobs=top_logprobs)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed with stream: true", "stream_options")
    return Parsed(
        prompts,
        max_tokens,
        body.n,
        sampling,
        stop_ids,
        stop,
        body.stream,
        include_usage,
        logprobs,
        top_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        min_tokens=body.min_tokens,
        return_token_ids=bool(body.return_token_ids),
        return_tokens_as_token_ids=bool(body.return_tokens_as_token_ids),
        prompt_logprobs=_prompt_logprobs(body, limits),
        request_id=body.request_id,
        priority=body.priority,
        cache_salt=body.cache_salt or "",
        beam=beam,
    )


def _beam(
    body: _Sampling,
    stop: tuple[str, ...],
    stop_ids: tuple[int, ...],
    constraint: Any,
    limits: RequestLimits,
) -> BeamParams | None:
    """vLLM's use_beam_search: n beams (the width), scored with length_penalty, ending at the
    stop token ids (EOS unless ignore_eos). The beams rank the model's own log-softmax, so what
    would change the distribution or cut a beam's text is refused by name; the sampling knobs
    (temperature, top_p, top_k, min_p, seed) draw nothing here and do not apply, as in vLLM and
    transformers. length_penalty only scores beams: refused without them."""
    if not math.isfinite(body.length_penalty):
        raise ApiError(400, "length_penalty: must be a finite number", "length_penalty")
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            raise ApiError(
                400,
                "length_penalty: it scores beam search's hypotheses, and this request samples "
                "(send use_beam_search: true, or leave length_penalty at 1)",
                "length_penalty",
            )
        return None
    # ``constraint``: the request's grammar or token constraints (_token_constraints), if any.
    constrained = [
        n for n in ("min_tokens", "bad_words", "allowed_token_ids", *_STRUCTURED) if getattr(body, n, None)
    ]
    asks = {
        "presence_penalty": body.presence_penalty != 0.0,
        "frequency_penalty": body.frequency_penalty != 0.0,
        "repetition_penalty": body.repetition_penalty != 1.0,
        "logit_bias": bool(body.logit_bias),
        "stop": bool(stop),
        (constrained or ["tool_choice"])[0]: constraint is not None,
    }
    name = next((n for n, asked in asks.items() if asked), None)
    if name == "stop":
        raise ApiError(
            400,
            "stop: not with use_beam_search (a stop string would cut a beam after the search scored "
            "it: beams end at stop_token_ids and EOS)",
            name,
        )
    if name is not None:
        raise ApiError(
            400,
            f"{name}: not with use_beam_search (beam search ranks the model's own log-softmax, "
            "which this would change)",
            name,
        )
    k = candidates_per_beam(body.n, len(stop_ids))
    most = min(MAX_TOP_LOGPROBS, limits.vocab_size)
    if k > most:
        raise ApiError(
            400,
            f"n: a beam search of width {body.n} with {len(stop_ids)} stop tokens keeps {k} candidates "
            f"per beam, and the workers return at most {most} (max(2, 1 + stop tokens) * n)",
            "n",
        )
    return BeamParams(body.length_penalty)


def _prompt_logprobs(body: _Sampling, limits: RequestLimits) -> int | None:
    """vLLM's prompt_logprobs: alternatives per prompt position, bounded as logprobs' (vLLM's
    default max_logprobs is the same 20); -1, vLLM's whole vocabulary, is over that bound too. A
    stream sends no prompt logprobs (as vLLM's), so it may only ask for 0, and then nothing is
    computed."""
    n = body.prompt_logprobs
    if n is None:
        return None
    if n < -1:
        raise ApiError(400, "prompt_logprobs: must be -1 (the whole vocabulary) or >= 0", "prompt_logprobs")
    if body.stream and n != 0:
        raise ApiError(
            400,
            "prompt_logprobs: not available with stream: true (as in vLLM: a stream sends no prompt "
            "logprobs); send 0 or null, or stream: false",
            "prompt_logprobs",
        )
    if n == -1 or n > MAX_TOP_LOGPROBS:
        asked = f"-1 asks for the whole vocabulary ({limits.vocab_size} tokens)" if n == -1 else f"{n} asked"
        raise ApiError(
            400,
            f"prompt_logprobs: at most {MAX_TOP_LOGPROBS} alternatives per position, as logprobs ({asked})",
            "prompt_logprobs",
        )
    return None if body.stream else n


def _truncated(
    prompts: list[list[int]], body: _Sampling, max_tokens: int | None, limits: RequestLimits
) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: each prompt cut to its last (``truncation_side`` "left", the
    default) or first ("right") that many tokens; -1: as many as leave room for max_tokens (one
    token when max_tokens is not set) in what one sequence holds."""
    k = body.truncate_prompt_tokens
    if k is None:
        return prompts
    if k == -1:
        k = limits.max_context - (max_tokens or 1)
    if k < 1:
        raise ApiError(
            400,
            "truncate_prompt_tokens: leaves no prompt token (max_tokens takes the context)",
            "truncate_prompt_tokens",
        )
    if body.truncation_side == "right":
        return [p[:k] for p in prompts]
    return [p[-k:] for p in prompts]


_Body = TypeVar("_Body", bound=_Sampling)


def _screened(raw: dict[str, Any], policy: Mapping[str, Ignored | Refused]) -> dict[str, Any]:
    """The body without the fields frontend/serve/openai_fields.py ignores (or refuses, with a 400),
    in the body, its stream_options and each message."""
    out = screen(raw, policy)
    if isinstance(out.get("stream_options"), dict):
        out["stream_options"] = screen(out["stream_options"], STREAM_OPTIONS, "stream_options.")
    if isinstance(out.get("messages"), list):
        out["messages"] = [
            screen(m, MESSAGE, f"messages.{i}.") if isinstance(m, dict) else m
            for i, m in enumerate(out["messages"])
        ]
    return out


def _validated(
    raw: Any, model: type[_Body], limits: RequestLimits, policy: Mapping[str, Ignored | Refused]
) -> _Body:
    """The request body as ``model``, for the served model; a 400 naming the first bad field."""
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        body = model.model_validate(_screened(raw, policy))
    except FieldRefused as e:
        raise ApiError(400, str(e), e.param) from None
    except ValidationError as e:
        raise validation_error(e) from None
    check_model(body.model, limits)
    return body


def parse_completion(raw: Any, limits: RequestLimits) -> Parsed:
    body = _validated(raw, CompletionBody, limits, COMPLETION)
    if body.echo and body.logprobs is not None:
        raise ApiError(
            400,
            "echo: not supported together with logprobs (the echoed prompt's tokens get no logprobs "
            "entries; prompt_logprobs returns the prompt's)",
            "echo",
        )
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of: only best_of == n is supported", "best_of")
    whole = _prompts(body.prompt, limits, body.add_special_tokens is not False)
    prompts = _truncated(whole, body, body.max_tokens, limits)
    parsed = _common(body, prompts, body.max_tokens, limits, body.logprobs is not None, body.logprobs or 0)
    if body.echo:
        parsed.echo = (
            _echo_texts(body.prompt, prompts, limits)
            if prompts == whole
            else _echo_texts(None, prompts, limits)  # the prompt as truncated
        )
    return parsed


def _echo_texts(prompt: Any, prompts: list[list[int]], limits: RequestLimits) -> tuple[str, ...]:
    """What echo repeats: a text prompt as sent; token ids as the tokenizer decodes them (special
    tokens included: they are part of the prompt), nothing without a tokenizer."""
    if isinstance(prompt, str):
        return (prompt,)
    if prompt and all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    tok = limits.text.tokenizer
    return tuple(str(tok.decode(p)) if tok is not None else "" for p in prompts)


def _part_text(part: dict[str, Any], where: str) -> str:
    """A content part's text: a text part, or an (assistant's) refusal part; others are refused."""
    try:
        part = screen(part, CONTENT_PART, f"{where}.")
    except FieldRefused as e:
        raise ApiError(400, str(e), e.param) from None
    kind = part.get("type")
    if kind not in ("text", "refusal"):
        raise ApiError(400, f"{where}.type: only text parts are supported (got {kind!r})", f"{where}.type")
    extra = next((k for k in part if k not in ("type", kind)), None)
    if extra is not None:
        raise ApiError(400, f"{where}.{extra}: unknown field of a {kind} part", f"{where}.{extra}")
    if not isinstance(part.get(kind), str):
        raise ApiError(400, f"{where}.{kind}: expected a string", f"{where}.{kind}")
    return str(part[kind])


def parse_chat(raw: Any, limits: RequestLimits) -> Parsed:
    body = _validated(raw, ChatBody, limits, CHAT)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs: true", "top_logprobs")
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(
            400,
            "continue_final_message: not with add_generation_prompt: true (the final message is "
            "continued, so no new turn is opened): send add_generation_prompt: false",
            "continue_final_message",
        )
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise ApiError(
            400, "continue_final_message: the final message must be the assistant's", "continue_final_message"
        )
    tools = _tools(body, limits)
    prompt = chat_prompt(
        body.messages,
        limits,
        body.add_generation_prompt,
        tools=tools,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs,
        documents=body.documents,
        add_special_tokens=bool(body.add_special_tokens),
    )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompts = _truncated([prompt], body, max_tokens, limits)
    parsed = _common(body, prompts, max_tokens, limits, body.logprobs, body.top_logprobs or 0, tools.grammar)
    parsed.tools = tools.calling
    # vLLM's echo: the answer starts with the last message when it has the answer's role (the
    # assistant's: a new turn, or the one continue_final_message continues).
    last = body.messages[-1]
    if body.echo and last.role == "assistant":
        content = last.content if isinstance(last.content, str) else ""
        if isinstance(last.content, list):
            content = "".join(
                _part_text(p, f"messages.{len(body.messages) - 1}.content.{j}")
                for j, p in enumerate(last.content)
            )
        parsed.echo = (content,)
    return parsed


def _tools(body: ChatBody, limits: RequestLimits) -> ToolRequest:
    try:
        return tool_request(
            body.tools,
            body.tool_choice,
            body.parallel_tool_calls,
            template_source(limits.text.tokenizer),
            limits.tool_call_parser,
            limits.grammar_compiler() if limits.text.tokenizer is not None and body.tools else None,
        )
    except ToolError as e:
        raise ApiError(400, str(e), e.param) from None


def chat_prompt(
    messages: list[ChatMessage],
    limits: RequestLimits,
    add_generation_prompt: bool = True,
    tools: ToolRequest | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """The messages (and the tools, as frontend/serve/tools.py decided) rendered by the chat template
    and tokenized (special tokens as their ids). ``continue_final_message``: the prompt ends with
    the final message's text, its turn left open; ``template_kwargs``: variables for the template
    (e.g. Qwen3's ``enable_thinking``); ``documents``: given to the template for retrieval
    prompts; ``add_special_tokens``: the tokenizer's BOS/EOS around the rendered text as well."""
    if not limits.text.has_chat_template:
        raise ApiError(
            400,
            "messages: this model has no chat template (neither its GGUF file nor its tokenizer "
            "files give one, as for a base model); use /v1/completions",
            "messages",
        )
    template = template_source(limits.text.tokenizer)
    calls_in_template = renders_tool_calls(template)
    rendered: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.content is None and m.refusal is None and not m.tool_calls:
            raise ApiError(400, f"messages.{i}.content: this field is required", f"messages.{i}.content")
        if isinstance(m.content, list):
            text = "".join(_part_text(part, f"messages.{i}.content.{j}") for j, part in enumerate(m.content))
        else:
            text = m.content or ""
        text += m.refusal or ""
        msg: dict[str, Any] = {"role": m.role, "content": text}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            _add_tool_calls(msg, m.tool_calls, f"messages.{i}.tool_calls", calls_in_template)
        if m.role == "tool" and not calls_in_template:
            _add_tool_result(rendered, text)
            continue
        rendered.append(msg)
    if tools is not None and tools.system_text is not None:
        if rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{tools.system_text}"}
        else:
            rendered.insert(0, {"role": "system", "content": tools.system_text})
    reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(template_kwargs or {})
    if reserved:
        name = sorted(reserved)[0]
        raise ApiError(
            400,
            f"chat_template_kwargs.{name}: set by the request's own field, not here",
            f"chat_template_kwargs.{name}",
        )
    try:
        prompt = limits.text.chat_prompt(
            rendered,
            add_generation_prompt,
            tools.template_tools if tools is not None else None,
            continue_final_message=continue_final_message,
            documents=documents,
            add_special_tokens=add_special_tokens,
            **(template_kwargs or {}),
        )
    except ContinuationError as e:
        raise ApiError(400, f"continue_final_message: {e}", "continue_final_message") from None
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages is the caller's input
        raise ApiError(400, f"messages: the chat template rejected them: {e}", "messages") from None
    if not prompt:
        raise ApiError(400, "messages: the chat template produced an empty prompt", "messages")
    bad = next((t for t in prompt if t >= limits.vocab_size), None)
    if bad is not None:
        raise ApiError(
            400,
            f"messages: the tokenizer produced token id {bad}, outside the model's vocabulary",
            "messages",
        )
    return prompt


def _add_tool_result(rendered: list[dict[str, Any]], result: str) -> None:
    """A tool's result, for a template that renders no tool turns (its roles may be only the user's
    and the assistant's): a user turn saying what the function returned (the results of calls made
    together share one), with the words that get a small model to answer from it rather than call
    again (SmolLM2-135M does with these, tests/frontend/serve/test_real_model.py)."""
    said = result.strip()
    said = f"The function returned: {said}{'' if said.endswith(('.', '!', '?')) else '.'}"
    ask = TOOL_RESULT_ASK
    last = rendered[-1] if rendered else None
    if last is not None and last.get("role") == "user" and last["content"].endswith(ask):
        rendered[-1] = {**last, "content": f"{last['content'][: -len(ask)]}{said} {ask}"}
    else:
        rendered.append({"role": "user", "content": f"{said} {ask}"})


TOOL_RESULT_ASK = "Answer my question in words."


def _add_tool_calls(msg: dict[str, Any], calls: list[ToolCallParam], where: str, in_template: bool) -> None:
    """An assistant's earlier calls, for the template: as ``tool_calls`` with the arguments parsed
    (what transformers' templates expect) where the template renders them, else as the text
    frontend/serve/tools.py's fallback asks a model to write."""
    if msg["role"] != "assistant":
        raise ApiError(400, f"{where}: only assistant messages carry tool calls", where)
    arguments = []
    for j, call in enumerate(calls):
        param = f"{where}.{j}.function.arguments"
        try:
            arguments.append(json.loads(call.function.arguments))
        except ValueError as e:
            raise ApiError(400, f"{param}: not JSON: {e}", param) from None
    if in_template:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": a}}
            for c, a in zip(calls, arguments, strict=True)
        ]
    else:
        msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + calls_as_text(calls, arguments)
