"""Training: exact resume, learning, divergence, checkpoints, export and generation."""

import dataclasses
import logging
import math
import re

import pytest
import torch

from laplace.config import Config, ConfigError, DataSection, TokenizerSection, TrainSection, config_from_dict
from laplace.data.tokenize import tokenize_corpus
from laplace.model.export import ExportError, export_model, load_export
from laplace.serving.generation import generate_ids
from laplace.serving.sampling import sample_next, stream_key
from laplace.training import checkpoint as ckpt
from laplace.training.loop import TrainingDiverged, check_inputs, lr_scale, train

from project import TWO_LAYER_RUN


def small_config(**train_over) -> Config:
    train = dict(
        steps=12,
        batch_size=4,
        seq_len=32,
        log_every=1,
        eval_every=4,
        eval_batches=2,
        checkpoint_every=5,
        warmup_steps=2,
        keep_checkpoints=5,
    )
    train.update(train_over)
    return config_from_dict(
        {
            **TWO_LAYER_RUN,
            "train": train,
        }
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    cfg = small_config()
    out = tmp_path_factory.mktemp("tokenized")
    tokenize_corpus(cfg.data, cfg.tokenizer, out, cfg.seed)
    return out


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_resume_is_bit_identical_to_an_uninterrupted_run(data_dir, tmp_path, async_checkpoint):
    """With train.async_checkpoint the saves run in DCP's background thread while training goes on:
    the checkpoints and the resumed run are the same, bit for bit."""
    full = train(small_config(), data_dir, tmp_path / "full", progress=False)
    cfg = small_config(async_checkpoint=async_checkpoint)
    first = train(cfg, data_dir, tmp_path / "split", stop_at_step=7, progress=False)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "split/checkpoints")] == [7, 5]
    assert first.metrics["steps"] == 7
    second = train(cfg, data_dir, tmp_path / "split", progress=False)
    assert second.metrics["resumed_from_step"] == 7

    losses_full = [(h["step"], h["loss"]) for h in full.history if "loss" in h]
    losses_split = [(h["step"], h["loss"]) for h in second.history if "loss" in h]
    assert len(losses_full) == 12
    assert losses_split == losses_full  # float equality: bit for bit
    a = ckpt.model_tensors(full.checkpoint)
    b = ckpt.model_tensors(second.checkpoint)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_reduces_validation_loss(data_dir, tmp_path, caplog):
    cfg = small_config(steps=80, eval_every=80, checkpoint_every=80)
    with caplog.at_level(logging.INFO, logger="laplace.training.loop"):
        result = train(cfg, data_dir, tmp_path, progress=False)
    # one plain progress line per logged step, with the rate and the time left, whatever the front door
    assert re.search(r"step 40/80 loss \d+\.\d{4} \| [\d,]+ tok/s \| ETA \d+(m\d\ds|s)\n", caplog.text + "\n")
    assert re.search(r"step 80/80 loss \d+\.\d{4} val_loss \d+\.\d{4} \| [\d,]+ tok/s \| ETA 0s", caplog.text)
    assert result.metrics["val_loss_initial"] == pytest.approx(math.log(400), rel=0.05)
    # measured 6.01 -> 4.63 (77%) on the default corpus's first 300 documents, spread over 16 slices
    assert result.metrics["val_loss"] < 0.85 * result.metrics["val_loss_initial"]
    assert result.metrics["tokens_per_s"] > 0


def test_train_threads_is_the_thread_count_the_loop_runs_with(data_dir, tmp_path):
    """train.threads reaches torch in the training process (metrics' `threads`, read inside the loop)."""
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            cfg = small_config(steps=1, eval_every=1, checkpoint_every=1, threads=threads)
            result = train(cfg, data_dir, tmp_path / str(threads), progress=False)
            assert result.metrics["threads"] == threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_changed_settings_do_not_resume_a_foreign_checkpoint(data_dir, tmp_path, caplog):
    first = train(small_config(steps=5), data_dir, tmp_path, progress=False)
    cfg = small_config(steps=5, lr=0.001)  # same model, different optimisation: a different run
    with caplog.at_level(logging.WARNING):
        second = train(cfg, data_dir, tmp_path, progress=False)
    assert second.metrics["resumed_from_step"] == 0 and "belong to another run" in caplog.text
    assert (tmp_path / "previous" / first.checkpoint.name / "manifest.json").exists()  # kept, not lost
    # bookkeeping knobs do not make a different run
    third = train(small_config(steps=5, lr=0.001, eval_every=2, log_every=5), data_dir, tmp_path, progress=False)
    assert third.metrics["resumed_from_step"] == 5


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(data_dir, tmp_path):
    cfg = small_config(steps=30, checkpoint_every=2)

    def poison(step, model, optimizer):
        if step == 5:  # 0-based: the 6th step sees a NaN weight
            with torch.no_grad():
                model.blocks[0].mlp.up_proj.weight[0, 0] = float("nan")

    with pytest.raises(TrainingDiverged, match="loss is nan at step 6") as err:
        train(cfg, data_dir, tmp_path, before_step=poison, progress=False)
    assert "\n" not in str(err.value)
    good = ckpt.latest_checkpoint(tmp_path / "checkpoints")
    assert good.step == 4
    assert all(torch.isfinite(t).all() for t in good.model.values())


def test_damaged_checkpoint_is_skipped_with_a_warning(data_dir, tmp_path, caplog):
    train(small_config(steps=10, checkpoint_every=5), data_dir, tmp_path, progress=False)
    root = tmp_path / "checkpoints"
    newest = ckpt.list_checkpoints(root)[0][1]
    weights = sorted(newest.glob("*.safetensors"))[0]
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        found = ckpt.latest_checkpoint(root)
    assert found.step == 5
    assert str(weights) in caplog.text and "sha256" in caplog.text


def test_lr_schedules():
    t = TrainSection(steps=100, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_scale(0, t) == pytest.approx(0.1) and lr_scale(9, t) == pytest.approx(1.0)
    assert lr_scale(99, t) == pytest.approx(0.1, abs=0.01)
    w = dataclasses.replace(t, schedule="wsd", decay_fraction=0.2)
    assert lr_scale(50, w) == 1.0 and lr_scale(79, w) == 1.0
    assert lr_scale(99, w) == pytest.approx(0.1)
    assert lr_scale(50, dataclasses.replace(t, schedule="constant")) == 1.0


def test_export_is_byte_reproducible_and_generates(data_dir, tmp_path):
    cfg = small_config(steps=6)
    result = train(cfg, data_dir, tmp_path / "run", progress=False)
    found = ckpt.load_checkpoint(result.checkpoint)
    export_model(found, data_dir / "tokenizer.json", tmp_path / "a")
    export_model(found, data_dir / "tokenizer.json", tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    model, tok, config = load_export(tmp_path / "a")
    prompt = tok.encode("The function returns").ids
    ids = generate_ids(model, prompt, 10, temperature=0.0)
    # greedy generation equals argmax of the full forward over the growing sequence
    seq = list(prompt)
    for _ in range(10):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert ids == seq[len(prompt) :]
    sampled = generate_ids(model, prompt, 10, temperature=1.0, top_p=0.9, seed=3)
    assert sampled == generate_ids(model, prompt, 10, temperature=1.0, top_p=0.9, seed=3)


def test_export_rejects_a_mismatched_tokenizer(data_dir, tmp_path):
    result = train(small_config(steps=3), data_dir, tmp_path / "run", progress=False)
    export_model(ckpt.load_checkpoint(result.checkpoint), data_dir / "tokenizer.json", tmp_path / "exp")
    other = tmp_path / "other_tok"
    tokenize_corpus(DataSection(max_documents=100, num_proc=1), TokenizerSection(vocab_size=300), other, 1)
    (tmp_path / "exp" / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    with pytest.raises(ExportError, match=r"tokenizer\.json is truncated or resized"):
        load_export(tmp_path / "exp")  # the manifest notices the replaced file
    from laplace import manifest

    manifest.write_manifest(tmp_path / "exp", "export", step=3)  # a manifest rewritten to match the swap
    with pytest.raises(ExportError, match="not the tokenizer this model was trained with"):
        load_export(tmp_path / "exp")  # the tokenizer's own hash in config.json still does


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    keys = torch.tensor([stream_key(7, i) for i in range(4000)])  # 4000 draws of one request seeded 7
    draws = sample_next(logits, 1.0, 0.7, keys)
    assert set(draws.tolist()) == {0, 1}  # 0.5 + 0.3 covers 0.7; tokens 2 and 3 are outside the nucleus
    # renormalised inside the nucleus: 0.625 / 0.375 (binomial sd 0.008 at 4000 draws)
    assert abs((draws == 0).float().mean().item() - 0.625) < 0.03
    full = sample_next(logits, 1.0, 1.0, keys)
    assert torch.allclose(torch.bincount(full, minlength=4) / 4000.0, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    assert int(sample_next(logits[:1], 0.0, 1.0)) == 0
    assert torch.equal(draws, sample_next(logits, 1.0, 0.7, keys))  # a pure function of (seed, token index)
    other = torch.tensor([stream_key(8, i) for i in range(4000)])
    assert not torch.equal(draws, sample_next(logits, 1.0, 0.7, other))


def test_bf16_training_tracks_fp32(data_dir, tmp_path):
    """bf16 is FSDP2 mixed precision: bf16 parameters and compute, fp32 reduction and master weights."""
    fp32 = train(small_config(steps=8), data_dir, tmp_path / "fp32", progress=False)
    bf16 = train(small_config(steps=8, precision="bf16"), data_dir, tmp_path / "bf16", progress=False)
    a = [h["loss"] for h in fp32.history if "loss" in h]
    b = [h["loss"] for h in bf16.history if "loss" in h]
    assert all(math.isfinite(x) for x in b)
    assert max(abs(x - y) / x for x, y in zip(a, b)) < 0.02  # bf16 rounding, not a different run


def test_compiled_training_matches_eager(data_dir, tmp_path):
    eager = train(small_config(steps=4), data_dir, tmp_path / "eager", progress=False)
    compiled = train(small_config(steps=4, compile=True), data_dir, tmp_path / "compiled", progress=False)
    a = [h["loss"] for h in eager.history if "loss" in h]
    b = [h["loss"] for h in compiled.history if "loss" in h]
    assert max(abs(x - y) / x for x, y in zip(a, b)) < 1e-4


@pytest.mark.slow
def test_the_loop_with_checkpointing_and_accumulation_resumes_the_plain_run_and_trains_it_the_same(data_dir, tmp_path):
    """train() end to end: a plain run stopped at step 2 resumes with train.activation_checkpoint:
    selective and train.grad_accum_steps: 4 (neither is in the run fingerprint), and its steps 3
    and 4 have the uninterrupted plain run's losses at fp32 tolerance (other summation orders in
    the accumulated gradient, amplified by Muon's bf16 Newton-Schulz). A micro-batch count that
    does not divide each rank's share of the batch is rejected with one line naming the knob."""
    plain = train(small_config(steps=4), data_dir, tmp_path / "plain", progress=False)
    train(small_config(steps=4), data_dir, tmp_path / "mixed", stop_at_step=2, progress=False)
    cfg = small_config(steps=4, activation_checkpoint="selective", grad_accum_steps=4)
    mixed = train(cfg, data_dir, tmp_path / "mixed", progress=False)
    assert mixed.metrics["resumed_from_step"] == 2
    want = {h["step"]: h["loss"] for h in plain.history if "loss" in h}
    got = {h["step"]: h["loss"] for h in mixed.history if "loss" in h}
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-4)
    with pytest.raises(ConfigError, match="train.grad_accum_steps 3 does not divide each rank's 4 sequences"):
        check_inputs(small_config(grad_accum_steps=3), data_dir, 1)


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint(data_dir, tmp_path):
    """One process: SIGTERM at step 3 (checkpoint_every 5) finishes that step, saves it, and raises
    TrainingStopped (exit 143 at the CLI); the rerun resumes from it."""
    import os
    import signal

    from laplace.training.lifecycle import TrainingStopped

    def terminate_at_3(step, model, optimizer):
        if step == 2:  # the third step
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingStopped, match="stopped by SIGTERM after step 3; checkpoint step_000003 kept"):
        train(small_config(), data_dir, tmp_path / "run", before_step=terminate_at_3, progress=False)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run/checkpoints")] == [3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is the loop's only while it runs
    resumed = train(small_config(), data_dir, tmp_path / "run", progress=False)
    assert resumed.metrics["resumed_from_step"] == 3


def test_sigint_stops_at_a_step_boundary_as_sigterm_does(data_dir, tmp_path):
    """Ctrl-C is SIGINT, and torchrun's agent forwards SIGINT to the ranks: the loop treats it as
    SIGTERM (the step finishes, its checkpoint is written) and the stop exits 130, not 143."""
    import os
    import signal

    from laplace.training.lifecycle import TrainingStopped

    def interrupt_at_2(step, model, optimizer):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # Python's own; SIG_IGN in a shell's background job
    with pytest.raises(TrainingStopped, match="stopped by SIGINT after step 2; checkpoint step_000002 kept") as stop:
        train(small_config(steps=6), data_dir, tmp_path / "run", before_step=interrupt_at_2, progress=False)
    assert stop.value.exit_status == 128 + signal.SIGINT
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run/checkpoints")] == [2]
    assert signal.getsignal(signal.SIGINT) is before  # the handler the loop found, again


def test_an_async_checkpoint_is_in_place_at_the_first_step_boundary_after_its_write(data_dir, tmp_path):
    """train.async_checkpoint: the write of step 2 runs in the background; once its shards and
    digests are on disk, the next step boundary renames it into place (before, it waited for the
    next save, at step 4: a crash at step 3 lost both intervals)."""
    import time

    root = tmp_path / "run/checkpoints"
    seen = {}

    def watch(step, model, optimizer):
        if step == 2:  # the 3rd step starts: the write of step 2 is in flight or done
            digests = root / ".step_000002.partial" / ".digests-rank00000.json"
            deadline = time.monotonic() + 60
            while not digests.exists() and not (root / "step_000002").exists():
                assert time.monotonic() < deadline, "the background write of step 2 never finished"
                time.sleep(0.02)
            time.sleep(0.1)  # the write's future resolves just after its digests land
        if step == 3:  # the boundary after step 3 has run: step 2 must be in place, step 4 not written yet
            seen["at_step_4"] = [s for s, _ in ckpt.list_checkpoints(root)]

    cfg = small_config(steps=4, checkpoint_every=2, eval_every=100, async_checkpoint=True)
    train(cfg, data_dir, tmp_path / "run", before_step=watch, progress=False)
    assert seen["at_step_4"] == [2]
    assert ckpt.verify_manifest(root / "step_000002")[0]
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [4, 2]
