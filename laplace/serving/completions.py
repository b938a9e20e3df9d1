"""POST /v1/completions over the engine thread (vLLM's serving_completion.py, for one model).

A request goes: the body, read up to `server.max_request_bytes` (413 beyond), then parsed,
checked and tokenized on a worker thread (never on the event loop: a prompt far over
`engine.max_prompt_tokens` is refused from its length before it is tokenized, and
`Tokenizer.encode_batch` releases the GIL), then one engine request per prompt and choice, then
the answer: one JSON body, or server-sent events as tokens arrive. A client that goes away is
cancelled at once, streamed or not, so the engine frees its slot at the next step."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from laplace.serving.detokenizer import IncrementalText
from laplace.serving.engine_loop import Draining, EngineLoop, QueueFull, Ticket
from laplace.serving.metrics import ServerMetrics
from laplace.serving.protocol import ApiError, CompletionRequest, bad, ignored_fields_note, parse_request
from laplace.serving.scheduler import Completion, Rejected, Request

log = logging.getLogger("laplace.serving.server")

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Limits:
    """What one HTTP request may ask for: the server's limits and the engine's, read once at startup
    (the HTTP side never reaches into the engine, which its own thread owns)."""

    max_tokens: int  # server.max_new_tokens
    max_request_bytes: int
    max_stop_chars: int
    max_prompt_tokens: int  # engine.max_prompt_tokens
    max_queue: int  # engine.max_queue: the engine requests (prompts x n) one HTTP request may hold


@dataclass
class CompletionParams:
    """A validated request, its prompts tokenized."""

    request: CompletionRequest
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    stop_ids: tuple[int, ...]
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None = None  # top-N log-probs per generated token (None: not asked for)
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt's too

    @property
    def n(self) -> int:
        return self.request.n

    def prompt_of(self, choice: int) -> int:
        return choice // self.request.n


class CompletionsService:
    def __init__(
        self,
        loop: EngineLoop,
        tokenizer,
        eos_id: int | None,
        model_name: str,
        limits: Limits,
        metrics: ServerMetrics,
        check_request: Callable[[Request], None],
    ):
        """check_request: raises Rejected for a request the engine would refuse (Scheduler.check,
        which reads only the engine's fixed limits: safe on a worker thread)."""
        self.loop, self.tokenizer, self.eos_id = loop, tokenizer, eos_id
        self.model_name, self.limits, self.metrics = model_name, limits, metrics
        self.check_request = check_request
        self.created = int(time.time())
        self.in_flight = 0  # HTTP requests holding engine requests (the drain waits for 0)
        # parsing and tokenizing off the event loop; two threads, so one large body does not queue the rest
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="laplace-prepare")
        vocab = tokenizer.get_vocab_size()
        # the most characters one token stands for: a text of more than limit * this many characters
        # cannot fit the limit, so it is refused before tokenizing. Twice that, for a normalizer that
        # shortens text (NFKC composing accents).
        self.max_chars_per_token = 2 * max(
            1, max(len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(vocab))
        )
        self.vocab_size = vocab
        self._token_strs: dict[int, str] = {}

    def token_str(self, token: int) -> str:
        """One token as text, decoded alone (as vLLM names log-prob tokens; a partial UTF-8
        character decodes to U+FFFD)."""
        if (text := self._token_strs.get(token)) is None:
            text = self._token_strs[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    # -- the request, on a worker thread ---------------------------------------------------------

    def prepare(self, raw: bytes) -> CompletionParams:
        req, ignored = parse_request(raw)
        if ignored:
            log.info(ignored_fields_note(ignored))
        self.check_model(req)
        prompts, texts = self._prompts(req)
        return self.params_for(req, prompts, texts, req.max_tokens, "max_tokens")

    def check_model(self, req) -> None:
        if req.model != self.model_name:
            raise ApiError(404, f"model {req.model!r} does not exist: this server serves {self.model_name!r}", "model")

    def params_for(self, req, prompts, texts, max_tokens: int | None, max_tokens_field: str) -> CompletionParams:
        """The checks both kinds of request share, once the prompts are token ids."""
        max_tokens = max_tokens if max_tokens is not None else min(16, self.limits.max_tokens)
        if max_tokens > self.limits.max_tokens:
            raise bad(max_tokens_field, f"must be in [1, {self.limits.max_tokens}], got {max_tokens}")
        stop = self._stop(req.stop)
        stop_ids = [] if req.ignore_eos or self.eos_id is None else [self.eos_id]
        for t in req.stop_token_ids or []:
            if not 0 <= t < self.vocab_size:
                raise bad("stop_token_ids", f"token id {t} is outside the vocabulary [0, {self.vocab_size})")
            stop_ids.append(t)
        if len(prompts) * req.n > self.limits.max_queue:
            raise bad(
                "n", f"{len(prompts)} prompt(s) x n={req.n} choices in one request, at most {self.limits.max_queue}"
            )
        _refuse_unwired(req)
        if req.min_tokens > max_tokens:
            raise bad("min_tokens", f"must be at most {max_tokens_field} ({max_tokens}), got {req.min_tokens}")
        options = req.stream_options
        logprobs = req.logprobs
        if isinstance(logprobs, bool):  # chat: a switch, and top_logprobs the N
            logprobs = (req.top_logprobs or 0) if logprobs else None
        return CompletionParams(
            request=req,
            prompts=prompts,
            prompt_texts=texts,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            stop=stop,
            stop_ids=tuple(dict.fromkeys(stop_ids)),
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
            logprobs=logprobs,
            prompt_logprobs=logprobs if getattr(req, "echo", False) and logprobs is not None else None,
        )

    def check_prompt(self, ids: list[int], where: str) -> None:
        """A prompt of token ids the engine will serve, or a 400 naming it."""
        try:
            self.check_request(Request(0, ids, 1))
        except Rejected as exc:
            reason = "prompt_too_long" if "the limit is" in str(exc) else "invalid_request"
            raise ApiError(400, f"{where}: {exc}", "prompt", reason=reason) from None

    def _stop(self, stop) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)):
            raise bad("stop", "expected a non-empty string or a list of at most 4 of them")
        longest = max(len(s) for s in stops) if stops else 0
        if longest > self.limits.max_stop_chars:
            raise bad("stop", f"a stop string of {longest} characters, the limit is {self.limits.max_stop_chars}")
        return list(stops)

    def _prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        """Text, token ids, or a list of either: (ids per prompt, text per prompt)."""
        prompt = req.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise bad("prompt", "required: a string, a list of token ids, or a non-empty list of either")
        if len(prompt) > self.limits.max_queue:
            raise bad("prompt", f"{len(prompt)} prompts in one request, at most {self.limits.max_queue}")
        limit, keep = self.limits.max_prompt_tokens, req.truncate_prompt_tokens
        where = ["prompt" if len(prompt) == 1 else f"prompt[{i}]" for i in range(len(prompt))]
        texts: list[str | None] = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                if keep is None and len(p) > limit * self.max_chars_per_token:
                    raise ApiError(
                        400,
                        f"{where[i]}: {len(p):,} characters are more than {limit} tokens, the limit is {limit} "
                        "(engine.max_prompt_tokens)",
                        "prompt",
                        reason="prompt_too_long",
                    )
                texts.append(p)
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                if keep is None and len(p) > limit:
                    raise ApiError(
                        400,
                        f"{where[i]}: prompt has {len(p)} tokens, the limit is {limit} (engine.max_prompt_tokens)",
                        "prompt",
                        reason="prompt_too_long",
                    )
                texts.append(None)
            else:
                raise bad(where[i], "expected a string or a list of integer token ids")
        strings = [p for p in prompt if isinstance(p, str)]
        # encode_batch runs without the GIL (encode holds it), so the event loop keeps moving
        encoded = iter(self.tokenizer.encode_batch(strings, add_special_tokens=req.add_special_tokens))
        ids = []
        for i, p in enumerate(prompt):
            p_ids = next(encoded).ids if isinstance(p, str) else list(p)
            if keep is not None:
                p_ids = p_ids[-keep:]
            self.check_prompt(p_ids, where[i])
            ids.append(p_ids)
        return ids, texts

    def tickets(self, params: CompletionParams) -> tuple[list[Ticket], asyncio.Queue]:
        """One engine request per (prompt, choice), choice index = prompt * n + j as OpenAI numbers
        them. Seeds: `seed + index` (so one prompt with n=1 draws exactly as `seed`), or a fresh random
        seed per choice: four copies of a prompt, or n=4, are four independent draws."""
        events: asyncio.Queue = asyncio.Queue()
        req = params.request
        seed = req.seed
        tickets = []
        for k in range(len(params.prompts) * params.n):
            draw = secrets.randbits(63) if seed is None else (seed + k) & _MASK64
            request = Request(
                self.loop.next_id(),
                params.prompts[params.prompt_of(k)],
                params.max_tokens,
                params.temperature,
                params.top_p,
                params.stop_ids,
                draw,
                logprobs=params.logprobs,
                top_k=req.top_k or 0,
                min_tokens=req.min_tokens,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                prompt_logprobs=params.prompt_logprobs,
            )
            tickets.append(Ticket(request, k, events))
        return tickets, events

    def prompt_text(self, params: CompletionParams, choice: int) -> str:
        i = params.prompt_of(choice)
        text = params.prompt_texts[i]
        return text if text is not None else self.tokenizer.decode(params.prompts[i])

    # -- the HTTP request, on the event loop ---------------------------------------------------------

    async def create(self, http_request, prepare=None, shapes: type[CompletionFormat] | None = None):
        """Answer one HTTP request: `prepare` (raw body -> CompletionParams, on a worker thread;
        default: a completions request) and `shapes` (the CompletionFormat of its JSON; chat's
        ChatFormat)."""
        from fastapi.responses import JSONResponse

        try:
            params, tickets, events = await self._submit(http_request, prepare or self.prepare)
        except ApiError as exc:
            self.metrics.rejections.labels(exc.reason).inc()
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        answer = Answer(self, params, tickets, events, shapes or CompletionFormat)
        if params.request.stream:
            return event_stream(answer)
        try:
            return await answer.whole(http_request)
        finally:
            answer.close()

    async def _submit(self, http_request, prepare) -> tuple[CompletionParams, list[Ticket], asyncio.Queue]:
        """The body read, prepared on a worker thread, and its engine requests queued on the engine
        loop; an ApiError when any of it is refused (warming up, failed, full, draining)."""
        raw = await read_body(http_request, self.limits.max_request_bytes)
        params = await asyncio.get_running_loop().run_in_executor(self.executor, prepare, raw)
        if self.loop.fatal:
            raise ApiError(503, f"server unavailable: {self.loop.fatal}", reason="unavailable")
        if not self.loop.ready.is_set():
            raise ApiError(503, "warming up: retry once GET /health answers 200", reason="warming_up")
        tickets, events = self.tickets(params)
        try:
            self.loop.submit(tickets)
        except QueueFull as exc:
            raise ApiError(429, f"{exc}: retry later", None, {"Retry-After": str(exc.retry_after_s)}) from None
        except Draining:
            raise ApiError(503, "server shutting down: not admitting new requests", reason="draining") from None
        return params, tickets, events


async def read_body(http_request, limit: int) -> bytes:
    """The request body, refused with 413 beyond `limit` bytes: from Content-Length before reading
    anything, or while reading a body sent without one."""
    declared = http_request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"request body of {int(declared):,} bytes, the limit is {limit:,} (server.max_request_bytes)"
        )
    chunks, size = [], 0
    async for chunk in http_request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit:,} bytes (server.max_request_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_for_disconnect(http_request) -> None:
    """Returns when the client has gone away (the body has been read, so the next ASGI message is
    the disconnect)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


def event_stream(answer: Answer):
    """The answer as server-sent events; closed when the response ends, however it ends."""
    from fastapi.responses import StreamingResponse

    class EventStream(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:  # also when the stream never started (the client left before the headers)
                answer.close()

    return EventStream(
        answer.events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class Choice:
    """The text of one choice as tokens arrive, and its finish reason."""

    def __init__(self, service: CompletionsService, params: CompletionParams, ticket: Ticket):
        req = params.request
        self.ticket = ticket
        self.text = IncrementalText(
            service.tokenizer,
            params.stop,
            include_stop=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            min_tokens=req.min_tokens,
        )
        self.include_stop = req.include_stop_str_in_output
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.status = 200
        self.stop_ids = ticket.request.stop_ids
        self.ended = False
        self.stop_token: list[int] = []  # the stop token that ended it, kept out of the text
        self.logprobs: list = []  # TokenLogprobs of each generated token, when asked for
        self.prompt_logprobs: list | None = None  # [None, TokenLogprobs...] of the prompt, with echo

    @property
    def token_ids(self) -> list[int]:
        """The tokens generated, up to the stop string or stop token that ended the choice."""
        return self.text.ids[: self.text.consumed] + self.stop_token

    def token(self, token: int) -> str:
        if self.finish_reason is not None:
            return ""  # tokens the engine made after a stop string matched
        if token in self.stop_ids and not self.include_stop:  # a stop token ends the sequence; not its text
            self.stop_token = [token]
            return ""
        delta = self.text.add(token)
        if self.text.stopped:
            self.finish_reason = "stop"
        return delta

    def end(self, c: Completion) -> str:
        self.ended = True
        if self.finish_reason is not None:  # stopped by a stop string; the engine cancel follows
            return ""
        if c.status == "done":
            last = c.output_ids[-1] if c.output_ids else None
            self.finish_reason = "stop" if last in self.stop_ids else "length"
            return self.text.flush()
        self.status = 500 if c.status == "failed" else 503
        self.error = c.reason or c.status
        self.finish_reason = "error"
        return self.text.flush()


@dataclass
class Delta:
    """What one engine event adds to a choice: its text, its finish reason once it has one, the
    token ids behind it (the token's, or [] at the end), and the error of a failed choice."""

    index: int
    text: str
    finish_reason: str | None
    token_ids: list[int]
    error: str | None = None


class Answer:
    """The answer to one completions or chat request: its choices' lifecycle (each cancelled once,
    whatever ends it; counted in flight from opening to `close`), the engine's events routed to
    its choices (`deltas`), and their transport, one JSON body (`whole`) or server-sent events
    (`events`). The response shapes are its `format`'s (a CompletionFormat, or chat's)."""

    def __init__(self, service: CompletionsService, params: CompletionParams, tickets, events, shapes):
        self.service, self.params, self.tickets, self.events_queue = service, params, tickets, events
        self.choices = [Choice(service, params, t) for t in tickets]
        self.format: CompletionFormat = shapes(service, params, self.choices)
        self._cancelled: set[int] = set()
        self._early: list = []  # events that arrived while the prompt log-probs were awaited
        self._closed = False
        service.in_flight += 1  # down again in close(), once: the drain waits for none in flight

    def close(self) -> None:
        """The answer is over (sent, failed, or its client left): cancel what still runs, once."""
        if not self._closed:
            self._closed = True
            self._cancel_unfinished("client disconnected")
            self.service.in_flight -= 1

    def _cancel(self, index: int, reason: str) -> None:
        if index not in self._cancelled:
            self._cancelled.add(index)
            self.service.loop.cancel(self.tickets[index].request.id, reason)

    def _cancel_unfinished(self, reason: str) -> None:
        for ch in self.choices:
            if not ch.ended and ch.finish_reason is None:
                self._cancel(ch.ticket.index, reason)

    def _open(self) -> int:
        return sum(1 for ch in self.choices if not ch.ended and ch.finish_reason is None)

    # -- the engine's events ---------------------------------------------------------------------

    async def _next_event(self):
        return self._early.pop(0) if self._early else await self.events_queue.get()

    async def prompt_logprobs(self) -> None:
        """Echo with log-probs: wait for every choice's prompt log-probs (they come first per choice,
        once its prompt is prefilled; other choices' events that arrive meanwhile are kept for
        `deltas`). A choice that ends before (failed, cancelled) has none: its end is waited for."""
        ended: set[int] = set()
        while any(ch.prompt_logprobs is None and i not in ended for i, ch in enumerate(self.choices)):
            event = await self.events_queue.get()
            if event[1] == "prompt":
                self.choices[event[0]].prompt_logprobs = event[2]
                continue
            if event[1] == "end":
                ended.add(event[0])
            self._early.append(event)

    async def deltas(self):
        """The engine's events for this request as Deltas, until every choice has ended: the one
        loop both the JSON body and the event stream consume (vLLM's serving_completion.py shape).
        A choice that has ended (its engine request finished, or a stop string matched and it was
        cancelled) yields nothing more: the tokens the engine made after the match and its end
        event are dropped. Log-prob events are kept on their choice (a token's arrives just before
        it)."""
        while self._open():
            index, kind, value = await self._next_event()
            ch = self.choices[index]
            if ch.ended or ch.finish_reason is not None:
                continue
            if kind == "prompt":
                ch.prompt_logprobs = value
            elif kind == "logprobs":
                ch.logprobs.append(value)
            elif kind == "token":
                text = ch.token(value)
                if ch.finish_reason == "stop":  # a stop string: this choice is done here
                    self._cancel(index, "stop string")
                yield Delta(index, text, ch.finish_reason, [value])
            else:
                text = ch.end(value)
                yield Delta(index, text, ch.finish_reason, [], ch.error)

    # -- the transport -----------------------------------------------------------------------------

    async def whole(self, http_request):
        from fastapi.responses import JSONResponse

        collecting = asyncio.ensure_future(self._collect())
        gone = asyncio.ensure_future(wait_for_disconnect(http_request))
        try:
            await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            collecting.cancel()
            self._cancel_unfinished("request cancelled")
            raise
        finally:
            gone.cancel()
        if not collecting.done():  # the client went away: free its slots at the next step
            collecting.cancel()
            self._cancel_unfinished("client disconnected")
            return JSONResponse({}, status_code=499)
        return collecting.result()

    async def _collect(self):
        from fastapi.responses import JSONResponse

        params, choices, shapes = self.params, self.choices, self.format
        echo = getattr(params.request, "echo", False)
        texts = [self.service.prompt_text(params, i) if echo else "" for i in range(len(choices))]
        async for delta in self.deltas():
            texts[delta.index] += delta.text
        failed = [ch for ch in choices if ch.error]
        if failed:
            status = max(ch.status for ch in failed)
            return JSONResponse(ApiError(status, f"generation failed: {failed[0].error}").body(), status_code=status)
        return shapes.body([shapes.final_choice(i, texts[i], ch) for i, ch in enumerate(choices)])

    async def events(self):
        params, choices, shapes = self.params, self.choices, self.format
        try:
            if params.prompt_logprobs is not None:  # echo with log-probs: the prompt's come first
                await self.prompt_logprobs()
            for chunk in shapes.prelude():
                yield chunk
            async for d in self.deltas():
                if d.error is None:
                    yield shapes.chunk([shapes.delta_choice(d.index, d.text, d.finish_reason, d.token_ids)])
                    continue
                if d.text:
                    yield shapes.chunk([shapes.delta_choice(d.index, d.text)])
                status = choices[d.index].status
                yield f"data: {json.dumps(ApiError(status, f'generation failed: {d.error}').body())}\n\n"
            if params.include_usage:
                yield shapes.chunk([], usage=shapes.usage())
            yield "data: [DONE]\n\n"
        finally:  # a client that went away (or any exit before the end): free the slots at the next step
            self.close()


class CompletionFormat:
    """OpenAI's completions shapes of one answer: the JSON body, the stream's chunks, the log-probs,
    the usage. The chat shapes (serving/chat.py ChatFormat) change `final_choice`, `body`,
    `chunk_choice`, `prelude` and `logprobs_object`."""

    OBJECT, CHUNK_OBJECT, ID_PREFIX = "text_completion", "text_completion", "cmpl"

    def __init__(self, service: CompletionsService, params: CompletionParams, choices: list[Choice]):
        self.service, self.params, self.choices = service, params, choices
        self.id = f"{self.ID_PREFIX}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # text offset of each streamed choice's next log-prob token

    def usage(self) -> dict:
        """Prompt tokens (once per choice, as vLLM counts them) and the generated tokens each choice used."""
        prompt = sum(len(self.params.prompts[self.params.prompt_of(ch.ticket.index)]) for ch in self.choices)
        completion = sum(len(ch.token_ids) for ch in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def token_entries(self, i: int, ch: Choice) -> tuple[list[int], list]:
        """(token ids, their TokenLogprobs or None) of a choice's log-probs: the prompt's first with
        echo, then the generated tokens up to the one that ended the choice."""
        ids = list(ch.token_ids)
        entries = ch.logprobs[: len(ids)]
        if ch.prompt_logprobs is not None:
            ids = self.params.prompts[self.params.prompt_of(i)] + ids
            entries = ch.prompt_logprobs + entries
        return ids, entries

    def logprobs_object(self, ids: list[int], entries: list, offset: int = 0) -> dict:
        """OpenAI's completions `logprobs`: tokens, token_logprobs, top_logprobs (the top N and, as
        vLLM does, the chosen token), text_offset."""
        svc = self.service
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(ids, entries):
            text = svc.token_str(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            own, top = entry
            out["token_logprobs"].append(own)
            # keyed by text, as OpenAI's format is: two ids with one text share a key, the likelier kept
            tops: dict[str, float] = {}
            for t, lp in top:
                tops.setdefault(svc.token_str(t), lp)
            tops.setdefault(text, own)
            out["top_logprobs"].append(tops)
        return out

    # -- the JSON body ---------------------------------------------------------------------------

    def final_choice(self, i: int, text: str, ch: Choice) -> dict:
        logprobs = self.logprobs_object(*self.token_entries(i, ch)) if self.params.logprobs is not None else None
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": ch.finish_reason}
        if self.params.request.return_token_ids:
            choice["token_ids"] = ch.token_ids
            choice["prompt_token_ids"] = self.params.prompts[self.params.prompt_of(i)]
        return choice

    def body(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": self.OBJECT,
            "created": self.created,
            "model": self.service.model_name,
            "choices": choices,
            "usage": self.usage(),
        }

    # -- the event stream ------------------------------------------------------------------------

    def chunk(self, choices: list[dict], **extra) -> str:
        """One server-sent event of these choices."""
        body = {"id": self.id, "object": self.CHUNK_OBJECT, "created": self.created, "model": self.service.model_name}
        body.update(choices=choices, **extra)
        if self.params.continuous_usage and choices:
            body["usage"] = self.usage()
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def delta_choice(self, i: int, text: str, finish: str | None = None, ids: list[int] | None = None) -> dict:
        """A chunk's choice for what one event added: its text and, when asked for, its log-probs."""
        out = self.chunk_choice(i, text, finish, ids)
        if self.params.logprobs is not None and ids:
            # the log-probs event of a token arrives just before it
            out["logprobs"] = self.chunk_logprobs(i, ids, self.choices[i].logprobs[-len(ids) :])
        return out

    def chunk_logprobs(self, i: int, ids: list[int], entries: list):
        obj = self.logprobs_object(ids, entries, self._offsets.get(i, 0))
        if obj.get("tokens"):  # completions' shape: the next chunk's offsets continue from here
            self._offsets[i] = obj["text_offset"][-1] + len(obj["tokens"][-1])
        return obj

    def chunk_choice(self, i: int, text: str, finish: str | None = None, ids: list[int] | None = None) -> dict:
        out: dict[str, Any] = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        if self.params.request.return_token_ids and ids is not None:
            out["token_ids"] = ids
        return out

    def prelude(self) -> list[str]:
        """The chunks before the first token: the prompts, when echoed (with their log-probs)."""
        params = self.params
        if not params.request.echo:
            return []
        choices = []
        for i, ch in enumerate(self.choices):
            choice = self.chunk_choice(i, self.service.prompt_text(params, i))
            if ch.prompt_logprobs is not None:
                choice["logprobs"] = self.chunk_logprobs(i, params.prompts[params.prompt_of(i)], ch.prompt_logprobs)
            choices.append(choice)
        return [self.chunk(choices)]


def _refuse_unwired(req) -> None:
    """Fields the protocol accepts whose engine side does not exist: refused at any value but the
    neutral one, with the reason, never silently ignored."""
    if getattr(req, "prompt_logprobs", None) is not None:
        raise bad("prompt_logprobs", "not supported (use echo with logprobs for the prompt's log-probs)")
