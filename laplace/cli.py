"""`laplace <command>`: the pipeline stages, the whole pipeline, generation and model facts."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from laplace import stages
from laplace.config import ConfigError, load_config, preset_model_config
from laplace.model.lm import LaplaceLM, State, kv_cache_bytes, torch_dtype

USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, RuntimeError)
USER_ERROR_EXIT = 2  # laplace.repro treats it as "deterministic: do not retry"

def model_facts(preset: str | None, cfg) -> dict:
    """Parameter count and state/KV memory measured from the real modules and State tensors."""
    model_cfg = preset_model_config(preset, vocab_size=None if preset == "laplace-3b" else cfg.tokenizer.vocab_size) \
        if preset else cfg.model_config()
    with torch.device("meta"):  # count real modules without allocating 3B parameters
        model = LaplaceLM(model_cfg)
    state = State.allocate(model_cfg, batch=1, device="meta", dtype=torch_dtype(model_cfg.dtype))
    params = model.num_parameters()
    embedding = model.embed.weight.numel() + (0 if model_cfg.tie_embeddings else model.lm_head.weight.numel())
    kv = kv_cache_bytes(model_cfg, 8192, bytes_per_value=2)
    return {
        "preset": preset or cfg.model.preset,
        "params": params,
        "params_non_embedding": params - embedding,
        "state_bytes_per_sequence": state.bytes_per_sequence,
        "state_recurrent_bytes": state.recurrent.numel() * state.recurrent.element_size(),
        "state_conv_bytes": 0 if state.conv is None else state.conv.numel() * state.conv.element_size(),
        "kv_cache_bytes_8192": kv,
        "state_vs_kv_8192": kv / state.bytes_per_sequence,
        "config": model_cfg.to_dict(),
    }


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a param, e.g. --set train.lr=0.01 (repeatable)")
    p.add_argument("--root", default=".", help="project root holding data/, runs/, artifacts/, metrics/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laplace", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter count, state bytes and KV-cache comparison of a preset")
    _add_config_args(p)
    p.add_argument("--preset", default=None, help="tiny | small | laplace-3b (default: params.yaml's model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    for name, stage in stages.STAGES.items():
        p = sub.add_parser(name, help=f"stage: {stage.help}")
        _add_config_args(p)
        if name == "train":
            p.add_argument("--no-resume", action="store_true", help="start from step 0 even if checkpoints exist")

    p = sub.add_parser("run", help="the whole pipeline through `dvc repro`; --set values are written to "
                                   "params.yaml first (like dvc exp run --set-param)")
    _add_config_args(p)

    p = sub.add_parser("summary", help="headline figures of the last pipeline run")
    _add_config_args(p)

    p = sub.add_parser("generate", help="generate text from an exported model")
    _add_config_args(p)
    p.add_argument("--model", default=None, help="export directory (default: artifacts/export)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    return parser


def _print_info(facts: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(facts, indent=2))
        return
    c = facts["config"]
    print(f"preset {facts['preset']}: {c['n_layers']} layers, hidden {c['d_model']}, {c['n_heads']} heads, "
          f"vocab {c['vocab_size']}")
    print(f"  parameters              {facts['params']:,} ({facts['params'] / 1e9:.3f} B)")
    print(f"  state per sequence      {facts['state_bytes_per_sequence']:,} bytes "
          f"({facts['state_bytes_per_sequence'] / 1e6:.2f} MB)")
    print(f"  KV cache at 8,192 (bf16) {facts['kv_cache_bytes_8192']:,} bytes "
          f"({facts['kv_cache_bytes_8192'] / 1e9:.2f} GB)")
    print(f"  KV / state              {facts['state_vs_kv_8192']:.1f}x")


def print_summary(info: dict, root: Path) -> None:
    tok, tr, ex, trk = info["tokenize"], info["train"], info["export"], info["tracking"]
    wu, sv = info.get("warmup"), info.get("serve")
    print("\n=== Laplace pipeline ===")
    if tok:
        print(f"corpus      {tok['documents_train'] + tok['documents_val']:,} documents, "
              f"{tok['tokens_train']:,} train / {tok['tokens_val']:,} val tokens")
    if tr:
        print(f"training    {tr['steps']} steps, val loss {tr['val_loss_initial']:.3f} -> {tr['val_loss']:.3f} "
              f"(ppl {tr['val_ppl']:.1f}), {tr['tokens_per_s'] or 0:,.0f} tokens/s")
    if ex:
        print(f"model       {root / ex['export_dir']} ({ex['parameters']:,} parameters)")
    if wu:
        print(f"warmup      {wu['graphs']} graphs compiled in {wu['compile_seconds_total']:.1f}s cold, "
              f"{wu['warm_start_seconds_total']:.1f}s warm ({wu['warm_speedup']:.1f}x)")
    if sv:
        ex_, pd_ = sv["exact"], sv["padded"]
        print(f"serving     {sv['headline_workload']}: padded {pd_['output_tokens_per_s']:.0f} tokens/s, "
              f"{pd_['compile_events']} compiles, TTFT p99 {pd_['ttft_p99_s']:.3f}s | exact "
              f"{ex_['output_tokens_per_s']:.0f} tokens/s, compiles {ex_['compile_step_share']:.1%} of steps, "
              f"{ex_['compile_time_share']:.1%} of decode time")
        ratio_key = next(k for k in sv if k.startswith("decode_cost_ratio_"))
        print(f"            {ratio_key} = {sv[ratio_key]:.3f}; gates {'passed' if sv['passed'] else 'MISSED'}")
    if nm := info.get("numerics"):
        f32, b16 = nm["fp32"]["prefill"], nm["bf16"]["prefill"]
        print(f"numerics    fp32 compiled vs fp64 rel RMS {f32['rel_rms_compiled_vs_fp64']:.1e}, max |compiled-eager| "
              f"{nm['max_abs_logit_diff_fp32']:.1e}; bf16 compiled {b16['rel_rms_compiled_vs_fp64']:.1e} vs eager "
              f"{b16['rel_rms_eager_vs_fp64']:.1e}; gates {'passed' if nm['passed'] else 'MISSED'}")
    if pr := info.get("probes"):
        grid = pr.get("mqar_trained_accuracy") or {}
        if grid:
            ctx = sorted(grid, key=int)
            easy, hard = grid[ctx[0]], grid[ctx[-1]]
            print(f"probes      MQAR-trained GLA: {max(easy.values()):.0%} at {ctx[0]} tokens, "
                  f"{min(hard.values()):.0%} at {ctx[-1]}; exported model MQAR "
                  f"{max(pr['mqar_accuracy'].values()):.0%}, passkey {pr['passkey_accuracy_overall']:.0%}")
        print(f"            state {pr['state_bytes_measured']:,} B/sequence vs KV@8192 {pr['kv_bytes_8192']:,} B; "
              f"3B: {pr['laplace_3b_state_bytes'] / 1e6:.1f} MB vs {pr['laplace_3b_kv_bytes_8192'] / 1e9:.2f} GB "
              f"({pr['laplace_3b_state_vs_kv_8192']:.1f}x)")
    if trk:
        version = f", registered {trk['model_name']} v{trk['model_version']}" if trk.get("model_version") else ""
        print(f"mlflow      run {trk['run_id']} in {trk['tracking_uri']}{version}"
              f"{' (champion)' if trk.get('champion') else ' (candidate)'}")
    print("next        dvc metrics show | dvc plots show   (open dvc_plots/index.html)")
    print(f"            mlflow ui --backend-store-uri sqlite:///{root / 'mlflow.db'} --host 127.0.0.1 --port 5000")
    print("            make prefect-server; make prefect-worker; prefect deployment run 'laplace-pipeline/tiny'")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return _run(args)
    except USER_ERRORS as exc:
        print(f"laplace {args.command}: error: {exc}", file=sys.stderr)
        # a transient failure (tracking.TrackingUnavailable: 75) carries its own status, so it is retried
        return getattr(exc, "exit_status", USER_ERROR_EXIT)


def _run(args) -> int:
    if args.command == "run":
        from laplace import repro

        root = Path(args.root).resolve()
        if args.overrides:
            repro.write_params(root / args.params, args.overrides)
        else:
            load_config(root / args.params)  # fail on bad params before DVC starts anything
        status, _ = repro.repro(root)
        if status != 0:
            print(f"laplace run: dvc repro failed with exit status {status}", file=sys.stderr)
            return status
        print_summary(stages.summary(stages.Paths.at(root)), root)
        return 0

    cfg = load_config(args.params, args.overrides)
    if args.command == "info":
        _print_info(model_facts(args.preset, cfg), args.json)
        return 0
    paths = stages.Paths.at(args.root)
    if args.command == "summary":
        print_summary(stages.summary(paths), paths.root)
    elif args.command == "generate":
        g = cfg.generate
        result = stages.generate_text(
            Path(args.model) if args.model else paths.export_dir,
            args.prompt if args.prompt is not None else g.prompt,
            args.max_new_tokens if args.max_new_tokens is not None else g.max_new_tokens,
            args.temperature if args.temperature is not None else g.temperature,
            args.top_p if args.top_p is not None else g.top_p,
            args.seed if args.seed is not None else g.seed,
        )
        print(result["prompt"] + result["completion"])
    elif args.command == "train":
        print(json.dumps(stages.train_stage(cfg, paths, resume=not args.no_resume), indent=2))
    else:
        print(json.dumps(stages.STAGES[args.command].run(cfg, paths), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
