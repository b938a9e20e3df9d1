"""The OpenAI completions and chat completions requests as pydantic models, with vLLM's extra
fields (as vLLM's entrypoints/openai/protocol.py has them), and the OpenAI-shaped error.

Every field a vLLM client may send is accepted. Those that change results are honoured (`n`,
`seed`, `stop`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`,
`skip_special_tokens`, `truncate_prompt_tokens`, `echo`, `return_token_ids`, ...) or accepted
only at their neutral value, refused otherwise with the reason (`NEUTRAL`). Fields that do not
change the tokens (`user`, `request_id`, `priority`, ...) and unknown ones are ignored with one log
line, as vLLM does. The JSON is parsed by pydantic-core: invalid JSON of any shape (a body nested
100,000 deep, a 5,001-digit integer, a lone surrogate) is one ValidationError, so a 400."""

from __future__ import annotations

import difflib
import reprlib
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

StrictFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class ApiError(Exception):
    """An error answer in OpenAI's shape; `reason` labels it in laplace_rejections_total."""

    TYPES = {
        400: "invalid_request_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
    }
    REASONS = {400: "invalid_request", 404: "model_not_found", 413: "too_large", 429: "queue_full", 503: "unavailable"}

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict | None = None,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.reason = reason or self.REASONS.get(status, str(status))

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "service_unavailable_error" if self.status == 503 else "error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


def bad(param: str | None, message: str, reason: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param, reason=reason)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = False  # OpenAI's default: no usage chunk unless asked for
    continuous_usage_stats: StrictBool | None = False  # vLLM: usage in every chunk


class SamplingFields(BaseModel):
    """The fields both requests share: sampling (vLLM's extras among them, as vLLM defines them:
    serving/sampling.py), stops, streaming."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1)
    best_of: StrictInt | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    echo: StrictBool = False
    # vLLM's extras that we honour
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True  # our byte-level decoder has no such spaces either way
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)
    # vLLM's sampling extras (SamplingParams), same ranges and neutral values
    top_k: StrictInt | None = Field(None, ge=-1)  # -1, 0 or None: every token
    min_tokens: StrictInt = Field(0, ge=0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0)  # 1: off
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. Types are strict (a string "5" is not an integer); ranges that depend
    on the server (max_tokens, prompt length, n) are checked by the completions service."""

    prompt: Any = None  # text, token ids, or a list of either (checked by the service: one error per prompt)
    max_tokens: StrictInt | None = Field(None, ge=1)
    add_special_tokens: StrictBool = True  # the tokenizer's own (e.g. a Llama tokenizer's <s>)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)  # top-N log-probs per token (OpenAI: at most 5; vLLM 20)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)  # vLLM: top-N per prompt token


class ChatMessage(BaseModel):
    """One message; other keys (tool_calls, ...) go to the chat template as they are, as
    transformers passes them."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: the messages rendered by the model's chat template (serving/chat.py)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # vLLM's chat extras
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False  # the template writes the special tokens (vLLM's default for chat)
    chat_template_kwargs: dict[str, Any] | None = None


# Fields accepted only at a neutral value: (the values that are neutral, why no other one is).
NEUTRAL: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "suffix is not supported"),
    "length_penalty": ((None, 1), "length_penalty is not supported (only 1)"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "min_p": ((None, 0), "min_p is not supported (only 0)"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported"),
    "bad_words": ((None, []), "bad_words is not supported"),
    "logits_processors": ((None, []), "logits_processors are not supported"),
    "guided_json": ((None,), "guided decoding is not supported"),
    "guided_regex": ((None,), "guided decoding is not supported"),
    "guided_choice": ((None,), "guided decoding is not supported"),
    "guided_grammar": ((None,), "guided decoding is not supported"),
    "structured_outputs": ((None,), "structured outputs are not supported"),
    "response_format": ((None,), "response_format is not supported"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not supported"),
    "detokenize": ((None, True), "detokenize=false is not supported"),
    "tools": ((None, []), "tools are not supported"),
    "tool_choice": ((None, "none", "auto"), "tool_choice is not supported"),
    "parallel_tool_calls": ((None, False, True), "parallel_tool_calls is not supported"),
    "chat_template": ((None,), "a chat_template in the request is not supported (the model's own is used)"),
}
# Fields that do not change the tokens: accepted, not logged.
QUIET = {"user", "request_id", "priority", "cache_salt", "kv_transfer_params", "vllm_xargs", "prompt_embeds"}


def parse_request(raw: bytes, kind: type[SamplingFields] = CompletionRequest) -> tuple[Any, list[str]]:
    """The validated request (a CompletionRequest, or `kind`) and the fields ignored (unknown ones,
    for one log line)."""
    try:
        req = kind.model_validate_json(raw)
    except ValidationError as exc:
        raise _as_api_error(exc) from None
    extra = req.model_extra or {}
    for key, (neutral, why) in NEUTRAL.items():
        if key in extra and not any(_same(extra[key], v) for v in neutral):
            raise bad(key, f"{why}, got {reprlib.repr(extra[key])}")
    ignored = sorted(k for k in extra if k not in NEUTRAL and k not in QUIET)
    if getattr(req, "best_of", None) is not None and req.best_of is not None and req.best_of != req.n:
        raise bad("best_of", f"only best_of = n is supported (got best_of={req.best_of}, n={req.n})")
    return req, ignored


def ignored_fields_note(ignored: list[str]) -> str:
    known = sorted(CompletionRequest.model_fields)
    hints = [
        f"{k} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, known, 1)) else k for k in ignored
    ]
    return "request fields ignored (not part of the completions API): " + ", ".join(hints)


def _same(a, b) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _as_api_error(exc: ValidationError) -> ApiError:
    e = exc.errors(include_url=False)[0]
    kind, loc = e["type"], [str(p) for p in e["loc"]]
    if kind == "json_invalid":
        return bad(None, f"invalid JSON in the request body: {e['msg'].removeprefix('Invalid JSON: ')}")
    if kind in ("model_type", "model_attributes_type") and not loc:
        return bad(None, "the request body must be a JSON object")
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "the request"
    if kind == "missing":
        return ApiError(400, f"{where}: required", param)
    if kind == "extra_forbidden":
        return ApiError(400, f"{where}: unknown field", param)
    message = e["msg"][0].lower() + e["msg"][1:]
    return ApiError(400, f"{where}: {message}, got {reprlib.repr(e.get('input'))}", param)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[StrictInt]


def parse_model(raw: bytes, kind: type[BaseModel]):
    """Any request model from raw JSON, a 400 naming the field otherwise."""
    try:
        return kind.model_validate_json(raw)
    except ValidationError as exc:
        raise _as_api_error(exc) from None
