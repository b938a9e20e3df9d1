"""lm-evaluation-harness through the `laplace` model, offline: task YAMLs over a JSONL the test
writes, the numbers checked against the model's own log-likelihoods (its parallel forward)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from laplace.data.tokenizer import train_tokenizer
from laplace.model.export import load_export
from laplace.model.hf import export_hf, import_checkpoint
from laplace.pipeline import cli

from hf_fixture import TEXT, fla_checkpoint, fla_on_cpu

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra laplace[eval] (in dev)")
pytest.importorskip("fla", reason="flash-linear-attention (dev) builds the fla-format checkpoint")

DOCS = [
    {"text": "The quick brown fox jumps over the lazy dog.", "q": "A key is", "choices": [" a word", " the value"]},
    {"text": "Gated linear attention keeps a fixed state.", "q": "The value is", "choices": [" its number", " a fox"]},
    {"text": "A fixed state, whatever the length of the text.", "q": "The quick", "choices": [" brown", " lazy dog"]},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    import_checkpoint(fla_checkpoint(root / "fla"), root / "export")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({**d, "gold": 0}) + "\n" for d in DOCS))
    tasks = root / "tasks"
    tasks.mkdir()
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tasks / "rolling.yaml").write_text(
        "task: local_rolling\n" + common + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
    )
    (tasks / "choice.yaml").write_text(
        "task: local_choice\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n"
    )
    (tasks / "gen.yaml").write_text(
        "task: local_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{q}}'\n"
        "doc_to_target: '{{choices[0]}}'\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: 4\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return root


def own_logprob(model, prompt: list[int], continuation: list[int]) -> float:
    """log p(continuation | prompt) from the model's parallel forward (no engine), in fp64 sums."""
    tokens = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logp = F.log_softmax(model(tokens)[0].double(), -1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(continuation))


def _arguments(sample) -> list[tuple[str, str]]:
    """(context, continuation) of each request of a logged sample (lm-eval adds the target delimiter)."""
    args = sample["arguments"]
    args = args.values() if isinstance(args, dict) else args
    return [tuple(a.values())[:2] if isinstance(a, dict) else tuple(a)[:2] for a in args]


def test_lm_eval_numbers_are_the_models_own_log_likelihoods(setup, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from laplace.evals.harness import evaluate

    results = evaluate(
        setup / "export",
        ["local_rolling", "local_choice", "local_gen"],
        include_path=str(setup / "tasks"),
        model_args={"compile": "false", "max_slots": "2"},  # 3 docs over 2 slots: widths 1 and 2 of the ladder
        log_samples=True,
    )
    model, tokenizer, config = load_export(setup / "export")
    bos = config["bos_id"]
    assert bos == 1  # the Llama convention: every text starts with <s>
    for sample in results["samples"]["local_rolling"]:
        ids = tokenizer.encode(sample["doc"]["text"], add_special_tokens=False).ids
        # the rolling log-likelihood is minus the model's loss (summed) on <s> + text
        tokens = torch.tensor([[bos] + ids])
        with torch.no_grad():
            loss = F.cross_entropy(model(tokens)[0, :-1].double(), tokens[0, 1:], reduction="sum")
        assert sample["resps"][0][0] == pytest.approx(-float(loss), rel=1e-5, abs=1e-4)
    for sample in results["samples"]["local_choice"]:
        for (context, continuation), response in zip(_arguments(sample), sample["resps"]):
            prompt = [bos] + tokenizer.encode(context, add_special_tokens=False).ids
            cont = tokenizer.encode(continuation, add_special_tokens=False).ids
            assert response[0][0] == pytest.approx(own_logprob(model, prompt, cont), rel=1e-5, abs=1e-4)
    for sample in results["samples"]["local_gen"]:  # greedy: argmax of the parallel forward, token by token
        seq = [bos] + tokenizer.encode(sample["doc"]["q"], add_special_tokens=False).ids
        start = len(seq)
        for _ in range(4):
            with torch.no_grad():
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        text = tokenizer.decode(seq[start:])
        assert sample["resps"][0][0] == (text[: text.find(".")] if "." in text else text)
    word_ppl = results["results"]["local_rolling"]["word_perplexity,none"]
    assert word_ppl > 1


def test_laplace_eval_and_lm_eval_command_lines(setup, tmp_path, capsys):
    out = tmp_path / "results.json"
    status = cli.main(
        [
            "eval",
            "--model",
            str(setup / "export"),
            "--tasks",
            "local_choice",
            "--include-path",
            str(setup / "tasks"),
            "--model-args",
            "compile=false",
            "--output",
            str(out),
        ]
    )
    assert status == 0
    assert "local_choice" in capsys.readouterr().out  # lm-eval's results table
    assert json.loads(out.read_text())["results"]["local_choice"]["acc,none"] in (0.0, 1 / 3, 2 / 3, 1.0)
    # a task that does not exist: one line, exit 2
    assert cli.main(["eval", "--model", str(setup / "export"), "--tasks", "no_such_task"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown lm-eval task 'no_such_task'" in err


@pytest.mark.slow
def test_lm_eval_cli_with_the_laplace_model(setup, tmp_path):
    """lm-eval's own command line, unchanged: `lm_eval --model laplace` (the .pth `make setup` writes
    registers the model; laplace/evals/lm_eval_plugin.py), in a fresh environment with only PATH."""
    lm_eval = Path(sys.executable).parent / "lm_eval"
    assert any((Path(sys.executable).parent.parent / "lib").rglob("laplace_lm_eval.pth")), "run make setup"
    args = ["--model", "laplace", "--model_args", f"export={setup / 'export'},compile=false"]
    args += ["--tasks", "local_rolling", "--include_path", str(setup / "tasks"), "--output_path", str(tmp_path)]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(lm_eval), *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "local_rolling" in done.stdout and "word_perplexity" in done.stdout
    assert list(Path(tmp_path).rglob("results_*.json"))


# --------------------------------------------------------------------------- the same numbers as lm-eval's HFLM
# The same fla checkpoint, imported and exported by Laplace, is loaded by lm-eval's HFLM through
# from_pretrained (fla installed; its Triton entry points swapped for torch, tests/hf_fixture.py), and
# both answer the same loglikelihood requests: per request within 1e-4 nats and the same is_greedy, for
# Laplace's byte-level BPE, a Metaspace tokenizer and a Llama-2-layout tokenizer (Prepend ▁ normaliser,
# <s> by its post-processor), where encoding a continuation alone adds a ▁ token lm-eval never scores.

CORPUS = [TEXT, "A fox is a word; the dog is lazy. Remember the key and its value, then the state."] * 20


def laplace_bpe(path: Path) -> tuple[Path, int | None, int]:
    tok = train_tokenizer(CORPUS, vocab_size=300, min_frequency=1)
    tok.save(str(path))
    return path, None, 0  # no BOS; <|endoftext|> (id 0) starts and ends texts


def metaspace(path: Path) -> tuple[Path, int | None, int]:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(str(path))
    return path, None, 2  # sentencepiece without BOS: </s> is the prefix token


def llama2(path: Path) -> tuple[Path, int | None, int]:
    """As transformers writes a Llama-2 tokenizer.json: no pre-tokenizer, a normaliser that prepends ▁
    and turns spaces into ▁, <s> added by the post-processor."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    # trained split at word starts, as sentencepiece trains (no merge across a ▁), then stored without
    # a pre-tokenizer, as Llama's tokenizer.json is
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.pre_tokenizer = None
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))
    return path, 1, 2


REQUESTS = [
    ("The quick brown", " fox"),
    ("The quick brown ", "fox jumps"),  # trailing space: moved to the continuation
    ("A key is", " a word to remember"),
    ("the value is its", " number."),
    ("", "The lazy dog"),  # empty context: the prefix token conditions it
    ("Gated linear attention keeps a fixed state\n", "whatever the length"),
    ("A fox is a word;", " the"),
]


@pytest.mark.parametrize("layout", [laplace_bpe, metaspace, llama2], ids=["laplace-bpe", "metaspace", "llama2"])
def test_loglikelihoods_agree_with_lm_evals_hflm_per_request(layout, tmp_path):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from laplace.evals.harness import LaplaceHarnessLM

    tok_path, bos, eos = layout(tmp_path / "tokenizer.json")
    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    src = fla_checkpoint(tmp_path / "fla", bos_token_id=bos, eos_token_id=eos, vocab_size=vocab)
    (src / "tokenizer.json").write_bytes(tok_path.read_bytes())
    import_checkpoint(src, tmp_path / "export")
    export_hf(tmp_path / "export", tmp_path / "hf")

    ours = LaplaceHarnessLM(export=str(tmp_path / "export"), device="cpu", compile="false", max_slots=4)
    requests = list(REQUESTS)
    # one request whose continuation is the model's own greedy choice, so is_greedy is not always
    # false: the first context whose argmax token comes back from its text as that one token
    for context in [" ".join(TEXT.split()[:n]) for n in range(2, 30)]:
        prompt = ours.tok_encode(context)
        with torch.no_grad():
            greedy = int(ours.model(torch.tensor([prompt]))[0, -1].argmax())
        text = ours.tokenizer.decode(prompt + [greedy])[len(ours.tokenizer.decode(prompt)) :]
        if text and ours.encode_pair(context, text) == (prompt, [greedy]):
            requests.append((context, text))
            break
    assert len(requests) == len(REQUESTS) + 1, "no context's greedy token round-trips through its text"
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(requests)]

    with fla_on_cpu():
        theirs = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", batch_size=1, dtype="float32")
        # one request at a time: in a batch, lm-eval 0.4.13's HFLM gives a one-token continuation the
        # logits of another request whose context + continuation[:-1] are the same tokens ("The quick
        # brown " + "fox jumps" and "The quick brown fox" + " t": -5.55 in the batch, -5.34 alone)
        expected = [theirs.loglikelihood([one], disable_tqdm=True)[0] for one in instances]
    got = ours.loglikelihood(instances)
    for pair, (want, want_greedy), (have, have_greedy) in zip(requests, expected, got):
        assert abs(have - want) <= 1e-4, (layout.__name__, pair, have, want)
        assert have_greedy == want_greedy, (layout.__name__, pair)
    # the encodings under test: each pair as lm-eval's own model split it
    for pair in requests[:-1]:
        if pair[0]:
            assert tuple(ours.encode_pair(*pair)) == tuple(theirs._encode_pair(*pair)), pair
    if layout is llama2:  # what went wrong before: the continuation encoded alone carries an extra ▁
        assert ours.encode(" fox")[0] != ours.encode_pair("The quick brown", " fox")[1][0]
    if layout is metaspace:  # the windows of a tokenizer without BOS (laplace-bpe) and with one (llama2)
        return
    # rolling windows at max_length as HFLM computes them (lm-eval's get_rolling_token_windows over
    # the text as HFLM encodes it), per document; and the same max_length left-truncates a long context
    texts = [TEXT, " ".join([TEXT] * 2)]
    rolling = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    long_context = [Instance("loglikelihood", {}, (" ".join([TEXT] * 2), " the value"), 0)]
    windowed = LaplaceHarnessLM(export=str(tmp_path / "export"), device="cpu", compile="false", max_length=16)
    with fla_on_cpu():
        theirs = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", batch_size=1, dtype="float32", max_length=16)
        expected = theirs.loglikelihood_rolling(rolling, disable_tqdm=True)
        expected_truncated = theirs.loglikelihood(long_context, disable_tqdm=True)
    assert windowed.loglikelihood_rolling(rolling) == pytest.approx(expected, rel=1e-5, abs=1e-4)
    assert windowed.loglikelihood(long_context)[0][0] == pytest.approx(expected_truncated[0][0], abs=1e-4)
    assert len(windowed.rolling_pairs(texts[1])) > 3


# --------------------------------------------------------------------------- the scoring forward
# Each continuation is scored from one chunked forward's logits, the rows of a group right-padded
# together: pieces (SCORE_LOGITS), fp64 blocks (LOGPROB_ROWS) and padding leave every number the
# parallel forward's; an attention layer's K/V cache (max_context) bounds a pair.

PAIRS = [([1, 5, 9], [17, 4, 33, 8, 21, 6, 40]), ([1], [12, 7]), ([1, 3, 3, 50, 2, 7, 90], [11]), ([1, 8], [])]


def test_pieces_blocks_and_padded_rows_leave_each_score_the_parallel_forwards(setup, monkeypatch):
    from laplace.evals import harness

    ours = harness.LaplaceHarnessLM(export=str(setup / "export"), device="cpu", compile="false", max_slots=3)
    monkeypatch.setattr(harness, "SCORE_LOGITS", 3 * ours.model.cfg.vocab_size * 2)  # 3 rows: pieces of 2 tokens
    monkeypatch.setattr(harness, "LOGPROB_ROWS", 3)
    for (total, greedy), (prompt, cont) in zip(ours.score(PAIRS), PAIRS):
        assert total == pytest.approx(own_logprob(ours.model, prompt, cont), rel=1e-5, abs=1e-5)
        with torch.no_grad():
            argmax = ours.model(torch.tensor([prompt + cont]))[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        assert greedy == (argmax == cont)


def test_an_attention_hybrid_is_scored_within_max_context(tmp_path):
    from laplace.errors import ConfigError
    from laplace.evals.harness import LaplaceHarnessLM
    from laplace.model.lm import LaplaceLM

    from hf_fixture import llama_style_tokenizer
    from project import tiny_model_config, write_model_export

    attn = {"layers": [1], "num_heads": 2, "window_size": 4}  # GLA, then sliding-window attention
    torch.manual_seed(0)
    model = LaplaceLM(tiny_model_config(300, n_layers=2, attn=attn)).eval()
    export = write_model_export(
        model, llama_style_tokenizer(tmp_path / "tokenizer.json"), tmp_path / "export", bos_id=1
    )
    ours = LaplaceHarnessLM(export=str(export), device="cpu", compile="false", max_slots=2, max_context=10)
    for (total, _), (prompt, cont) in zip(ours.score(PAIRS), PAIRS):
        assert total == pytest.approx(own_logprob(ours.model, prompt, cont), rel=1e-5, abs=1e-5)
    with pytest.raises(ConfigError, match=re.escape("a request of 11 tokens does not fit max_context=10")):
        ours.score([([1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12])])
    # without max_context: 2,048 (engine.max_context's default), or room for a whole max_length window
    for max_length, cache in ((None, 2048), (1000, 2048), (4094, 4095)):
        lm = LaplaceHarnessLM(export=str(export), device="cpu", compile="false", max_slots=1, max_length=max_length)
        assert lm.engine.cache.max_context == cache, max_length


def test_the_laplace_model_refuses_what_it_cannot_honour_by_name():
    from laplace.errors import ConfigError
    from laplace.evals.harness import LaplaceHarnessLM

    refused = [
        ({"pretrained": "gpt2", "trust_remote_code": True}, "unknown model_args pretrained, trust_remote_code"),
        ({"truncation": "true"}, "truncation=true is HFLM's tokenizer-side truncation"),
        ({"rolling": "windows"}, "rolling=windows needs max_length"),
        ({"rolling": "sliding"}, "rolling='sliding' (choose windows or document)"),
        ({"max_length": "long"}, "max_length='long' is not an integer"),
        ({"max_slots": 4, "batch_size": 2}, "max_slots=4 and batch_size=2 disagree"),
        ({"dtype": "float8"}, "dtype='float8' (choose auto, float32, float16, bfloat16)"),
    ]
    for args, message in refused:  # each before the export is read: one line, naming the argument
        with pytest.raises(ConfigError, match=re.escape(message)):
            LaplaceHarnessLM(export="/nonexistent", **args)


# --------------------------------------------------------------------------- over HTTP: the same numbers
# lm-eval's own OpenAI-completions client (`--model local-completions`: echo + logprobs, prompts as
# token ids from the HF export's tokenizer, batched and concurrent) against a live `laplace serve` of
# the export, and `--model laplace` in this process on the same export: the same score per document,
# for rolling windows over documents longer than max_length and for a multiple-choice task.
# TemplateAPI keeps one token of its max_length for generation and one more for the window's context
# (lm_eval/models/api_models.py: max_length - 1, then max_seq_len = max_length - 1), so its
# max_length = ours + 2 gives HFLM's windows at ours.

MAX_LENGTH = 24
LONG_DOCS = [
    {"text": " ".join([TEXT] * 2), "q": "A key is", "choices": [" a word", " the value"]},
    {"text": TEXT[::-1].capitalize() + " " + TEXT, "q": "The quick brown fox jumps over", "choices": [" the", " a"]},
    {"text": " ".join(d["text"] for d in DOCS * 2), "q": "Gated linear attention", "choices": [" keeps", " reads"]},
]


@pytest.fixture(scope="module")
def served(setup, tmp_path_factory):
    """(server URL, HF export of the export, task folder): `laplace serve` eager, buckets [8, 16],
    so the windows' prompts (up to MAX_LENGTH + 1 tokens) are prefilled in chunks."""
    from laplace.pipeline.params import load_config
    from laplace.pipeline.repro import subprocess_env
    from laplace.pipeline.serve import ServerProcess

    from project import ROOT

    root = tmp_path_factory.mktemp("served")
    export_hf(setup / "export", root / "hf")
    data = root / "long.jsonl"
    data.write_text("".join(json.dumps({**d, "gold": 0}) + "\n" for d in LONG_DOCS))
    tasks = root / "tasks"
    tasks.mkdir()
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tasks / "rolling.yaml").write_text(
        "task: long_rolling\n" + common + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
    )
    (tasks / "choice.yaml").write_text(
        "task: long_choice\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n"
    )
    overrides = {"engine.max_slots": 4, "engine.prefill_buckets": [8, 16], "server.max_new_tokens": 16}
    cfg = load_config(ROOT / "params.yaml", overrides)
    env = subprocess_env({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    (root / "srv").mkdir()
    server = ServerProcess(cfg, model=setup / "export", policy="eager", root=root / "srv", env=env)
    server.start()
    try:
        server.wait_ready(180)
        yield server.url, root / "hf", tasks
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_local_completions_against_laplace_serve_equals_the_laplace_model_per_document(served, setup, monkeypatch):
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from laplace.evals.harness import LaplaceHarnessLM, evaluate

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url, hf_dir, tasks = served
    names = ["long_rolling", "long_choice"]
    model_args = (
        f"base_url={url}/v1/completions,model=laplace-gla,tokenizer={hf_dir},tokenizer_backend=huggingface,"
        f"add_bos_token=True,tokenized_requests=True,batch_size=4,num_concurrent=2,max_retries=1,"
        f"max_length={MAX_LENGTH + 2}"
    )
    http = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=names,
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    args = {"compile": "false", "max_length": MAX_LENGTH, "add_bos_token": "true"}
    local = evaluate(setup / "export", names, include_path=str(tasks), model_args=args, log_samples=True)
    ours = LaplaceHarnessLM(export=str(setup / "export"), compile=False, max_length=MAX_LENGTH, add_bos_token=True)
    for doc in LONG_DOCS:  # the documents are longer than max_length: several windows each
        assert len(ours.rolling_pairs(doc["text"])) >= 3
    for task in names:
        theirs = {s["doc_id"]: [r[0] for r in s["resps"]] for s in http["samples"][task]}
        mine = {s["doc_id"]: [r[0] for r in s["resps"]] for s in local["samples"][task]}
        assert theirs.keys() == mine.keys() == {0, 1, 2}
        for doc in mine:
            for a, b in zip(theirs[doc], mine[doc]):
                a, b = (a[0], b[0]) if isinstance(a, (list, tuple)) else (a, b)  # (log-likelihood, is_greedy)
                assert a == pytest.approx(b, rel=1e-4), (task, doc)
    assert http["results"]["long_choice"]["acc,none"] == local["results"]["long_choice"]["acc,none"]
    # whole-document scoring (rolling=document, the default without max_length) sees every earlier
    # token: a different number, the model's loss on <s> + the text
    whole = LaplaceHarnessLM(export=str(setup / "export"), compile=False, max_length=MAX_LENGTH, rolling="document")
    instances = [Instance("loglikelihood_rolling", {}, (doc["text"],), i) for i, doc in enumerate(LONG_DOCS)]
    windows = {s["doc_id"]: s["resps"][0][0] for s in local["samples"]["long_rolling"]}
    for i, total in enumerate(whole.loglikelihood_rolling(instances)):
        assert total != pytest.approx(windows[i], rel=1e-3)


@pytest.mark.slow
def test_local_completions_at_max_length_4096_scores_a_longer_document_against_laplace_serve(
    served, setup, tmp_path, monkeypatch
):
    """lm-eval's default-sized windows against the server's defaults (engine.max_prompt_tokens 32768):
    a window's prompt of 4095 tokens is prefilled in chunks, not refused."""
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from laplace.evals.harness import LaplaceHarnessLM
    from laplace.pipeline.stage_serve_check import scrape

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url, hf_dir, _ = served
    text = " ".join([TEXT] * 50)  # about 5,100 tokens: two windows
    ours = LaplaceHarnessLM(export=str(setup / "export"), compile=False, max_length=4094, add_bos_token=True)
    assert len(ours.tok_encode(text)) > 4096 and len(ours.rolling_pairs(text)) == 2
    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (tmp_path / "rolling.yaml").write_text(
        f"task: rolling_4096\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'doc.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n"
    )
    before = scrape(url)
    http = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={url}/v1/completions,model=laplace-gla,tokenizer={hf_dir},"
        "tokenizer_backend=huggingface,add_bos_token=True,tokenized_requests=True,max_retries=1,max_length=4096",
        tasks=["rolling_4096"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    after = scrape(url)
    refused = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("laplace_rejections_total")}
    assert not any(refused.values()), refused
    (sample,) = http["samples"]["rolling_4096"]
    score = sample["resps"][0][0]
    # lm-eval's max_length=4096 is ours at 4094 (module comment above): its windows, each scored by the
    # model's parallel forward, as `--model laplace` scores them (one chunked forward a window: seconds;
    # one decode step a token took minutes). The server's prompt log-probs are that forward too, in fp32
    # per token: 2.4e-4 nats apart in 29,532 when written; 1e-6 relative (0.03 nats) leaves 100x for
    # another thread count's sums
    pairs = ours.rolling_pairs(text)
    expected = sum(own_logprob(ours.model, context, continuation) for context, continuation in pairs)
    assert math.isfinite(score) and score == pytest.approx(expected, rel=1e-6)
    (local,) = ours.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert local == pytest.approx(expected, rel=1e-6)


# --------------------------------------------------------------------------- a Gated DeltaNet export


def test_lm_eval_scores_a_gated_deltanet_export_by_its_own_log_likelihoods(setup, tmp_path, monkeypatch):
    """`--model laplace` on a Gated DeltaNet export (an fla GatedDeltaNetForCausalLM imported: 2 GDN
    layers, GVA), its prompts through the engine's slots: the rolling and multiple-choice numbers
    are the model's own log-likelihoods (its parallel forward)."""
    from laplace.evals.harness import evaluate

    from hf_fixture import fla_gdn_checkpoint

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import_checkpoint(fla_gdn_checkpoint(tmp_path / "fla", num_heads=1, num_v_heads=2), tmp_path / "export")
    results = evaluate(
        tmp_path / "export",
        ["local_rolling", "local_choice"],
        include_path=str(setup / "tasks"),
        model_args={"compile": "false", "max_slots": "2"},
        log_samples=True,
    )
    model, tokenizer, config = load_export(tmp_path / "export")
    assert model.cfg.gdn_layers == (0, 1) and not model.cfg.gla_layers and config["bos_id"] == 1
    for sample in results["samples"]["local_rolling"]:
        tokens = torch.tensor([[1] + tokenizer.encode(sample["doc"]["text"], add_special_tokens=False).ids])
        with torch.no_grad():
            loss = F.cross_entropy(model(tokens)[0, :-1].double(), tokens[0, 1:], reduction="sum")
        assert sample["resps"][0][0] == pytest.approx(-float(loss), rel=1e-5, abs=1e-4)
    for sample in results["samples"]["local_choice"]:
        for (context, continuation), response in zip(_arguments(sample), sample["resps"]):
            prompt = [1] + tokenizer.encode(context, add_special_tokens=False).ids
            cont = tokenizer.encode(continuation, add_special_tokens=False).ids
            assert response[0][0] == pytest.approx(own_logprob(model, prompt, cont), rel=1e-5, abs=1e-4)
