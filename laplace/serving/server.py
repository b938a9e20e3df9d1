"""`laplace serve`: an OpenAI-compatible HTTP server in front of one DecodeEngine (the
application and the process, as vLLM's entrypoints/openai/api_server.py).

The parts, one job each:
- `routes.py`: the endpoints, one router per family (operations, OpenAI, tokenizer);
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
- The HTTP side never touches the engine: its limits (`completions.Limits`) and the request check
  (`Scheduler.check`) are handed to it here, at startup; the engine loop publishes its request
  counts after each step.
- SIGTERM (or Ctrl-C) drains: the listening socket closes (new connections are refused), requests
  on open connections get 503, in-flight requests get `server.shutdown_grace_s` to finish, what is
  left is cancelled (a stream ends with an error event), and the process exits 0. A second signal
  stops at once (`DrainingServer`, `drain_then_exit`).

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

import uvicorn

from laplace.serving.chat import ChatService
from laplace.serving.completions import CompletionsService, Limits
from laplace.serving.engine import DecodeEngine
from laplace.serving.engine_loop import EngineLoop
from laplace.serving.listen import bind_socket
from laplace.serving.metrics import ServerMetrics
from laplace.serving.protocol import ApiError
from laplace.serving.routes import openai_router, ops_router, tokenizer_router

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


def build_app(service: CompletionsService, metrics: ServerMetrics, on_started=None, chat: ChatService | None = None):
    """The FastAPI application: the lifespan (starts and stops the engine loop), OpenAI-shaped
    errors, and the routers (serving/routes.py)."""
    from fastapi import FastAPI

    app = FastAPI(
        title="laplace", lifespan=lifespan(service, on_started), docs_url=None, redoc_url=None, openapi_url=None
    )
    add_error_handlers(app)
    app.include_router(ops_router(service.loop, metrics))
    app.include_router(openai_router(service, chat))
    app.include_router(tokenizer_router(service, chat, metrics))
    return app


def lifespan(service: CompletionsService, on_started=None):
    """The application's lifespan: the engine loop started (and `on_started()` run as a task), then
    stopped at the end; a warmup a signal interrupted is not waited for."""
    loop = service.loop

    @contextlib.asynccontextmanager
    async def run(app):
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

    return run


def add_error_handlers(app) -> None:
    """Starlette's own 404 / 405 (no such route, wrong method) in OpenAI's shape, not {"detail"}."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        what = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
        err = ApiError(exc.status_code, f"{what}: {request.method} {request.url.path}")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def build_services(
    engine: DecodeEngine,
    tokenizer,
    eos_id: int | None,
    model_name: str,
    limits: Limits,
    warmup_widths: list[int] | None = None,
    chat_template: str | None = None,
    special_tokens: dict[str, str] | None = None,
) -> tuple[CompletionsService, ChatService]:
    """The metrics, the engine loop and the completions and chat services over one engine. The
    services get the engine's limits (in `limits`) and its request check (Scheduler.check), never
    the engine: only the engine loop's thread touches it."""
    metrics = ServerMetrics(engine.cache.max_slots, model_name)
    held = engine.cache.allocation()
    metrics.slot_state_bytes.set(held["state_bytes"])
    metrics.slot_kv_bytes.set(held["kv_bytes"])
    loop = EngineLoop(engine, metrics, warmup_widths=warmup_widths)
    service = CompletionsService(loop, tokenizer, eos_id, model_name, limits, metrics, engine.scheduler.check)
    chat = ChatService(service, chat_template, special_tokens or {})
    log.info("chat template: %s", "the model's own" if chat_template else "the default (the model has none)")
    return service, chat


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM / SIGINT drains (drain_then_exit ends it) instead of
    stopping: during warmup it stops at once, compilers included; a second signal stops at once."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, shutdown_grace_s: float):
        super().__init__(config)
        self.engine_loop, self.shutdown_grace_s = loop, shutdown_grace_s

    def handle_exit(self, sig, frame):
        loop = self.engine_loop
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
        self._captured_signals.append(sig)  # re-raised once uvicorn is done (see serve)
        log.info(
            "%s: draining (no new requests; in-flight ones get %.0fs to finish)",
            signal.Signals(sig).name,
            self.shutdown_grace_s,
        )
        loop.begin_drain(self.shutdown_grace_s)  # drain_then_exit stops listening and ends the server


async def drain_then_exit(server: DrainingServer, service: CompletionsService) -> None:
    """On SIGTERM: close the listening socket, answer 503 on open connections until the in-flight
    requests are done (or the engine cancelled them at the grace period), then let uvicorn stop."""
    loop = service.loop
    while not loop.draining:
        await asyncio.sleep(0.05)
    for listener in server.servers:
        listener.close()
    deadline = time.perf_counter() + server.shutdown_grace_s + 5.0  # the engine cancels at the grace period
    while (service.in_flight or loop.pending()) and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    server.should_exit = True


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
    sock = sock or bind_socket(host, port)
    s = engine.scheduler
    limits = Limits(max_tokens_limit, max_request_bytes, max_stop_chars, s.max_prompt_tokens, s.max_queue)
    service, chat = build_services(
        engine, tokenizer, eos_id, model_name, limits, warmup_widths, chat_template, special_tokens
    )
    app = build_app(service, service.metrics, on_started=lambda: drain_then_exit(server, service), chat=chat)
    config = uvicorn.Config(
        app,
        log_level="info",
        access_log=access_log,
        # a backstop only: the drain above ends the requests first
        timeout_graceful_shutdown=shutdown_grace_s + 5.0,
        timeout_keep_alive=30,  # longer than clients keep idle connections (httpx: 5 s), so they close first
    )
    server = DrainingServer(config, service.loop, shutdown_grace_s)
    service.loop.on_fatal = lambda: setattr(server, "should_exit", True)
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
    return 1 if service.loop.fatal else 0
