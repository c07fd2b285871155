"""Render chat messages into a prompt with the model's own jinja chat template.

Templates come from model files written by strangers, so they run in jinja's immutable
sandbox: no attribute access to Python internals, no mutation of the messages we pass.
A render has a deadline (``render_deadline``): a thread cannot be stopped from outside, so
the sandbox checks it on every attribute, item and call the template makes, and a render
past it fails with RenderTimeoutError instead of holding its thread.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


class RenderTimeoutError(ChatTemplateError):
    """The render ran past its deadline (render_deadline)."""


_deadline = threading.local()  # this thread's render deadline, time.monotonic() seconds


@contextmanager
def render_deadline(deadline_s: float | None) -> Iterator[None]:
    """Renders on this thread meanwhile fail once time.monotonic() passes ``deadline_s``."""
    previous = getattr(_deadline, "s", None)
    _deadline.s = deadline_s
    try:
        yield
    finally:
        _deadline.s = previous


def check_render_deadline() -> None:
    """Raise RenderTimeoutError once this thread's preparation is past its deadline (the
    template's render checks it at every step; the prepare's other work calls it)."""
    deadline_s = getattr(_deadline, "s", None)
    if deadline_s is not None and time.monotonic() > deadline_s:
        raise RenderTimeoutError("the chat template ran past its time limit")


class _DeadlineSandbox(ImmutableSandboxedEnvironment):
    """Every attribute, item and call of a template passes here: the deadline's checks."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        check_render_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        check_render_deadline()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        check_render_deadline()
        return super().call(__context, __obj, *args, **kwargs)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Hugging Face's `tojson` keeps non-ASCII text as is, unlike jinja's default filter.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template; rendering is pure and thread-safe."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        # The same environment options as Hugging Face's apply_chat_template, so templates
        # written for it render byte-identically here.
        env = _DeadlineSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            compiled = env.from_string(self.source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc
        object.__setattr__(self, "_compiled", compiled)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (each a dict with ``role`` and string ``content``)."""
        variables: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        if extra:
            variables.update(extra)
        try:
            text: str = self._compiled.render(**variables)  # type: ignore[attr-defined]
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template is code we did not write
            # TemplateError, TypeError (arithmetic on a field these messages lack), and
            # whatever else it raises (ZeroDivisionError, the sandbox's OverflowError on a
            # huge range()): a 400 about the messages, never a 500.
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc
        return text
