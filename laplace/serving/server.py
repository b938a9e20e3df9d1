"""`laplace serve`: an OpenAI-compatible HTTP server in front of one DecodeEngine (the routes
and the process, as vLLM's entrypoints/openai/api_server.py).

The parts, one job each:
- `protocol.py`: the request as pydantic models (vLLM's extra fields accepted), the error shape;
- `completions.py`: POST /v1/completions: body limit, parsing and tokenizing off the event loop,
  engine requests per prompt and choice, the JSON answer or the event stream, disconnects;
- `chat.py`: POST /v1/chat/completions: the messages rendered by the model's chat template (as
  transformers renders it), then served as a completion;
- `detokenizer.py`: incremental detokenization (tokenizers' DecodeStream) and the stop-string
  hold-back, linear in the text;
- `engine_loop.py`: the engine on its own thread (continuous batching; warmup first);
- `metrics.py`: Prometheus metrics, ours and vLLM's names.

- Warmup runs first, on the engine thread, one log line per graph: `/health` answers 503 until it
  is done. After it the loop serves under `torch.compiler.set_stance("fail_on_recompile")`: a shape
  warmup did not compile is an error in the log and a 500 for the requests of that step, never a
  silent compile.
- The listening socket is bound before anything is loaded (`listen.bind_socket`, called first by
  laplace.pipeline.serve): a busy port fails at once, not after warmup.
- Overload is shed at once: a request arriving while `engine.max_queue` wait gets 429 with Retry-After.
- SIGTERM (or Ctrl-C) drains: the listening socket closes (new connections are refused), requests
  on open connections get 503, in-flight requests get `server.shutdown_grace_s` to finish, what is
  left is cancelled (a stream ends with an error event), and the process exits 0. A second signal
  stops at once.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize,
POST /detokenize, GET /version, GET|POST /ping, GET /health, GET /metrics (Prometheus). An unknown
route (404) or a wrong method (405) is answered in OpenAI's error shape, like every other error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time

from fastapi import Request  # at module level: FastAPI resolves the route's annotation here

from laplace.serving.chat import ChatService, render_chat
from laplace.serving.completions import CompletionsService, Limits, read_body
from laplace.serving.engine import DecodeEngine
from laplace.serving.engine_loop import EngineLoop
from laplace.serving.listen import bind_socket
from laplace.serving.metrics import ServerMetrics
from laplace.serving.protocol import ApiError, DetokenizeRequest, TokenizeRequest, bad, parse_model

log = logging.getLogger("laplace.serving.server")
warmup_interrupted = threading.Event()  # a signal arrived during warmup (the process leaves at once)


def stop_compilers(wait_s: float = 0.0) -> None:
    """Kill this process's children (g++ and Inductor's compile workers, during warmup), at once:
    nothing is left compiling after a SIGTERM, and no compiler's error output floods the log.
    `wait_s`: how long to wait for them to be gone (the signal handler does not wait: the lifespan's
    last call does, once, so the whole stop stays within the 2 s a SIGTERM during warmup is given)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    if wait_s > 0:
        psutil.wait_procs(children, timeout=wait_s)


def max_model_len(service: CompletionsService) -> int:
    """vLLM's max_model_len, what clients size requests by: every request whose prompt + max_tokens
    is within it is served. Prompts are bounded by engine.max_prompt_tokens and max_tokens by
    server.max_new_tokens separately (a recurrent model's state does not grow with either), so it
    is the smaller of the two plus one (with at least one token on each side)."""
    return min(service.loop.engine.max_prompt_tokens, service.limits.max_tokens) + 1


def build_app(service: CompletionsService, metrics: ServerMetrics, on_started=None, chat: ChatService | None = None):
    """The FastAPI application (the engine loop is started and stopped by its lifespan)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    loop = service.loop

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start(asyncio.get_running_loop())
        tasks = [asyncio.ensure_future(on_started())] if on_started else []
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            # a warmup interrupted by a signal is not waited for: the engine thread is a daemon, and a
            # Dynamo trace in it cannot be interrupted (its compiler processes were killed already)
            warming = not loop.ready.is_set()
            loop.stop(timeout=0.5 if warming else 30.0)
            if warming:
                stop_compilers(wait_s=0.5)  # any the abandoned warmup started since the signal, and gone
            service.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="laplace", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """Starlette's own 404 / 405 (no such route, wrong method) in OpenAI's shape, not {"detail"}."""
        what = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
        err = ApiError(exc.status_code, f"{what}: {request.method} {request.url.path}")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

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

    @app.get("/health")
    async def health():
        if loop.fatal:
            return JSONResponse({"status": "failed", "reason": loop.fatal}, status_code=503)
        if loop.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not loop.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        engine = loop.engine
        card = {
            "id": service.model_name,
            "object": "model",
            "created": service.created,
            "owned_by": "laplace",
            "root": service.model_name,  # vLLM's field; `vllm bench serve` reads data[0].root
            "parent": None,
            "max_model_len": max_model_len(service),
            "max_prompt_tokens": engine.max_prompt_tokens,
            "max_completion_tokens": service.limits.max_tokens,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await service.create(request)

    if chat is not None:

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await chat.create(request)

    def tokenize(raw: bytes) -> dict:
        req = parse_model(raw, TokenizeRequest)
        if req.model is not None:
            service.check_model(req)
        if (req.prompt is None) == (req.messages is None):
            raise bad(None, "give exactly one of prompt or messages")
        limit = service.loop.engine.max_prompt_tokens
        if req.messages is not None:
            if chat is None:
                raise bad("messages", "this server has no chat template")
            from laplace.serving.chat import message_dicts

            try:
                text = render_chat(
                    chat.template,
                    message_dicts(req),
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    special_tokens=chat.special_tokens,
                    **(req.chat_template_kwargs or {}),
                )
            except ApiError:
                raise
            except Exception as exc:
                raise bad("messages", f"the chat template cannot render these messages: {exc}") from None
            special = bool(req.add_special_tokens)
        else:
            text, special = req.prompt, req.add_special_tokens is not False
        if len(text) > 4 * limit * service.max_chars_per_token:  # bounded work: far more than any prompt served
            raise ApiError(400, f"{len(text):,} characters: far over the {limit}-token prompt limit", "prompt")
        if req.messages is not None:
            ids = chat.encode(text, special)  # as chat completions tokenize it
        else:
            ids = service.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
        out = {"count": len(ids), "max_model_len": max_model_len(service), "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            out["token_strs"] = [service.tokenizer.id_to_token(i) for i in ids]
        return out

    def detokenize(raw: bytes) -> dict:
        req = parse_model(raw, DetokenizeRequest)
        if req.model is not None:
            service.check_model(req)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < service.vocab_size:
                raise bad("tokens", f"token id {t} at position {i} is outside the vocabulary [0, {service.vocab_size})")
        return {"prompt": service.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/tokenize")
    @api_errors
    async def tokenize_route(request: Request):
        return await off_loop(tokenize, await read_body(request, service.limits.max_request_bytes))

    @app.post("/detokenize")
    @api_errors
    async def detokenize_route(request: Request):
        return await off_loop(detokenize, await read_body(request, service.limits.max_request_bytes))

    @app.get("/version")
    async def version():
        from importlib.metadata import version as installed

        return {"version": installed("laplace")}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """SageMaker's / vLLM's liveness route: /health's answer."""
        return await health()

    return app


def serve(
    engine: DecodeEngine,
    tokenizer,
    eos_id: int | None,
    *,
    host: str,
    port: int,
    model_name: str,
    max_tokens_limit: int,
    shutdown_grace_s: float,
    max_request_bytes: int = 2 * 2**20,
    max_stop_chars: int = 1024,
    warmup_widths: list[int] | None = None,
    access_log: bool = False,
    sock: socket.socket | None = None,
    chat_template: str | None = None,
    special_tokens: dict[str, str] | None = None,
) -> int:
    """Serve until SIGTERM / SIGINT (a graceful drain) and return the exit status: 0, or 1 when
    warmup failed. `sock`: the listening socket from bind_socket (bound here if None)."""
    import uvicorn

    sock = sock or bind_socket(host, port)
    metrics = ServerMetrics(engine.max_slots, model_name)
    held = engine.cache.allocation()
    metrics.slot_state_bytes.set(held["state_bytes"])
    metrics.slot_kv_bytes.set(held["kv_bytes"])
    loop = EngineLoop(engine, metrics, warmup_widths=warmup_widths)
    service = CompletionsService(
        loop, tokenizer, eos_id, model_name, Limits(max_tokens_limit, max_request_bytes, max_stop_chars), metrics
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not loop.ready.is_set() and not loop.fatal:  # during warmup: stop now, compilers included
                if not loop.draining:
                    log.info("%s during warmup: stopping (the compile is abandoned)", signal.Signals(sig).name)
                warmup_interrupted.set()
                loop.begin_drain(0.0)
                stop_compilers()
                return super().handle_exit(sig, frame)
            if loop.draining:  # a second signal: stop now
                loop.begin_drain(0.0)
                return super().handle_exit(sig, frame)
            self._captured_signals.append(sig)  # re-raised once uvicorn is done (see below)
            log.info(
                "%s: draining (no new requests; in-flight ones get %.0fs to finish)",
                signal.Signals(sig).name,
                shutdown_grace_s,
            )
            loop.begin_drain(shutdown_grace_s)  # `drained` below stops listening and ends the server

    async def drained():
        """On SIGTERM: close the listening socket, answer 503 on open connections until the in-flight
        requests are done (or the engine cancelled them at the grace period), then let uvicorn stop."""
        while not loop.draining:
            await asyncio.sleep(0.05)
        for listener in server.servers:
            listener.close()
        deadline = time.perf_counter() + shutdown_grace_s + 5.0  # the engine cancels at the grace period
        while (service.in_flight or loop.waiting() or loop.engine.has_work()) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        server.should_exit = True

    chat = ChatService(service, chat_template, special_tokens or {})
    log.info("chat template: %s", "the model's own" if chat_template else "the default (the model has none)")
    app = build_app(service, metrics, on_started=drained, chat=chat)
    config = uvicorn.Config(
        app,
        log_level="info",
        access_log=access_log,
        # a backstop only: the drain above ends the requests first
        timeout_graceful_shutdown=shutdown_grace_s + 5.0,
        timeout_keep_alive=30,  # longer than clients keep idle connections (httpx: 5 s), so they close first
    )
    server = Server(config)
    loop.on_fatal = lambda: setattr(server, "should_exit", True)
    # The engine thread and the event loop share the GIL; Python hands it over every 5 ms by default,
    # which a decode step of a few ms then waits on. A shorter interval keeps both moving.
    sys.setswitchinterval(0.0005)
    # uvicorn re-raises the signal it caught once it has shut down, for the handler that was there
    # before it: with SIG_IGN there, a drained server returns and the process exits 0.
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    log.info("listening on http://%s:%d", *sock.getsockname()[:2])
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    return 1 if loop.fatal else 0
