"""Chat templates: a conversation (role/content messages) as the prompt text a model expects.

Hugging Face checkpoints carry their chat template as a Jinja2 source string
(``tokenizer_config.json``'s ``chat_template``); a ``.litertlm`` bundle written by
``runtime export`` carries the same string. It is rendered in Jinja2's immutable sandbox,
so a template from a downloaded file cannot reach Python objects or the file system.

A template with no place for a system message (Gemma 2's, Mistral's first ones, a
template that renders only the last message) would drop the system message without a
word under Hugging Face's ``apply_chat_template``. Here, as in llama.cpp (its built-in
Gemma format and minja's ``polyfill_system_role``), the system text is joined to the next
user turn instead (system, blank line, user text); whether the template has such a place
is probed once, when the template is built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from runtime.errors import InvalidArgumentError

_ROLES = ("system", "user", "assistant", "tool")
# Text looked for in the probe's rendering: digits, which a template's trim, upper or title leaves as they are.
_SYSTEM_PROBE = "90210437718265"


class ChatTemplate:
    """A Jinja2 chat template with the names templates use (``messages``,
    ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``,
    ``strftime_now``), in the environment of Hugging Face's ``apply_chat_template``, which
    templates are written for: ``{% break %}``/``{% continue %}``, ``{% generation %}``
    blocks (rendered as they are) and a ``tojson`` that writes text as it is.

    ``renders_system``: whether the template puts a system message in its prompt (probed
    once with a system and a user message); when it does not, ``render`` joins each system
    message to the next user turn rather than let the template drop it."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        """``source``: the template text; ``bos_token`` / ``eos_token``: the texts of the
        tokenizer's special tokens, which many templates insert."""
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not isinstance(source, str) or not source.strip():
            raise InvalidArgumentError("a chat template must be a non-empty string")
        for name, value in (("bos_token", bos_token), ("eos_token", eos_token)):
            if not isinstance(value, str):
                raise InvalidArgumentError(f"{name}={value!r:.40}, expected a str (the token's text, '' for none)")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[loopcontrols, _generation_blocks()])
        environment.globals["raise_exception"] = _raise_template_error
        environment.globals["strftime_now"] = _strftime_now
        environment.filters["tojson"] = _tojson
        try:
            self._template = environment.from_string(source)
        except TemplateError as exc:
            raise InvalidArgumentError(f"chat template does not parse: {exc}") from None
        self.renders_system = _SYSTEM_PROBE in self._render_or_empty(
            [{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": "hello"}])

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (each ``{"role": ..., "content": str}``), ending
        with the assistant's turn opened when ``add_generation_prompt``.

        When the template has no place for a system message (``renders_system`` false), each
        system message is joined to the next user turn (``system + "\\n\\n" + user``), or
        becomes a user turn of its own when no user turn follows it, as llama.cpp does.

        ``InvalidArgumentError`` when the template fails on them (its ``raise_exception``,
        or any error of its own: it is data from a file)."""
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise InvalidArgumentError(f"messages is {type(messages).__name__}, expected a list of "
                                       "{role, content} objects")
        checked = [_check_message(i, message) for i, message in enumerate(messages)]
        if not checked:
            raise InvalidArgumentError("messages is empty: a chat needs at least one message")
        if not self.renders_system:
            checked = _system_into_user_turns(checked)
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except Exception as exc:  # Jinja's TemplateError, or what the template's Python operations raise
            raise InvalidArgumentError(f"chat template failed on these messages: {exc}") from None

    def _render_or_empty(self, messages: list[dict[str, str]]) -> str:
        """The template's text for ``messages``, or ``""`` when it fails on them (a template
        that refuses a system role with ``raise_exception`` has no place for one)."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception:  # the template's own refusal or failure: only the probe's answer is wanted
            return ""


def _system_into_user_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """``messages`` with each run of system messages joined to the head of the next user
    turn, or made a user turn where an assistant or tool turn, or the end, comes first."""
    merged: list[dict[str, str]] = []
    pending: list[str] = []
    for message in messages:
        if message["role"] == "system":
            pending.append(message["content"])
            continue
        if pending:
            system = "\n\n".join(pending)
            pending = []
            if message["role"] == "user":
                message = {"role": "user", "content": f"{system}\n\n{message['content']}"}
            else:
                merged.append({"role": "user", "content": system})
        merged.append(message)
    if pending:
        merged.append({"role": "user", "content": "\n\n".join(pending)})
    return merged


def _check_message(index: int, message: Any) -> dict[str, str]:
    if not isinstance(message, Mapping):
        raise InvalidArgumentError(f"messages[{index}] is {type(message).__name__}, expected an object")
    role, content = message.get("role"), message.get("content")
    if role not in _ROLES:
        raise InvalidArgumentError(f"messages[{index}].role={role!r:.40}, expected one of {', '.join(_ROLES)}")
    if not isinstance(content, str):
        raise InvalidArgumentError(f"messages[{index}].content must be a string, got {type(content).__name__}")
    return {"role": role, "content": content}


def _generation_blocks() -> type:
    """The Jinja2 extension for ``{% generation %}...{% endgeneration %}`` (what marks an
    assistant's tokens for training in Hugging Face's templates): the body, rendered as it is."""
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> list:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationBlocks


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson``: ``json.dumps`` (Jinja's escapes ``<``, ``>``, ``&`` and ``'``
    for HTML, which a prompt must not)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """The local time now in ``format`` (templates that state today's date)."""
    return datetime.now().strftime(format)


def _raise_template_error(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)
