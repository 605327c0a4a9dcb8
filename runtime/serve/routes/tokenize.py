"""``GET /tokenizer_info``, ``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes:
what lm-eval's ``RemoteTokenizer`` (``tokenizer_backend=remote``) reads."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from runtime.serve.protocol import DetokenizeBody, TokenizeBody, check_token_id
from runtime.serve.server import Server


def routes(server: Server) -> APIRouter:
    """Tokenizing and detokenizing with the served model's tokenizer."""
    router = APIRouter()
    tokenizer = server.engine.tokenizer

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return tokenizer_description(server)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict:
        body.check()
        _check_model(server, body.model)
        if body.prompt is not None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:
            text = await server.chat_prompt(body.messages, body.add_generation_prompt is not False)
            special = bool(body.add_special_tokens)
        tokens = await run_in_threadpool(_encode, tokenizer, text, special)
        strings = [_text_of(tokenizer)(token) for token in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": server.engine.spec.kv_length, "tokens": list(tokens),
                "token_strs": strings}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict:
        _check_model(server, body.model)
        known = server.known_tokens
        for index, token in enumerate(body.tokens):
            check_token_id(token, known, f"tokens.{index}")
        return {"prompt": await run_in_threadpool(tokenizer.decode, body.tokens)}

    return router


def tokenizer_description(server: Server) -> dict:
    """The tokenizer's special tokens (as text), chat template and the longest context."""
    tokenizer, template = server.engine.tokenizer, server.engine.chat_template
    text_of = _text_of(tokenizer)
    stops = tokenizer.stop_token_ids
    eos = (template.eos_token if template is not None and template.eos_token else None) or (
        text_of(stops[0]) if stops else None)
    bos = (template.bos_token if template is not None and template.bos_token else None) or getattr(
        tokenizer, "bos_token", None)
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": eos, "bos_token": bos, "pad_token": eos,
            "unk_token": None, "chat_template": template.source if template is not None else None,
            "model_max_length": server.engine.spec.kv_length, "vocab_size": server.engine.spec.vocab_size,
            "stop_token_ids": list(stops)}


def _text_of(tokenizer):
    """One token's text as the vocabulary spells it (or as decoding it alone gives)."""
    token_text = getattr(tokenizer, "token_text", None)
    return token_text if token_text is not None else (lambda token: tokenizer.decode([token]))


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``text``'s ids, with the tokenizer's special tokens when asked (a tokenizer that
    takes no such option has none to add)."""
    if not add_special_tokens:
        return tokenizer.encode(text)
    try:
        return tokenizer.encode(text, add_special_tokens=True)
    except TypeError:
        return tokenizer.encode(text)


def _check_model(server: Server, model: str | None) -> None:
    """``model``, if given, must be the base model or a loaded adapter (they share the
    tokenizer), named as generation names them."""
    if model is not None:
        server.model_entry(model)
