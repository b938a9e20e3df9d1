"""POST /v1/chat/completions (vLLM's serving_chat.py, for one model): the messages rendered by
the model's chat template, then served as a completion of the rendered prompt.

The template is the model's own (`chat_template` of an imported checkpoint's
tokenizer_config.json or chat_template.jinja, carried in the export's config.json), rendered
with Jinja as transformers renders it (`render_chat` below), or `DEFAULT_CHAT_TEMPLATE` for a
model that has none (a model Laplace trained on plain text: no chat tokens in its vocabulary).
The rendered text is tokenized without the tokenizer's own special tokens (the template writes
them, e.g. `{{ bos_token }}`), and a special token's text in it is that token, as transformers'
`apply_chat_template` and vLLM do.

Written here rather than imported from transformers: the server does not depend on transformers
(a multi-hundred-MB dependency for one Jinja environment); the dev extra's transformers is the
test oracle (tests/test_chat.py checks the rendered prompt equals `apply_chat_template`'s)."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache

from laplace.serving.completions import Choice, CompletionFormat, CompletionParams, CompletionsService
from laplace.serving.protocol import ApiError, ChatCompletionRequest, bad, ignored_fields_note, parse_request

log = logging.getLogger("laplace.serving.server")

# For a model without a template of its own: plain "Role: text" turns, one blank line between
# them, and "Assistant:" to answer after. Plain text because a Laplace-trained model has no chat
# tokens (ChatML's <|im_start|> would be split into bytes it never saw). Documented in
# docs/serving.md.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@lru_cache(maxsize=8)
def compile_template(source: str):
    """The template compiled in the Jinja environment transformers uses for chat templates
    (transformers 5's utils/chat_template_utils.py `_compile_jinja_template`): an immutable sandbox,
    trim_blocks and lstrip_blocks, loop controls, a `tojson` filter that keeps non-ASCII text,
    `raise_exception`, `strftime_now`, `dict`, a `namespace` that refuses underscore names, and
    the `{% generation %}` block (rendered as its body)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks
        in transformers; rendering is the body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class SafeNamespace(jinja2.utils.Namespace):
        """A namespace that cannot hold underscore names (no way to CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = SafeNamespace
    return env.from_string(source)


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for one field
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where the final message ends


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    special_tokens: dict[str, str] | None = None,
    **kwargs,
) -> str:
    """The prompt text of `messages`, as transformers' apply_chat_template(tokenize=False) renders
    it: the template gets `messages` (a message's reasoning under each of transformers' names for
    it), `tools` and `documents` (none), `add_generation_prompt`, the special tokens (bos_token,
    eos_token) and any extra keyword; with continue_final_message the text ends where the last
    message's content ends (found by transformers' marker), so the model continues it."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    chat = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        chat.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else dict(m))
    if continue_final_message:
        final = chat[-1].get("content")
        if final is None:
            raise ValueError('continue_final_message: the final message has no "content" to continue')
        if "content" not in template:
            raise ValueError('continue_final_message: the chat template does not read "content"')
        chat[-1] = {**chat[-1], "content": final + CONTINUE_TAG}
    variables = {**(special_tokens or {}), **kwargs}
    text = compile_template(template).render(
        messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
    )
    if continue_final_message:
        if final.strip() not in text or CONTINUE_TAG.strip() not in text:
            raise ValueError("continue_final_message: the final message is not in the rendered prompt")
        at = text.rindex(CONTINUE_TAG.strip())
        text = text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
    return text


def message_dicts(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the template sees them. A content given as parts is joined into one string
    (text parts, one newline between them: vLLM's "string" content format), so templates written
    for string content work with the parts form clients such as `vllm bench serve` send."""
    out = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_unset=True)  # what the client sent, as transformers would get it
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content", f"only text parts are supported, got {part.get('type')!r}")
                texts.append(part["text"])
            d["content"] = "\n".join(texts)
        out.append(d)
    return out


class ChatService:
    """Chat completions over the completions service: the same queue, limits, streaming and
    disconnect handling; only the prompt (rendered from messages) and the answer's shape differ."""

    def __init__(self, completions: CompletionsService, template: str | None, special_tokens: dict[str, str]):
        self.completions = completions
        self.template = template or DEFAULT_CHAT_TEMPLATE
        self.is_default = template is None
        self.special_tokens = special_tokens
        compile_template(self.template)  # a template that does not compile fails at startup, not per request
        # The rendered prompt is tokenized with the special tokens the template wrote (`</s>`) as those
        # tokens, as transformers does; the completions tokenizer encodes them as text
        # (laplace.data.tokenizer.load_tokenizer). A copy of its own: the flag is per tokenizer object.
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(completions.tokenizer.to_str())
        self.tokenizer.encode_special_tokens = False

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def render(self, req) -> str:
        """The prompt text of a request's messages (a chat completion, or /tokenize given messages),
        or a 400 when the template cannot render them."""
        try:
            return render_chat(
                self.template,
                message_dicts(req),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                special_tokens=self.special_tokens,
                **(req.chat_template_kwargs or {}),
            )
        except ApiError:
            raise
        except Exception as exc:  # the template's own raise_exception, or a message it cannot render
            raise bad("messages", f"the chat template cannot render these messages: {exc}") from None

    def prepare(self, raw: bytes) -> CompletionParams:
        svc = self.completions
        req, ignored = parse_request(raw, ChatCompletionRequest)
        if ignored:
            log.info(ignored_fields_note(ignored))
        svc.check_model(req)
        if req.echo:
            raise bad("echo", "echo is not supported for chat completions")
        text = self.render(req)
        limit = svc.limits.max_prompt_tokens
        if len(text) > limit * svc.max_chars_per_token:
            raise ApiError(
                400,
                f"messages: the rendered prompt's {len(text):,} characters are more than {limit} tokens, "
                f"the limit is {limit} (engine.max_prompt_tokens)",
                "messages",
                reason="prompt_too_long",
            )
        ids = self.encode(text, req.add_special_tokens)
        if req.truncate_prompt_tokens is not None:
            ids = ids[-req.truncate_prompt_tokens :]
        svc.check_prompt(ids, "messages")
        if req.max_completion_tokens is not None:
            max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, field = req.max_tokens, "max_tokens"
        # no 16-token default as in completions: a chat answer runs to its end (EOS) or the server's limit
        if max_tokens is None:
            max_tokens = svc.limits.max_tokens
        return svc.params_for(req, [ids], [text], max_tokens, field)

    async def create(self, http_request):
        return await self.completions.create(http_request, prepare=self.prepare, shapes=ChatFormat)


class ChatFormat(CompletionFormat):
    """OpenAI's chat shapes: `message` / `delta` instead of `text`, the role first in a stream."""

    OBJECT, CHUNK_OBJECT, ID_PREFIX = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def logprobs_object(self, ids: list[int], entries: list, offset: int = 0) -> dict:
        """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
        svc = self.service

        def item(token: int, lp: float) -> dict:
            text = svc.token_str(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {**item(t, e[0]), "top_logprobs": [item(tt, lp) for tt, lp in e[1]]}
                for t, e in zip(ids, entries)
                if e is not None
            ]
        }

    def final_choice(self, i: int, text: str, ch: Choice) -> dict:
        logprobs = self.logprobs_object(*self.token_entries(i, ch)) if self.params.logprobs is not None else None
        choice = {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": ch.finish_reason,
        }
        if self.params.request.return_token_ids:
            choice["token_ids"] = ch.token_ids
        return choice

    def body(self, choices: list[dict]) -> dict:
        out = super().body(choices)
        if self.params.request.return_token_ids:  # vLLM puts the chat's prompt ids at the top level
            out["prompt_token_ids"] = self.params.prompts[0]
        return out

    def chunk_choice(self, i: int, text: str, finish: str | None = None, ids: list[int] | None = None) -> dict:
        out = {"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        if self.params.request.return_token_ids and ids is not None:
            out["token_ids"] = ids
        return out

    def prelude(self) -> list[str]:
        """OpenAI's first chunk of each choice: the role, no content yet."""
        first = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(self.choices))
        ]
        return [self.chunk(first)]
