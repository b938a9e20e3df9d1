"""The HTTP routes of `laplace serve`, one router per family of endpoints (as vLLM's per-endpoint
api_router modules), assembled into the application by server.py:

- operations: GET /health, GET|POST /ping, GET /metrics (Prometheus), GET /version;
- OpenAI: GET /v1/models, POST /v1/completions, POST /v1/chat/completions;
- tokenizer: POST /tokenize, POST /detokenize (vLLM's), parsed and tokenized on a worker thread.

The routes reach the engine only through the engine loop and the services: the limits they
answer with were read from the engine once, at startup (completions.Limits)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request  # at module level: FastAPI resolves the routes' annotations here

from laplace.serving.chat import ChatService
from laplace.serving.completions import CompletionsService, read_body
from laplace.serving.engine_loop import EngineLoop
from laplace.serving.metrics import ServerMetrics
from laplace.serving.protocol import ApiError, DetokenizeRequest, TokenizeRequest, bad, parse_model


def max_model_len(service: CompletionsService) -> int:
    """vLLM's max_model_len, what clients size requests by: every request whose prompt + max_tokens
    is within it is served. Prompts are bounded by engine.max_prompt_tokens and max_tokens by
    server.max_new_tokens separately (a recurrent model's state does not grow with either), so it
    is the smaller of the two plus one (with at least one token on each side)."""
    return min(service.limits.max_prompt_tokens, service.limits.max_tokens) + 1


def ops_router(loop: EngineLoop, metrics: ServerMetrics) -> APIRouter:
    """/health (503 until warmup is done, while draining, or once the loop failed), /ping, /metrics, /version."""
    from fastapi.responses import JSONResponse, Response

    router = APIRouter()

    @router.get("/health")
    async def health():
        if loop.fatal:
            return JSONResponse({"status": "failed", "reason": loop.fatal}, status_code=503)
        if loop.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not loop.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @router.get("/metrics")
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @router.get("/version")
    async def version():
        from importlib.metadata import version as installed

        return {"version": installed("laplace")}

    @router.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """SageMaker's / vLLM's liveness route: /health's answer."""
        return await health()

    return router


def openai_router(service: CompletionsService, chat: ChatService | None) -> APIRouter:
    """/v1/models, /v1/completions and (with a chat service) /v1/chat/completions."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models():
        card = {
            "id": service.model_name,
            "object": "model",
            "created": service.created,
            "owned_by": "laplace",
            "root": service.model_name,  # vLLM's field; `vllm bench serve` reads data[0].root
            "parent": None,
            "max_model_len": max_model_len(service),
            "max_prompt_tokens": service.limits.max_prompt_tokens,
            "max_completion_tokens": service.limits.max_tokens,
        }
        return {"object": "list", "data": [card]}

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await service.create(request)

    if chat is not None:

        @router.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await chat.create(request)

    return router


def tokenizer_router(service: CompletionsService, chat: ChatService | None, metrics: ServerMetrics) -> APIRouter:
    """/tokenize and /detokenize: the body read on the event loop, the rest on a worker thread."""
    from fastapi.responses import JSONResponse

    router = APIRouter()

    def api_errors(handler):
        """A route whose ApiError becomes the OpenAI-shaped answer."""

        async def route(request: Request):
            try:
                return await handler(request)
            except ApiError as exc:
                metrics.rejections.labels(exc.reason).inc()
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

        return route

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(service.executor, fn, *args)

    @router.post("/tokenize")
    @api_errors
    async def tokenize_route(request: Request):
        raw = await read_body(request, service.limits.max_request_bytes)
        return await off_loop(tokenize, service, chat, raw)

    @router.post("/detokenize")
    @api_errors
    async def detokenize_route(request: Request):
        return await off_loop(detokenize, service, await read_body(request, service.limits.max_request_bytes))

    return router


def tokenize(service: CompletionsService, chat: ChatService | None, raw: bytes) -> dict:
    """POST /tokenize: a prompt's token ids, or those of messages rendered as chat completions render them."""
    req = parse_model(raw, TokenizeRequest)
    if req.model is not None:
        service.check_model(req)
    if (req.prompt is None) == (req.messages is None):
        raise bad(None, "give exactly one of prompt or messages")
    limit = service.limits.max_prompt_tokens
    if req.messages is not None:
        if chat is None:
            raise bad("messages", "this server has no chat template")
        text, special = chat.render(req), bool(req.add_special_tokens)
    else:
        text, special = req.prompt, req.add_special_tokens is not False
    if len(text) > 4 * limit * service.max_chars_per_token:  # bounded work: far more than any prompt served
        raise ApiError(
            400,
            f"{len(text):,} characters: far over the {limit}-token prompt limit (engine.max_prompt_tokens)",
            "prompt",
        )
    if req.messages is not None:
        ids = chat.encode(text, special)  # as chat completions tokenize it
    else:
        ids = service.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
    out = {"count": len(ids), "max_model_len": max_model_len(service), "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = [service.tokenizer.id_to_token(i) for i in ids]
    return out


def detokenize(service: CompletionsService, raw: bytes) -> dict:
    """POST /detokenize: token ids back to text (special tokens kept)."""
    req = parse_model(raw, DetokenizeRequest)
    if req.model is not None:
        service.check_model(req)
    for i, t in enumerate(req.tokens):
        if not 0 <= t < service.vocab_size:
            raise bad("tokens", f"token id {t} at position {i} is outside the vocabulary [0, {service.vocab_size})")
    return {"prompt": service.tokenizer.decode(req.tokens, skip_special_tokens=False)}
