"""Parse and validate `/v1/chat/completions` and `/v1/completions` bodies into typed records.

Pure: no I/O, no tokenizer. What OpenAI supports and we do not (tools, images) is a 400
naming the parameter; what changes nothing here (``user``, ``metadata``) is accepted;
anything unknown is a 400, as OpenAI answers it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.router.protocol import sampling_fields
from kvflow.router.protocol.errors import invalid_request, unsupported_parameter
from kvflow.router.protocol.fields import Fields, as_mapping, invalid_type
from kvflow.router.protocol.limits import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_N,
    RequestLimits,
    check_count,
    check_schema_size,
)
from kvflow.router.protocol.messages import ChatMessage, parse_messages
from kvflow.router.protocol.sampling_fields import MAX_INT32, MAX_PENALTY
from kvflow.router.structured.constraint import OutputConstraint
from kvflow.router.structured.formats import parse_response_format, parse_structured_outputs
from kvflow.router.tools.constrain import forced_call_constraint
from kvflow.router.tools.spec import ToolChoice, ToolSpec, parse_tool_choice, parse_tools

MAX_N = DEFAULT_MAX_N  # the default; the gateway's own is in RequestLimits
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5
# The fields a model or an operator may give a default to.
DEFAULTABLE = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# Accepted and without effect here: account metadata and OpenAI-side storage options.
# priority_class and service_tier are read by the gateway (protocol/priority_class.py).
_IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
            "priority_class")  # fmt: skip


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
    # OpenAI's penalties over the generated tokens, in [-2, 2]; 0: off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias in [-100, 100]) pairs, sorted by id; ids checked against the model's
    # vocabulary by check_logit_bias once the model is known.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: over prompt and output tokens, > 0, 1: off; and EOS/stop tokens masked until
    # min_tokens tokens have been generated.
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # The format the output must follow (response_format, structured_outputs, a forced
    # tool call); the worker masks every step to it.
    constraint: OutputConstraint | None = None
    # Which of DEFAULTABLE the request left out: the model's and the operator's defaults
    # (serving/defaults.py) fill only these, so an explicit value always wins.
    unset: frozenset[str] = frozenset()


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
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True

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


def check_logit_bias(sampling: SamplingOptions, vocab_size: int) -> None:
    """A 400 naming the first ``logit_bias`` token id outside the model's vocabulary."""
    bad = next((t for t, _ in sampling.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise invalid_request(
            f"Invalid key in 'logit_bias': token id {bad} is outside the vocabulary "
            f"(size {vocab_size}).",
            param="logit_bias",
        )


def _common_sampling(
    fields: Fields,
    *,
    logprobs: bool,
    top_logprobs: int,
    max_tokens_default: int | None,
    limits: RequestLimits,
) -> SamplingOptions:
    seed = fields.integer("seed", low=-(2**63), high=2**64 - 1)
    unset = frozenset(
        name
        for name in DEFAULTABLE
        if not fields.has(name)
        and not (name == "max_tokens" and fields.has("max_completion_tokens"))
    )
    max_tokens = sampling_fields.max_tokens(fields, max_tokens_default)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=fields.number("temperature", low=0, high=2),
        top_p=sampling_fields.top_p(fields),
        top_k=fields.integer("top_k", low=0, high=MAX_INT32) or 0,
        min_p=fields.number("min_p", low=0, high=1) or 0.0,
        # The worker's seed is unsigned 64-bit: wrap negative seeds instead of refusing them.
        seed=None if seed is None else seed % 2**64,
        stop_strings=sampling_fields.stop_strings(fields, limits),
        stop_token_ids=sampling_fields.stop_token_ids(fields, limits),
        n=_n(fields, limits),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=fields.boolean("ignore_eos"),
        include_stop_str_in_output=fields.boolean("include_stop_str_in_output"),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
        presence_penalty=fields.number("presence_penalty", low=-MAX_PENALTY, high=MAX_PENALTY)
        or 0.0,
        frequency_penalty=fields.number("frequency_penalty", low=-MAX_PENALTY, high=MAX_PENALTY)
        or 0.0,
        logit_bias=sampling_fields.logit_bias(fields, limits),
        repetition_penalty=sampling_fields.repetition_penalty(fields),
        min_tokens=sampling_fields.min_tokens(
            fields, None if "max_tokens" in unset else max_tokens
        ),
        unset=unset,
    )


def _n(fields: Fields, limits: RequestLimits) -> int:
    n = fields.integer("n", low=1, high=MAX_INT32) or 1
    check_count("n", "choices per prompt", n, "max_n", limits)
    return n


def _check_schema_sizes(
    constraint: OutputConstraint | None, tools: tuple[ToolSpec, ...], limits: RequestLimits
) -> None:
    """The caller's schemas and grammars within max_schema_bytes and max_schema_depth; they
    are compiled later, off the event loop (serving/prepare.py). A forced tool call's
    grammar is built from the tools, each checked here."""
    for i, tool in enumerate(tools):
        check_schema_size(f"tools[{i}].function.parameters", tool.parameters_json, limits,
                          is_json=True)  # fmt: skip
    if constraint is not None and constraint.param != "tool_choice":
        check_schema_size(constraint.param or "response_format", constraint.source, limits,
                          is_json=constraint.kind == "json_schema")  # fmt: skip


def constraints_to_compile(request: ChatRequest | CompletionRequest) -> list[OutputConstraint]:
    """Every schema and grammar of ``request``, each naming its parameter: the tools'
    argument schemas, then the output's format (serving/prepare.py compiles them)."""
    constraints = []
    if isinstance(request, ChatRequest):
        constraints = [
            OutputConstraint("json_schema", tool.parameters_json, f"tools[{i}].function.parameters")
            for i, tool in enumerate(request.tools)
        ]
    if request.sampling.constraint is not None:
        constraints.append(request.sampling.constraint)
    return constraints


def parse_chat_request(body: object, limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    """The request, every cap of ``limits`` checked. Its schemas and grammars are checked
    for size here and compiled by serving/prepare.py."""
    fields = Fields(body)
    model = fields.string("model", required=True)
    assert model is not None
    messages = parse_messages(fields, limits)
    logprobs = fields.boolean("logprobs")
    top_logprobs = fields.integer("top_logprobs", low=0, high=MAX_TOP_LOGPROBS_CHAT) or 0
    if top_logprobs and not logprobs:
        raise invalid_request(
            "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs"
        )
    sampling = _common_sampling(
        fields, logprobs=logprobs, top_logprobs=top_logprobs, max_tokens_default=None,
        limits=limits,
    )  # fmt: skip
    # One prompt: its n choices are the request's (a cap below max_n still holds).
    check_count("n", "choices", sampling.n, "max_choices_per_request", limits)
    stream = fields.boolean("stream")
    stream_options = _stream_options(fields, stream)
    for name in ("functions", "audio", "prediction", "web_search_options"):
        fields.reject_if_set(name, "is not supported by kvflow; use 'tools'" if name ==
                             "functions" else "is not supported by kvflow")  # fmt: skip
    fields.reject_if_set("function_call", "is deprecated: use 'tool_choice'", allowed=("none",))
    tools = parse_tools(fields.raw("tools"))
    tool_choice = parse_tool_choice(fields.raw("tool_choice"), tools)
    parallel_tool_calls = fields.boolean("parallel_tool_calls", True)
    sampling = replace(sampling, constraint=_chat_constraint(fields, tools, tool_choice,
                                                              parallel_tool_calls))  # fmt: skip
    _check_schema_sizes(sampling.constraint, tools, limits)
    fields.reject_if_set("modalities", 'supports only ["text"]', allowed=(["text"],))
    fields.reject_if_set("reasoning_effort", "is not supported by this model")
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
    fields.ignore(*_IGNORED)
    fields.reject_unknown()
    return ChatRequest(model, messages, sampling, stream, stream_options, template_kwargs,
                       add_generation_prompt, tools, tool_choice,
                       parallel_tool_calls)  # fmt: skip


def _chat_constraint(
    fields: Fields, tools: tuple[ToolSpec, ...], choice: ToolChoice, parallel: bool
) -> OutputConstraint | None:
    """One format for the output: a forced tool call's, response_format's, or kvflow's
    structured_outputs extension; asking for two is a 400."""
    asked = [
        (name, c)
        for name, c in (
            ("tool_choice", forced_call_constraint(tools, choice, parallel=parallel)),
            ("response_format", parse_response_format(fields.raw("response_format"))),
            ("structured_outputs", parse_structured_outputs(fields.raw("structured_outputs"))),
        )
        if c is not None
    ]
    if len(asked) > 1:
        raise invalid_request(
            f"Invalid '{asked[1][0]}': the output already follows '{asked[0][0]}'; "
            "ask for one format at a time.",
            param=asked[1][0],
        )
    if not asked:
        return None
    name, constraint = asked[0]
    return constraint if constraint.param else replace(constraint, param=name)


def _prompts(fields: Fields, limits: RequestLimits) -> tuple[Prompt, ...]:
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
    # An array of arrays is that many prompts; count them before converting any.
    if isinstance(value[0], str | list):
        check_count("prompt", "prompts", len(value), "max_prompts_per_request", limits)
    if all(isinstance(p, str) for p in value):
        return tuple(value)
    if all(isinstance(p, list) for p in value):
        return tuple(token_ids(p) for p in value)
    return (token_ids(value),)


def parse_completion_request(
    body: object, limits: RequestLimits = DEFAULT_LIMITS
) -> CompletionRequest:
    """The request, every cap of ``limits`` checked: prompts, n and their product first,
    before any other field is read."""
    fields = Fields(body)
    model = fields.string("model", required=True)
    assert model is not None
    prompts = _prompts(fields, limits)
    # Choices are tasks and worker streams: refuse their number before reading anything
    # else (the n read again below gives the same value).
    n = _n(fields, limits)
    check_count("n", f"choices ({len(prompts)} prompts x n {n})", len(prompts) * n,
                "max_choices_per_request", limits)  # fmt: skip
    num_logprobs = fields.integer("logprobs", low=0, high=MAX_LOGPROBS_COMPLETIONS)
    # OpenAI's legacy endpoint defaults to 16 tokens.
    sampling = _common_sampling(
        fields,
        logprobs=num_logprobs is not None,
        top_logprobs=num_logprobs or 0,
        max_tokens_default=16,
        limits=limits,
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
