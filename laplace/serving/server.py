"""`laplace serve`: an OpenAI-compatible HTTP server in front of one DecodeEngine (the routes
and the process, as vLLM's entrypoints/openai/api_server.py).

The parts, one job each:
- `protocol.py`: the request as pydantic models (vLLM's extra fields accepted), the error shape;
- `completions.py`: POST /v1/completions: body limit, parsing and tokenizing off the event loop,
  engine requests per prompt and choice, the JSON answer or the event stream, disconnects;
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

Endpoints: POST /v1/completions, GET /v1/models, GET /health, GET /metrics (Prometheus).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time

from fastapi import Request  # at module level: FastAPI resolves the route's annotation here

from laplace.serving.completions import CompletionsService, Limits
from laplace.serving.engine import DecodeEngine
from laplace.serving.engine_loop import EngineLoop
from laplace.serving.listen import bind_socket
from laplace.serving.metrics import ServerMetrics

log = logging.getLogger("laplace.serving.server")


def build_app(service: CompletionsService, metrics: ServerMetrics, on_started=None):
    """The FastAPI application (the engine loop is started and stopped by its lifespan)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

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
            loop.stop()
            service.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="laplace", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

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
            "max_model_len": engine.max_prompt_tokens + service.limits.max_tokens,
            "max_prompt_tokens": engine.max_prompt_tokens,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await service.create(request)

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
            if loop.draining or not loop.ready.is_set():  # a second signal, or nothing to drain: stop now
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

    app = build_app(service, metrics, on_started=drained)
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
