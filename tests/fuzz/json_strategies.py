"""hypothesis strategies for JSON that `json.loads` can hand the gateway.

Python's json reads NaN, Infinity and integers of any size, so those are in. Bodies are
built near the valid ones (a valid base with fields replaced by anything) because a
uniformly random object almost never gets past the first check.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", "text", "user", "system", "none", "auto", "sim", "\x00", "é"])
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)

CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs",
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "stream",
    "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "tools",
    "functions", "audio", "prediction", "web_search_options", "tool_choice", "function_call",
    "modalities", "reasoning_effort", "response_format", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "echo", "user", "metadata",
    "parallel_tool_calls", "structured_outputs", "unknown_field",
]  # fmt: skip
COMPLETION_FIELDS = [
    *(f for f in CHAT_FIELDS if f not in ("messages", "top_logprobs", "chat_template_kwargs")),
    "prompt", "suffix", "best_of",
]  # fmt: skip

# Values that pass one check so the next one is reached.
PLAUSIBLE = st.one_of(
    JSON,
    st.integers(-3, 300),
    st.floats(-3, 3),
    st.lists(st.integers(-2, 60_000), max_size=5),
    st.lists(st.text(max_size=4), max_size=6),
    st.fixed_dictionaries({}, optional={"include_usage": JSON, "continuous_usage_stats": JSON,
                                        "type": st.sampled_from(["text", "json_object",
                                                                 "json_schema", "function"]),
                                        "json_schema": JSON, "function": JSON, "regex": JSON,
                                        "json": JSON, "choice": JSON, "grammar": JSON}),
    st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g", "bad name"]), "parameters": JSON})}), max_size=2),
    st.sampled_from(["none", "auto", "required"]),
)  # fmt: skip

MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | JSON,
        "content": st.text(max_size=20)
        | st.lists(
            st.fixed_dictionaries(
                {}, optional={"type": st.sampled_from(["text", "image_url"]) | JSON, "text": JSON}
            ),
            max_size=3,
        )
        | JSON,
        "name": st.text(max_size=5) | JSON,
        "tool_calls": JSON
        | st.lists(
            st.fixed_dictionaries(
                {
                    "id": JSON,
                    "type": st.just("function") | JSON,
                    "function": st.fixed_dictionaries(
                        {
                            "name": st.text(max_size=4) | JSON,
                            "arguments": st.text(max_size=8) | JSON,
                        }
                    ),
                }
            ),
            max_size=2,
        ),
        "tool_call_id": st.text(max_size=4) | JSON,
    },
)


@st.composite
def bodies(draw: st.DrawFn, *, is_chat: bool) -> Any:
    """A request body: sometimes any JSON at all, mostly a valid base with fields replaced."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    body: dict[str, Any] = {"model": "sim"}
    if is_chat:
        body["messages"] = draw(st.lists(MESSAGE, min_size=1, max_size=4) | JSON)
    else:
        body["prompt"] = draw(
            st.text(max_size=10)
            | st.lists(st.integers(-1, 70_000), max_size=4)
            | st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=3)
            | JSON
        )
    names = CHAT_FIELDS if is_chat else COMPLETION_FIELDS
    for name in draw(st.lists(st.sampled_from(names), max_size=5, unique=True)):
        body[name] = draw(PLAUSIBLE)
    return body
