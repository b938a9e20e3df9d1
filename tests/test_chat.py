"""The OpenAI / vLLM API on a served import: chat completions with the model's own chat
template, log-probs and echo (lm-eval's local-completions scores through them), vLLM's payloads
and routes.

- the chat template renders as transformers' apply_chat_template renders it (the oracle: the dev
  extra's transformers), for the import's template, the default one and a template using
  transformers' Jinja extras (tojson, loop controls, raise_exception, {% generation %});
- an import carries its tokenizer_config.json's template; `laplace export --format hf` writes it
  back where transformers reads it;
- a real `laplace serve` of that import hit by the official openai client (chat.completions.create,
  plain and streamed): the prompt it tokenized equals apply_chat_template's ids, the answer equals
  a greedy completion of those ids; `vllm bench serve`'s chat payload; /tokenize, /detokenize,
  /version, /ping, OpenAI-shaped 404 / 405, /v1/models' max_model_len;
- lm-eval's `local-completions` (echo + logprobs over HTTP) on that server gives the numbers
  `--model laplace` gives in process; generated tokens' logprobs are the raw log-softmax."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from laplace.model.export import read_export_config
from laplace.model.hf import export_hf, import_checkpoint
from laplace.pipeline.params import load_config
from laplace.pipeline.serve import ServerProcess
from laplace.serving.chat import DEFAULT_CHAT_TEMPLATE, render_chat

from hf_fixture import fla_checkpoint
from project import ROOT

fla = pytest.importorskip("fla", reason="flash-linear-attention (the dev extra) builds the fla-format checkpoint")
transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is the template oracle")

MODEL = "laplace-gla"
# Zephyr's template (as published in HuggingFaceH4/zephyr-7b-beta's tokenizer_config.json, in spirit):
# roles as tags, eos after each turn, the generation prompt last
ZEPHYR = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}"
)
# transformers' Jinja extras: tojson keeping non-ASCII, break, raise_exception, the generation block
EXTRAS = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
    "{% else %}[{{ m['role'] }}] {{ m['content'] | trim }}\n{% endif %}"
    "{% if m['content'] == 'STOP' %}{% break %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a fox."},
        {"role": "assistant", "content": "Quick brown — «renard»."},
        {"role": "user", "content": "  And a dog?  "},
    ],
    [{"role": "user", "content": "one"}, {"role": "user", "content": "STOP"}, {"role": "user", "content": "never"}],
]


@pytest.fixture(scope="module")
def chat_import(tmp_path_factory):
    """(fla checkpoint dir with a chat template, its Laplace import, the import's hf export)."""
    root = tmp_path_factory.mktemp("chat")
    src = fla_checkpoint(root / "fla")
    config = json.loads((src / "tokenizer_config.json").read_text()) if (src / "tokenizer_config.json").exists() else {}
    config.update(chat_template=ZEPHYR, bos_token="<s>", eos_token="</s>")
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "chat_template.jinja").unlink(missing_ok=True)
    import_checkpoint(src, root / "export")
    export_hf(root / "export", root / "hf")
    return src, root / "export", root / "hf"


def outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError:
        return "ValueError"


def hf_tokenizer(hf_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(hf_dir))


@pytest.mark.parametrize("template", [ZEPHYR, EXTRAS, DEFAULT_CHAT_TEMPLATE], ids=["zephyr", "extras", "default"])
def test_the_chat_template_renders_as_transformers_apply_chat_template(chat_import, template):
    tok = hf_tokenizer(chat_import[2])
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ours = render_chat(template, messages, add_generation_prompt=gen, special_tokens=specials)
            theirs = tok.apply_chat_template(
                messages, chat_template=template, tokenize=False, add_generation_prompt=gen
            )
            assert ours == theirs, (template[:30], messages, gen)
        # continue_final_message: the same text, or both refuse (a template that drops the final message)
        ours = outcome(
            render_chat,
            template,
            messages,
            add_generation_prompt=False,
            continue_final_message=True,
            special_tokens=specials,
        )
        theirs = outcome(
            tok.apply_chat_template,
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=False,
            continue_final_message=True,
        )
        assert ours == theirs
    with pytest.raises(Exception, match="bad role"):
        render_chat(EXTRAS, [{"role": "robot", "content": "x"}], special_tokens=specials)


def test_an_import_carries_its_chat_template_and_the_hf_export_writes_it(chat_import):
    _, export_dir, hf_dir = chat_import
    assert read_export_config(export_dir)["chat_template"] == ZEPHYR
    assert json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"] == ZEPHYR
    assert hf_tokenizer(hf_dir).chat_template == ZEPHYR
    # and back again: the hf export imports with the same template
    again = hf_dir.parent / "again"
    import_checkpoint(hf_dir, again)
    assert read_export_config(again)["chat_template"] == ZEPHYR


@pytest.fixture(scope="module")
def chat_server(chat_import, tmp_path_factory):
    _, export_dir, hf_dir = chat_import
    from laplace.pipeline.repro import subprocess_env

    cfg = load_config(
        ROOT / "params.yaml",
        {
            "engine.max_slots": 4,
            "engine.max_queue": 16,
            "engine.prefill_buckets": [16, 128],
            "engine.max_prompt_tokens": 256,
            "server.max_new_tokens": 64,
        },
    )
    env = subprocess_env({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    server = ServerProcess(cfg, model=export_dir, policy="eager", root=tmp_path_factory.mktemp("srv"), env=env)
    server.start()
    try:
        server.wait_ready(180)
        yield server.url, hf_dir
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_the_openai_client_chats_with_the_models_template_plain_and_streamed(chat_server):
    openai = pytest.importorskip("openai")
    url, hf_dir = chat_server
    messages = CONVERSATIONS[1]
    expected_ids = hf_tokenizer(hf_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "keys"):  # transformers 5 may return a BatchEncoding
        expected_ids = expected_ids["input_ids"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    plain = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    body = plain.model_dump()
    assert body["object"] == "chat.completion"
    assert body["prompt_token_ids"] == list(expected_ids)  # the prompt equals transformers' apply_chat_template
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert plain.usage.prompt_tokens == len(expected_ids) and plain.usage.completion_tokens == 12
    # the answer is a greedy completion of those very ids
    completion = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": list(expected_ids), "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        timeout=120,
    ).json()
    assert choice.message.content == completion["choices"][0]["text"]

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    # n choices, a stop string, usage counting each choice
    two = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_completion_tokens=8, temperature=1.0, seed=3, stop=["\n\n\n"]
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.prompt_tokens == 2 * len(expected_ids)
    assert two.usage.completion_tokens <= 16
    # a bad role is a 400 naming the messages, from the template; max_completion_tokens over the limit a 400
    bad = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    over = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_completion_tokens": 65},
    )
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_completion_tokens"


@pytest.mark.slow
def test_vllm_bench_serve_chat_payload_succeeds(chat_server):
    """The request `vllm bench serve --backend openai-chat` sends (vllm/benchmarks/lib/endpoint_request_func.py,
    async_request_openai_chat_completions: content as text parts, max_completion_tokens, stream with usage,
    ignore_eos, its sampling extras in extra_body), read as it reads the stream. vLLM itself does not
    install here, so its payload is reproduced."""
    url, _ = chat_server
    model = httpx.get(url + "/v1/models").json()["data"][0]
    payload = {
        "model": model["id"],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}],
        "max_completion_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    headers = {"Content-Type": "application/json", "x-request-id": "bench-chat-0"}
    text, output_tokens, first = "", None, False
    with httpx.stream("POST", url + "/v1/chat/completions", json=payload, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for message in r.iter_lines():
            if not message or message.startswith(":"):
                continue
            chunk = message.removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if choices := data.get("choices"):
                first = True
                text += choices[0]["delta"].get("content") or ""
            elif usage := data.get("usage"):
                output_tokens = usage.get("completion_tokens")
    assert first and output_tokens == 10 and text


@pytest.mark.slow
def test_tokenize_detokenize_version_ping_and_openai_shaped_route_errors(chat_server):
    url, hf_dir = chat_server
    tok = hf_tokenizer(hf_dir)
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "The quick brown fox"}).json()
    assert r["tokens"] == tok("The quick brown fox")["input_ids"] and r["count"] == len(r["tokens"])
    models = httpx.get(url + "/v1/models").json()["data"][0]
    # every request with prompt + max_tokens <= max_model_len is served: min(256 prompt, 64 new) + 1
    assert r["max_model_len"] == models["max_model_len"] == 65
    chat = httpx.post(url + "/tokenize", json={"messages": CONVERSATIONS[1]}).json()
    expected = tok.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert chat["tokens"] == list(expected)
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == tok.decode(r["tokens"])
    assert httpx.post(url + "/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert httpx.get(url + "/version").json()["version"]
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    missing = httpx.get(url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.get(url + "/v1/chat/completions")
    assert wrong.status_code == 405 and "method not allowed" in wrong.json()["error"]["message"]
    # max_model_len is what is served: the longest prompt with 1 token to generate, the longest output
    for prompt, max_tokens in ((64, 1), (1, 64)):
        body = {"model": MODEL, "prompt": [5] * prompt, "max_tokens": max_tokens, "ignore_eos": True}
        ok = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200, ok.text


DOCS = [
    {"q": "A key is", "choices": [" a word", " the value"]},
    {"q": "The value is", "choices": [" its number", " a fox"]},
    {"q": "The quick", "choices": [" brown", " lazy dog"]},
]


@pytest.mark.slow
def test_lm_eval_local_completions_through_the_server_equals_the_laplace_model_in_process(
    chat_import, chat_server, tmp_path, monkeypatch
):
    """lm-eval's own OpenAI-completions client (`--model local-completions`: echo + logprobs=1,
    max_tokens=1, prompts as token ids from the local tokenizer) against the live server, and
    `--model laplace` in this process, on a local multiple-choice task: the same log-likelihood
    for every (context, continuation) within fp32 tolerance, and the same is_greedy."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from laplace.evals.harness import evaluate

    _, export_dir, hf_dir = chat_import
    url, _ = chat_server
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({**d, "gold": 0}) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "choice.yaml").write_text(
        f"task: local_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n"
    )
    # the model starts every text with <s> (its bos_id): lm-eval's add_bos_token does the same
    model_args = (
        f"base_url={url}/v1/completions,model={MODEL},tokenizer={hf_dir},tokenizer_backend=huggingface,"
        "add_bos_token=True,tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=200"
    )
    http = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["local_choice"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    local = evaluate(
        export_dir, ["local_choice"], include_path=str(tasks), model_args={"compile": "false"}, log_samples=True
    )
    theirs = {s["doc_id"]: s["resps"] for s in http["samples"]["local_choice"]}
    ours = {s["doc_id"]: s["resps"] for s in local["samples"]["local_choice"]}
    assert theirs.keys() == ours.keys() == {0, 1, 2}
    for doc in ours:
        for (lp_http, greedy_http), (lp_local, greedy_local) in zip(
            [r[0] for r in theirs[doc]], [r[0] for r in ours[doc]]
        ):
            assert lp_http == pytest.approx(lp_local, rel=1e-5, abs=1e-4)
            assert greedy_http == greedy_local
    assert http["results"]["local_choice"]["acc,none"] == local["results"]["local_choice"]["acc,none"]


@pytest.mark.slow
def test_logprobs_of_generated_tokens_and_echo_streamed_and_not(chat_import, chat_server):
    """logprobs=N: each generated token's raw log-prob and the top N (plus the chosen one, as vLLM
    returns); echo + logprobs: the prompt's first (None for its first token); streamed the same."""
    from laplace.model.export import load_export

    _, export_dir, hf_dir = chat_import
    url, _ = chat_server
    model, tokenizer, _ = load_export(export_dir)
    prompt = [1] + tokenizer.encode("The quick brown fox", add_special_tokens=False).ids
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    plain = httpx.post(url + "/v1/completions", json={**body, "echo": True, "return_token_ids": True}, timeout=60)
    assert plain.status_code == 200, plain.text
    choice = plain.json()["choices"][0]
    lp = choice["logprobs"]
    ids = prompt + choice["token_ids"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) == len(prompt) + 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)
    for pos in range(1, len(ids)):  # the model's parallel forward: the reference for every position
        assert lp["token_logprobs"][pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=2e-4)
        # the top 3 and the chosen token (keys are token texts: two ids with one text share a key, as in
        # OpenAI's format, so the values are compared)
        allowed = ref[pos - 1].topk(3).values.tolist() + [float(ref[pos - 1, ids[pos]])]
        values = list(lp["top_logprobs"][pos].values())
        assert max(values) == pytest.approx(allowed[0], abs=2e-4)
        assert all(min(abs(v - a) for a in allowed) < 2e-4 for v in values)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    # greedy: every generated token is its position's argmax, so its log-prob is the top one
    for pos in range(len(prompt), len(ids)):
        assert lp["token_logprobs"][pos] == max(lp["top_logprobs"][pos].values())
    # streamed: the same log-probs per generated token
    streamed = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    if c.get("logprobs"):
                        streamed += c["logprobs"]["token_logprobs"]
    assert streamed == pytest.approx(lp["token_logprobs"][len(prompt) :], abs=1e-6)
    # chat: logprobs + top_logprobs in OpenAI's chat shape
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "ignore_eos": True,
        },
        timeout=60,
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["logprob"] == c["top_logprobs"][0]["logprob"] for c in content)  # greedy


def _read_like_vllm_bench(url: str, path: str, payload: dict) -> tuple[bool, int | None, str]:
    """(first chunk received, usage.completion_tokens, text) read as vllm bench serve reads the stream."""
    text, output_tokens, first = "", None, False
    with httpx.stream("POST", url + path, json=payload, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for message in r.iter_lines():
            if not message or message.startswith(":"):
                continue
            chunk = message.removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            assert "error" not in data, data
            if choices := data.get("choices"):
                first = True
                piece = choices[0]["delta"].get("content") if "delta" in choices[0] else choices[0].get("text")
                text += piece or ""
            elif usage := data.get("usage"):
                output_tokens = usage.get("completion_tokens")
    return first, output_tokens, text


@pytest.mark.slow
def test_vllm_bench_serve_payloads_with_top_k_logprobs_and_min_tokens_succeed(chat_server):
    """`vllm bench serve --top-k 50 --logprobs 1` with min_tokens in --extra-body, completions and
    chat (the payloads of vllm/benchmarks/lib/endpoint_request_func.py; its sampling flags go into
    extra_body, merged into the payload): every request succeeds, and min_tokens holds without
    ignore_eos."""
    url, _ = chat_server
    extra_body = {"top_k": 50, "top_p": 0.9, "temperature": 1.0, "min_tokens": 8, "repetition_penalty": 1.1}
    completions = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "repetition_penalty": 1.0,
        "max_tokens": 12,
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra_body,
    }
    first, tokens, _ = _read_like_vllm_bench(url, "/v1/completions", completions)
    assert first and tokens is not None and 8 <= tokens <= 12
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}],
        "max_completion_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra_body,
    }
    first, tokens, _ = _read_like_vllm_bench(url, "/v1/chat/completions", chat)
    assert first and tokens is not None and 8 <= tokens <= 12
    # min_tokens over max_tokens is a 400 naming it, as vLLM refuses it
    bad = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"
