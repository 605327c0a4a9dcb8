"""The OpenAI API's request bodies (validated strictly) and response shapes, including the
server-sent events of ``stream: true`` exactly as OpenAI clients parse them."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from runtime import SamplerConfig
from runtime.serve.errors import ApiError, bad_request
from runtime.serve.generation import Outcome
from runtime.serve.logprobs import MAX_LOGPROBS

MAX_SCALE = 100.0  # |scale| of one adapter in a blend; beyond it float32 weights lose all meaning
MAX_BLEND = 8  # adapters in one request's lora list
MAX_STOP = 4  # stop strings, as OpenAI allows
DEFAULT_COMPLETION_TOKENS = 16  # max_tokens of /v1/completions when not given, as OpenAI and vLLM
MAX_CHOICES = 128  # n and best_of (and --max-concurrent bounds n x prompts further)
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI allows

# Fields OpenAI defines that this server does not implement: accepted only at their
# neutral value (or null), so that no request is silently answered differently.
UNSUPPORTED = {
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
}


def _text(value: str) -> str:
    """``value`` if it is text: a lone UTF-16 surrogate (JSON's ``"\\ud800"``) is not."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone UTF-16 surrogate (such as \\ud800), which is not text") from None
    return value


Text = Annotated[str, AfterValidator(_text)]


class _Body(BaseModel):
    # strict: no "5" for 5, no 5.0 for an integer, no 1 for true; unknown fields are kept
    # in model_extra so that check() refuses them (or accepts UNSUPPORTED ones at their
    # neutral value): no field is ever silently ignored.
    model_config = ConfigDict(strict=True, extra="allow")


class LoraWeight(BaseModel):
    """One adapter of a request's blend."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: Text = Field(min_length=1, max_length=300)
    scale: float = Field(1.0, ge=-MAX_SCALE, le=MAX_SCALE, allow_inf_nan=False)


class StreamOptions(BaseModel):
    """``stream_options``: whether the stream ends with a usage chunk."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool | None = False


class _GenerationBody(_Body):
    model: Text = Field(min_length=1, max_length=300)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Text | list[Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    lora: list[LoraWeight] | None = Field(None, max_length=MAX_BLEND)
    user: Text | None = None
    # vLLM's sampling extras
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_SCALE, allow_inf_nan=False)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    # OpenAI's choices and sampling adjustments
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS)

    def check(self) -> None:
        """Refuses unknown fields, fields this server does not implement (unless they have
        their neutral value), and fields that contradict each other."""
        for key, value in (self.model_extra or {}).items():
            allowed = UNSUPPORTED.get(key)
            if allowed is None:
                raise bad_request(f"{key!r:.80} is not a field of this endpoint", param=key[:80],
                                  code="unknown_parameter")
            if value is not None and not any(type(value) is type(neutral) and value == neutral for neutral in allowed):
                raise bad_request(f"{key}={json.dumps(value)[:80]} is not supported by this server", param=key,
                                  code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
        limit = self.token_limit
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            raise bad_request(f"min_tokens={self.min_tokens} exceeds the {limit} tokens asked for", param="min_tokens")

    @property
    def token_limit(self) -> int | None:
        """How many tokens to generate at most (``None``: the rest of the context)."""
        return self.max_tokens

    @property
    def token_limit_param(self) -> str | None:
        """The field :attr:`token_limit` comes from (``None``: not given, the default)."""
        return "max_tokens" if self.max_tokens is not None else None

    def sampler_config(self, known_tokens: int, seed: int | None = None) -> SamplerConfig:
        """Temperature (default 1), ``top_p``, ``top_k``, ``seed`` (or the one given: a
        choice's own), the penalties and ``logit_bias`` (its keys token ids in
        ``[0, known_tokens)``, see :func:`check_token_id`) for the core's sampler."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            token = int(key) if key.isascii() and key.isdigit() and len(key) < 12 else -1
            bias[check_token_id(token, known_tokens, "logit_bias", f"logit_bias: key {key!r:.40}")] = value
        return SamplerConfig(temperature=1.0 if self.temperature is None else self.temperature,
                             top_k=max(0, self.top_k or 0), top_p=1.0 if self.top_p is None else self.top_p,
                             seed=self.seed if seed is None else seed, presence_penalty=self.presence_penalty or 0.0,
                             frequency_penalty=self.frequency_penalty or 0.0, logit_bias=tuple(sorted(bias.items())))

    def adapter_param(self, name: str) -> str:
        """The field that names adapter ``name``: ``lora.N`` for the N-th of ``lora``, else
        ``model`` (``adapter`` or ``base::adapter``)."""
        names = [entry.name for entry in self.lora or ()]
        return f"lora.{names.index(name)}" if name in names else "model"

    @property
    def choices(self) -> int:
        """How many choices each prompt gets (``n``)."""
        return self.n or 1

    @property
    def runs(self) -> int:
        """How many generations each prompt runs (``best_of`` for completions, else ``n``)."""
        return self.choices

    @property
    def logprob_count(self) -> int | None:
        """How many top logprobs each token gets; ``None``: no logprobs."""
        return None

    @property
    def echo_prompt(self) -> bool:
        """Whether the prompt is scored and returned before the completion."""
        return False

    def stop_tokens(self, eos: Iterable[int]) -> frozenset[int]:
        """The tokens that end the generation: the tokenizer's ``eos`` (unless
        ``ignore_eos``) and ``stop_token_ids``."""
        return frozenset(() if self.ignore_eos else eos) | frozenset(self.stop_token_ids or ())

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings (at most four)."""
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP:
            raise bad_request(f"stop has {len(stops)} strings; at most {MAX_STOP} are allowed", param="stop")
        if any(not s for s in stops):
            raise bad_request("stop strings must not be empty", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(_GenerationBody):
    """``POST /v1/completions``."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt's logprobs alone
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    def check(self) -> None:
        """As every generation body; ``max_tokens`` 0 only with ``echo``; ``best_of`` at
        least ``n`` and not streamed."""
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens=0 generates nothing; it is allowed with echo: true (the prompt's "
                              "logprobs alone)", param="max_tokens")
        if self.best_of is not None:
            if self.best_of < self.choices:
                raise bad_request(f"best_of={self.best_of} must be at least n={self.choices}", param="best_of")
            if self.stream and self.best_of > self.choices:
                raise bad_request("best_of > n cannot be streamed (the best are known at the end)", param="best_of")

    @property
    def token_limit(self) -> int:
        """``max_tokens``, 16 when not given (as OpenAI and vLLM)."""
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens

    @property
    def runs(self) -> int:
        """``best_of`` (default ``n``): generations per prompt, the best ``n`` answered."""
        return self.best_of or self.choices

    @property
    def logprob_count(self) -> int | None:
        """``logprobs``: top logprobs per token (0: the token's own only)."""
        return self.logprobs

    @property
    def echo_prompt(self) -> bool:
        """``echo``."""
        return bool(self.echo)

    def prompt_values(self, limit: int) -> list[str | tuple[int, ...]]:
        """The prompts, in order: each text or token ids (at most ``limit`` of them)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            return [()]
        if all(isinstance(p, int) for p in prompt):
            return [tuple(prompt)]  # type: ignore[arg-type]
        if len(prompt) > limit:
            raise bad_request(f"prompt holds {len(prompt)} prompts; the server's --max-prompts is {limit}",
                              param="prompt")
        return [p if isinstance(p, str) else tuple(p) for p in prompt]  # type: ignore[misc]

    def prompt_param(self, index: int) -> str:
        """The field that holds prompt ``index`` of :meth:`prompt_values`: ``prompt``, or
        ``prompt.N`` in a list of prompts."""
        prompt = self.prompt
        return "prompt" if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt) else f"prompt.{index}"

    def prompt_value(self) -> str | tuple[int, ...]:
        """The one prompt: text, or token ids (a list of several is refused)."""
        prompts = self.prompt_values(1)
        return prompts[0]


def check_token_id(token: int, known_tokens: int, param: str, what: str | None = None) -> int:
    """``token`` if it is an id that both the model and its tokenizer know, ``[0,
    known_tokens)`` (a model may have more embeddings than its tokenizer has tokens, as
    Gemma 3 has: those ids have no text); else a 400 naming ``param`` and ``what`` was
    given (default: the id)."""
    if not 0 <= token < known_tokens:
        raise bad_request(f"{what or f'token id {token}'} is not a token id of the model and its tokenizer: "
                          f"expected an integer in [0, {known_tokens})", param=param)
    return token


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are understood."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Text = Field(max_length=32)
    content: Text | list[ContentPart] | None = None

    def as_template_input(self, index: int) -> dict[str, str]:
        """``{"role", "content"}`` with the content as one string (``developer`` is ``system``)."""
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{index}] has a {part.type!r:.40} part; only text is supported",
                                      param=f"messages.{index}.content")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatBody(_GenerationBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check(self) -> None:
        """As every generation body; ``top_logprobs`` needs ``logprobs: true``."""
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_limit_param(self) -> str | None:
        """``max_completion_tokens`` when given, else as every generation body."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else super().token_limit_param

    def prompt_param(self, index: int) -> str:
        """``messages``: the field the prompt is made from."""
        return "messages"

    @property
    def logprob_count(self) -> int | None:
        """With ``logprobs: true``, ``top_logprobs`` (default 0) per token; else ``None``."""
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadAdapterBody(BaseModel):
    """``POST /v1/load_lora_adapter``: a path inside the adapters directory, or a URL with its SHA-256."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: Text = Field(min_length=1, max_length=300)
    lora_path: Text | None = Field(None, min_length=1, max_length=4096)
    url: Text | None = Field(None, min_length=1, max_length=8192)
    sha256: Text | None = None

    def check(self) -> None:
        """Exactly one of ``lora_path`` and ``url``; ``url`` needs ``sha256``."""
        if (self.lora_path is None) == (self.url is None):
            raise bad_request("give exactly one of lora_path and url", param="lora_path")
        if self.url is not None and self.sha256 is None:
            raise bad_request("loading from a url needs the file's sha256", param="sha256")


class UnloadAdapterBody(BaseModel):
    """``POST /v1/unload_lora_adapter``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: Text = Field(min_length=1, max_length=300)


class TokenizeBody(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or ``messages`` put through the chat template."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = Field(None, min_length=1, max_length=300)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool | None = True  # messages: end with the assistant's turn opened
    return_token_strs: bool | None = False

    def check(self) -> None:
        """Exactly one of ``prompt`` and ``messages``."""
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")


class DetokenizeBody(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text | None = Field(None, min_length=1, max_length=300)
    tokens: list[int] = Field(max_length=1 << 20)


def validation_error(errors: list[dict[str, Any]], content_type: str | None = None) -> ApiError:
    """The first of pydantic's complaints about a body as a 400 that names the field.
    ``content_type``: the request's header; a body sent as anything but JSON (which FastAPI
    then hands over unparsed) is refused naming the header, not its contents."""
    if not errors:
        return bad_request("invalid request body")
    if content_type and not _is_json(content_type) and [error.get("loc") for error in errors] == [("body",)]:
        return bad_request(f"the request body must be sent as JSON, with Content-Type: application/json (it came "
                           f"with Content-Type: {content_type:.80})", code="unsupported_content_type")
    # A value a union refuses gets one complaint per member; the checks of this module
    # (value errors) say more than "not an integer".
    first = next((error for error in errors if error.get("type") == "value_error"), errors[0])
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        context = first.get("ctx", {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {context}".rstrip(": "), code="invalid_json")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        return bad_request(f"the request body must be a JSON object: {message}")
    if first.get("type") == "missing":
        return bad_request(f"{param} is required", param=param, code="missing_field")
    return bad_request(f"{param}: {message}", param=param)


def _is_json(content_type: str) -> bool:
    """Whether a Content-Type header names JSON (``application/json``, ``application/*+json``),
    as FastAPI decides whether to parse a body."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _is_type_tag(part: object) -> bool:
    """Whether a part of pydantic's error location names a union member's type (such as
    ``str`` or ``function-after[_text(), str]``) rather than a field or an index."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_NAMES)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: ...`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


@dataclass(frozen=True)
class Answer:
    """One choice of a request: its index among the choices, how its generation ended,
    and its ``logprobs`` object (``None``: not asked for)."""

    index: int
    outcome: Outcome
    logprobs: dict | None = None
    echo: str = ""  # the prompt's text, before the completion's (echo)


@dataclass(frozen=True)
class Reply:
    """The response shapes of one request: a whole completion, or the chunks of a stream."""

    chat: bool
    model: str
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}")

    def whole(self, answers: Sequence[Answer], counted: Sequence[Outcome] = ()) -> dict:
        """The non-streaming answer: every choice, the usage of every generation run
        (``counted``; default: the answers') and the server's timings."""
        choices = []
        for answer in answers:
            outcome = answer.outcome
            if self.chat:
                choices.append({"index": answer.index, "message": {"role": "assistant", "content": outcome.text},
                                "logprobs": answer.logprobs, "finish_reason": outcome.finish_reason})
            else:
                choices.append({"index": answer.index, "text": answer.echo + outcome.text, "logprobs": answer.logprobs,
                                "finish_reason": outcome.finish_reason})
        outcomes = list(counted) or [answer.outcome for answer in answers]
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage(outcomes), "timings": timings(outcomes)}

    def opening(self, index: int = 0) -> dict | None:
        """The first chunk of a chat stream's choice (the assistant's role); None for completions."""
        return self._chunk({"role": "assistant", "content": ""}, None, index) if self.chat else None

    def delta(self, text: str, index: int = 0) -> dict:
        """A chunk carrying more text."""
        return self._chunk({"content": text} if self.chat else text, None, index)

    def closing(self, finish_reason: str, index: int = 0, logprobs: dict | None = None) -> dict:
        """The chunk with a choice's finish reason (and its logprobs, when asked for: all
        of them at once, at the end)."""
        return self._chunk({} if self.chat else "", finish_reason, index, logprobs)

    def usage_chunk(self, outcomes: Sequence[Outcome]) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(self._chunk_object), "choices": [], "usage": usage(outcomes),
                "timings": timings(outcomes)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, content: dict | str, finish_reason: str | None, index: int = 0,
               logprobs: dict | None = None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head(self._chunk_object), "choices": [choice]}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(outcomes: Outcome | Sequence[Outcome]) -> dict:
    """OpenAI's usage counts: each prompt once (the choices of one prompt share it), the
    tokens of every generation."""
    outcomes = [outcomes] if isinstance(outcomes, Outcome) else list(outcomes)
    prompt = sum({o.prompt_index: o.prompt_tokens for o in outcomes}.values())
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def timings(outcomes: Sequence[Outcome]) -> dict:
    """The server's own timings of a request, in llama-server's shape: the prompt's
    tokens and milliseconds (prefill and first token), the generated tokens after the
    first and their milliseconds, and tokens per second of each (the slowest choice's
    pace when there are several)."""
    prompt_n = sum(o.prompt_tokens for o in outcomes)
    prompt_ms = sum(o.prompt_seconds for o in outcomes) * 1000
    predicted_n = sum(max(0, o.completion_tokens - 1) for o in outcomes)
    rates = [o.decode_tokens_per_s for o in outcomes if o.decode_tokens_per_s > 0]
    per_second = min(rates) if rates else 0.0
    predicted_ms = sum((o.completion_tokens - 1) / o.decode_tokens_per_s * 1000 for o in outcomes
                       if o.decode_tokens_per_s > 0)
    return {"prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
            "prompt_per_second": round(prompt_n / prompt_ms * 1000, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_second": round(per_second, 3)}
