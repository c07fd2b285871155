"""Turn a validated request into prompt token ids, and check them against the context.

CPU work that grows with the request: the gateway runs it on its prepare threads
(serving/prepare.py), never on the event loop. In a chat, only the template's own markers
become control tokens; the caller's text stays text (text/control_tokens.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.router.protocol.errors import ApiError, invalid_request
from kvflow.router.protocol.messages import ChatMessage
from kvflow.router.protocol.requests import Prompt
from kvflow.router.text.chat_template import ChatTemplateError, RenderTimeoutError
from kvflow.router.text.control_tokens import ControlTokenGuard, Escaped
from kvflow.router.text.model_files import TextModel


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    text: str  # for `echo`; the decoded ids when the prompt came as ids


def context_length_exceeded(num_prompt: int, max_tokens: int | None, max_len: int) -> ApiError:
    if max_tokens is None or num_prompt >= max_len:
        detail = f"your prompt has {num_prompt} tokens"
    else:
        detail = (
            f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
            f"{max_tokens} in the completion)"
        )
    return invalid_request(
        f"This model's maximum context length is {max_len} tokens; however, {detail}. "
        "Please shorten the prompt or reduce max_tokens.",
        param="messages" if max_tokens is None else "max_tokens",
        code="context_length_exceeded",
    )


def check_context(num_prompt: int, max_tokens: int | None, max_len: int) -> None:
    """The worker generates at least one token, so the prompt must leave room for it."""
    if num_prompt == 0:
        raise invalid_request("The prompt is empty.", param="prompt")
    if num_prompt >= max_len or (max_tokens is not None and num_prompt + max_tokens > max_len):
        raise context_length_exceeded(num_prompt, max_tokens, max_len)


class PromptBuilder:
    def __init__(self, text_model: TextModel) -> None:
        self._text = text_model
        self._guard = ControlTokenGuard(text_model.tokenizer)

    def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> PreparedPrompt:
        template = self._text.chat_template
        if template is None:
            raise invalid_request(
                "This model has no chat template; use /v1/completions with a plain prompt.",
                param="messages",
            )
        guard, escaped = self._guard, Escaped()
        try:
            text = template.render(
                guard.escape([m.as_template_dict() for m in messages], escaped),
                add_generation_prompt=add_generation_prompt,
                extra=guard.escape(dict(template_kwargs or {}), escaped),
            )
        except RenderTimeoutError:
            raise  # the prepare pool's limit, not the messages' fault alone
        except ChatTemplateError as exc:
            raise invalid_request(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from exc
        # The template writes any BOS itself; adding special tokens again would double it.
        ids = guard.encode(text, escaped)
        return PreparedPrompt(ids, guard.restore(text, escaped))

    def completion(self, prompt: Prompt) -> PreparedPrompt:
        tokenizer = self._text.tokenizer
        if isinstance(prompt, str):
            return PreparedPrompt(tokenizer.encode(prompt, add_special_tokens=True), prompt)
        vocab_size = tokenizer.vocab_size
        bad = next((t for t in prompt if t >= vocab_size), None)
        if bad is not None:
            raise invalid_request(
                f"Invalid 'prompt': token id {bad} is outside the vocabulary (size {vocab_size}).",
                param="prompt",
            )
        return PreparedPrompt(list(prompt), tokenizer.decode(prompt, skip_special_tokens=False))
