"""Parse and validate `/v1/chat/completions` and `/v1/completions` bodies into typed records.

Pure: no I/O, no tokenizer. What OpenAI supports and we do not (tools, images, penalties)
is a 400 naming the parameter; what changes nothing here (``user``, ``metadata``) is
accepted; anything unknown is a 400, as OpenAI answers it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.router.protocol.errors import invalid_request, unsupported_parameter
from kvflow.router.protocol.fields import Fields, as_mapping, invalid_type
from kvflow.router.protocol.messages import ChatMessage, parse_messages

MAX_N = 128  # OpenAI's limit for `n`
MAX_STOP_STRINGS = 4  # OpenAI's limit for `stop`
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5

# Accepted and without effect here: account metadata and OpenAI-side storage options.
_IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int | None  # None: up to the model's context
    temperature: float | None  # None: 1.0, OpenAI's default
    top_p: float | None
    top_k: int  # 0: disabled
    min_p: float  # 0: disabled
    seed: int | None
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    n: int
    logprobs: bool
    top_logprobs: int
    ignore_eos: bool
    # vLLM's extensions, with vLLM's meaning and defaults.
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    skip_special_tokens: bool = True  # False: special tokens appear in the text by name


@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False  # a last chunk with the request's usage
    # vLLM's extension: every chunk also carries its choice's usage so far. Load generators
    # (guidellm, vLLM's benchmarks) send it with every streaming request.
    continuous_usage_stats: bool = False


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingOptions
    stream: bool
    stream_options: StreamOptions
    # vLLM's extensions: variables for the chat template (e.g. {"enable_thinking": false})
    # and whether it ends with the assistant's turn header.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True

    @property
    def include_usage(self) -> bool:
        return self.stream_options.include_usage


Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[Prompt, ...]
    sampling: SamplingOptions
    stream: bool
    stream_options: StreamOptions
    echo: bool

    @property
    def include_usage(self) -> bool:
        return self.stream_options.include_usage


def _stop(fields: Fields) -> tuple[str, ...]:
    value = fields.raw("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_type("stop", "a string or an array of strings", value)
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_request(
            f"Invalid 'stop': at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}.",
            param="stop",
        )
    if any(s == "" for s in stops):
        raise invalid_request("Invalid 'stop': stop strings must not be empty.", param="stop")
    return tuple(stops)


def _stop_token_ids(fields: Fields) -> tuple[int, ...]:
    value = fields.raw("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise invalid_type("stop_token_ids", "an array of non-negative integers", value)
    return tuple(value)


def _max_tokens(fields: Fields, default: int | None) -> int | None:
    legacy = fields.integer("max_tokens", low=1)
    new = fields.integer("max_completion_tokens", low=1)
    if legacy is not None and new is not None and legacy != new:
        raise invalid_request(
            "Pass one of 'max_tokens' and 'max_completion_tokens', not both.",
            param="max_completion_tokens",
        )
    chosen = new if new is not None else legacy
    return default if chosen is None else chosen


def _stream_options(fields: Fields, stream: bool) -> StreamOptions:
    value = fields.raw("stream_options")
    if value is None:
        return StreamOptions()
    if not stream:
        raise invalid_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    options = as_mapping(value, "stream_options")
    known = {"include_usage", "include_obfuscation", "continuous_usage_stats"}
    unknown = set(options) - known
    if unknown:
        raise unsupported_parameter(f"stream_options.{sorted(unknown)[0]}")
    flags = {}
    for name in known:
        flag = options.get(name, False)
        if not isinstance(flag, bool):
            raise invalid_type(f"stream_options.{name}", "a boolean", flag)
        flags[name] = flag
    # As vLLM: per-chunk usage only when usage is asked for at all.
    return StreamOptions(
        flags["include_usage"], flags["include_usage"] and flags["continuous_usage_stats"]
    )


def _common_sampling(
    fields: Fields, *, logprobs: bool, top_logprobs: int, max_tokens_default: int | None
) -> SamplingOptions:
    for penalty in ("frequency_penalty", "presence_penalty"):
        fields.number(penalty, low=-2, high=2)
    fields.reject_if_set(
        "frequency_penalty", "is not supported by kvflow; omit it or pass 0", allowed=(0, 0.0)
    )
    fields.reject_if_set(
        "presence_penalty", "is not supported by kvflow; omit it or pass 0", allowed=(0, 0.0)
    )
    fields.reject_if_set("logit_bias", "is not supported by kvflow")
    seed = fields.integer("seed", low=-(2**63), high=2**64 - 1)
    return SamplingOptions(
        max_tokens=_max_tokens(fields, max_tokens_default),
        temperature=fields.number("temperature", low=0, high=2),
        top_p=fields.number("top_p", low=0, high=1),
        top_k=fields.integer("top_k", low=0) or 0,
        min_p=fields.number("min_p", low=0, high=1) or 0.0,
        # The worker's seed is unsigned 64-bit: wrap negative seeds instead of refusing them.
        seed=None if seed is None else seed % 2**64,
        stop_strings=_stop(fields),
        stop_token_ids=_stop_token_ids(fields),
        n=fields.integer("n", low=1, high=MAX_N) or 1,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=fields.boolean("ignore_eos"),
        include_stop_str_in_output=fields.boolean("include_stop_str_in_output"),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
    )


def parse_chat_request(body: object) -> ChatRequest:
    fields = Fields(body)
    model = fields.string("model", required=True)
    assert model is not None
    messages = parse_messages(fields)
    logprobs = fields.boolean("logprobs")
    top_logprobs = fields.integer("top_logprobs", low=0, high=MAX_TOP_LOGPROBS_CHAT) or 0
    if top_logprobs and not logprobs:
        raise invalid_request(
            "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs"
        )
    sampling = _common_sampling(
        fields, logprobs=logprobs, top_logprobs=top_logprobs, max_tokens_default=None
    )
    stream = fields.boolean("stream")
    stream_options = _stream_options(fields, stream)
    for name in ("tools", "functions", "audio", "prediction", "web_search_options"):
        fields.reject_if_set(name, "is not supported by kvflow")
    fields.reject_if_set("tool_choice", "is not supported by kvflow", allowed=("none", "auto"))
    fields.reject_if_set("function_call", "is not supported by kvflow", allowed=("none",))
    fields.reject_if_set("modalities", 'supports only ["text"]', allowed=(["text"],))
    fields.reject_if_set("reasoning_effort", "is not supported by this model")
    response_format = fields.raw("response_format")
    if (
        response_format is not None
        and as_mapping(response_format, "response_format").get("type") != "text"
    ):
        raise unsupported_parameter("response_format", 'supports only {"type": "text"}')
    kwargs = fields.raw("chat_template_kwargs")
    template_kwargs = dict(as_mapping(kwargs, "chat_template_kwargs")) if kwargs else {}
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(
        template_kwargs
    )
    if reserved:
        raise invalid_request(
            f"Invalid 'chat_template_kwargs': '{sorted(reserved)[0]}' is set by the gateway.",
            param="chat_template_kwargs",
        )
    add_generation_prompt = fields.boolean("add_generation_prompt", True)
    fields.reject_if_set("continue_final_message", "is not supported by kvflow", allowed=(False,))
    fields.reject_if_set("echo", "is not supported by kvflow for chat", allowed=(False,))
    fields.ignore(*_IGNORED, "parallel_tool_calls")
    fields.reject_unknown()
    return ChatRequest(model, messages, sampling, stream, stream_options, template_kwargs,
                       add_generation_prompt)  # fmt: skip


def _prompts(fields: Fields) -> tuple[Prompt, ...]:
    value = fields.required("prompt")
    problem = invalid_type(
        "prompt", "a string, an array of strings, or an array of token ids (or of arrays)", value
    )

    def token_ids(items: list[Any]) -> tuple[int, ...]:
        if not items or not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise problem
        if any(t < 0 for t in items):
            raise invalid_request("Invalid 'prompt': token ids must be >= 0.", param="prompt")
        return tuple(items)

    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise problem
    if all(isinstance(p, str) for p in value):
        return tuple(value)
    if all(isinstance(p, list) for p in value):
        return tuple(token_ids(p) for p in value)
    return (token_ids(value),)


def parse_completion_request(body: object) -> CompletionRequest:
    fields = Fields(body)
    model = fields.string("model", required=True)
    assert model is not None
    prompts = _prompts(fields)
    num_logprobs = fields.integer("logprobs", low=0, high=MAX_LOGPROBS_COMPLETIONS)
    # OpenAI's legacy endpoint defaults to 16 tokens.
    sampling = _common_sampling(
        fields,
        logprobs=num_logprobs is not None,
        top_logprobs=num_logprobs or 0,
        max_tokens_default=16,
    )
    stream = fields.boolean("stream")
    stream_options = _stream_options(fields, stream)
    echo = fields.boolean("echo")
    if echo and num_logprobs is not None:
        raise unsupported_parameter("echo", "with 'logprobs' is not supported by kvflow")
    fields.reject_if_set("suffix", "is not supported by this model", allowed=("",))
    best_of = fields.integer("best_of", low=1)
    if best_of is not None and best_of != sampling.n:
        raise unsupported_parameter("best_of", "is supported only when equal to 'n'")
    fields.ignore(*_IGNORED)
    fields.reject_unknown()
    return CompletionRequest(model, prompts, sampling, stream, stream_options, echo)
