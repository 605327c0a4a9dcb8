"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from runtime.serve.errors import bad_request, model_not_found
from runtime.serve.protocol import DetokenizeBody, TokenizeBody
from runtime.serve.server import Server


def routes(server: Server) -> APIRouter:
    """Tokenizing and detokenizing with the served model's tokenizer."""
    router = APIRouter()
    tokenizer = server.engine.tokenizer

    @router.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict:
        body.check()
        _check_model(server, body.model)
        text = body.prompt if body.prompt is not None else await server.chat_prompt(body.messages)
        tokens = await run_in_threadpool(tokenizer.encode, text)
        return {"count": len(tokens), "max_model_len": server.engine.spec.kv_length, "tokens": list(tokens),
                "token_strs": None}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict:
        _check_model(server, body.model)
        vocab = server.engine.spec.vocab_size
        for index, token in enumerate(body.tokens):
            if not 0 <= token < vocab:
                raise bad_request(f"token id {token} is outside the vocabulary [0, {vocab})", param=f"tokens.{index}")
        return {"prompt": await run_in_threadpool(tokenizer.decode, body.tokens)}

    return router


def _check_model(server: Server, model: str | None) -> None:
    """``model``, if given, must be the base model or a loaded adapter (they share the tokenizer)."""
    if model is None or model == server.settings.model_name:
        return
    if server.catalog.find(model) is None:
        raise model_not_found(f"model {model!r:.140} is not served here; GET /v1/models lists what is")
