"""`--model laplace` scores what lm-eval's own HF model scores: the same fla checkpoint, imported and
exported by Laplace, is loaded by lm-eval's HFLM through from_pretrained (fla installed; its Triton
entry points swapped for torch, tests/hf_fixture.py), and both answer the same loglikelihood
requests. Per request the log-likelihoods agree to 1e-4 nats and is_greedy agrees, for Laplace's
byte-level BPE, a Metaspace tokenizer and a Llama-2-layout tokenizer (Prepend ▁ normaliser, <s> by
its post-processor), where encoding a continuation alone adds a ▁ token lm-eval never scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from laplace.data.tokenizer import train_tokenizer
from laplace.model.hf import export_hf, import_checkpoint

from hf_fixture import TEXT, fla_checkpoint, fla_on_cpu

pytest.importorskip("lm_eval", reason="lm-eval (dev) is the reference")
pytest.importorskip("fla", reason="flash-linear-attention (dev) runs lm-eval's HF model")

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
