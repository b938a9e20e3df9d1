"""`laplace <command>`: the pipeline stages, the whole pipeline, generation and model facts."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

from laplace.errors import INPUT_ERROR_EXIT, Failure, InputError
from laplace.model.config import PRESETS, preset_model_config
from laplace.pipeline import serve, stages, summary
from laplace.pipeline.layout import Paths
from laplace.pipeline.logs import setup_logging
from laplace.pipeline.params import add_config_arguments, load_config


def _model_config(preset: str | None, cfg):
    """A preset (the tokenizer's vocab size where the preset has none), or params.yaml's model."""
    if preset:
        has_vocab = bool(PRESETS.get(preset, {}).get("vocab_size"))
        return preset_model_config(preset, vocab_size=None if has_vocab else cfg.tokenizer.vocab_size)
    return cfg.model_config()


def model_facts(preset: str | None, cfg) -> dict:
    """`laplace info`: facts of a preset (or of params.yaml's model) from the real modules on meta."""
    from laplace.model.facts import model_facts as facts

    return {
        "preset": preset or cfg.model.preset,
        "model": _model_name(preset, cfg) if cfg.model.init and not preset else f"preset {preset or cfg.model.preset}",
        **facts(_model_config(preset, cfg)),
    }


def _model_name(preset: str | None, cfg) -> str:
    """What the figures describe: a preset, or model.init's import (whose architecture wins)."""
    return preset or (f"model.init {cfg.model.init}" if cfg.model.init else cfg.model.preset)


def stage_description(name: str, dvc_yaml: Path | None = None) -> str:
    """A stage's --help text: what it does (its module's docstring), the params it reads and what
    it writes, both as dvc.yaml declares them (so the help cannot drift from the pipeline)."""
    import inspect

    from laplace.pipeline.params import parse_yaml

    stage = stages.STAGES[name]
    here = Path(__file__).parent
    doc = inspect.cleandoc(stage.module.__doc__ or "") or stage.help
    text = [" ".join(doc.split("\n\n")[0].split())]
    dvc_yaml = dvc_yaml or here.parents[1] / "dvc.yaml"
    try:
        entry = (parse_yaml(dvc_yaml.read_text(encoding="utf-8")) or {})["stages"][name]
    except (OSError, KeyError, TypeError):
        return textwrap.fill(text[0], 79)

    def names(items) -> list[str]:
        out = []
        for item in items or []:
            if isinstance(item, dict):  # `path: {options}`, or `params.yaml:` (every param)
                out += ["every param" if key == "params.yaml" else key for key in item]
            else:
                out.append(str(item))
        return out

    reads = names(entry.get("params"))
    writes = names(entry.get("outs")) + names(entry.get("metrics")) + names(entry.get("plots"))
    text.append(f"params read (params.yaml): {', '.join(reads) if reads else 'none'}")
    text.append(f"writes: {', '.join(writes)}")
    return "\n\n".join(textwrap.fill(t, 79, subsequent_indent="  " if i else "") for i, t in enumerate(text))


def _with_stage_description(parser: argparse.ArgumentParser, name: str):
    """format_help that fills the description only when help is asked for (it reads files)."""
    plain = parser.format_help

    def format_help() -> str:
        parser.description = stage_description(name)
        return plain()

    return format_help


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laplace", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # in the order `laplace --help` lists the commands
    for add_commands in (
        _add_model_fact_commands,
        _add_stage_commands,
        _add_pipeline_commands,
        _add_export_use_commands,
        _add_compare_commands,
        _add_serve_command,
    ):
        add_commands(sub)
    return parser


def _add_model_fact_commands(sub: argparse._SubParsersAction) -> None:
    """info and plan: a model's figures on meta, nothing run."""
    p = sub.add_parser("info", help="parameter count, state bytes and KV-cache comparison of a preset")
    add_config_arguments(p)
    p.add_argument("--preset", default=None, help="tiny | small | laplace-3b (default: params.yaml's model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser(
        "plan",
        help="dry run of distributed training: per-rank memory and Muon traffic on N ranks (nothing allocated)",
    )
    add_config_arguments(p)
    p.add_argument("--preset", default=None, help="tiny | small | laplace-3b (default: params.yaml's model)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: train.nproc_per_node x train.nnodes)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="default: train.precision")
    p.add_argument(
        "--device-memory", default="24GiB", help="memory per rank, e.g. 24GiB (a Trn2 logical core), 80GB, 1.5TiB"
    )
    p.add_argument("--hbm-gib", type=float, default=None, help=argparse.SUPPRESS)  # the older spelling
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: train.seq_len)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per rank per micro-batch (default: train.batch_size / ranks / train.grad_accum_steps, else 1)",
    )
    p.add_argument("--grad-accum", type=int, default=None, help="default: train.grad_accum_steps")
    p.add_argument(
        "--activation-checkpoint", choices=["none", "full", "selective"], default=None, help="default: train's"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_stage_commands(sub: argparse._SubParsersAction) -> None:
    """`laplace <stage>` for every stage; train and export have options of their own."""
    for name, stage in stages.STAGES.items():
        p = sub.add_parser(name, help=f"stage: {stage.help}", formatter_class=argparse.RawDescriptionHelpFormatter)
        p.format_help = _with_stage_description(p, name)
        add_config_arguments(p)
        p.add_argument("--json", action="store_true", help="print the stage's figures as one JSON object")
        if name == "train":
            p.add_argument("--no-resume", action="store_true", help="start from step 0 even if checkpoints exist")
        if name == "export":
            p.add_argument(
                "--format",
                choices=["laplace", "hf"],
                default="laplace",
                help="laplace: the stage (checkpoint -> artifacts/export); hf: an export -> the HF / "
                "flash-linear-attention layout (transformers' from_pretrained after `import fla`)",
            )
            p.add_argument(
                "--model", default=None, help="--format hf: the export to convert (default: artifacts/export)"
            )
            p.add_argument("--out", default=None, help="--format hf: output directory (default: artifacts/export-hf)")


def _add_pipeline_commands(sub: argparse._SubParsersAction) -> None:
    """import (a checkpoint in, to train from), run (the whole pipeline) and summary (its figures)."""
    p = sub.add_parser(
        "import",
        help="a GLA checkpoint in the HF / flash-linear-attention layout (a directory or a hub id) -> a Laplace export",
    )
    add_config_arguments(p)
    p.add_argument("src", help="a checkpoint directory (config.json, model.safetensors, tokenizer.json) or a hub id")
    p.add_argument("--out", default=None, help="the Laplace export to write (default: models/<SRC's last name>)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser(
        "run",
        help="the whole pipeline through `dvc repro`; --set values are written to "
        "params.yaml first (like dvc exp run --set-param)",
    )
    add_config_arguments(p)

    p = sub.add_parser("summary", help="headline figures of the last pipeline run")
    add_config_arguments(p)


def _add_export_use_commands(sub: argparse._SubParsersAction) -> None:
    """generate and eval: an exported model used in this process, through the decode engine."""
    p = sub.add_parser("generate", help="generate text from an exported model (through the decode engine)")
    add_config_arguments(p)
    p.add_argument("--model", default=None, help="export directory (default: artifacts/export)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object (text and token ids)")

    p = sub.add_parser(
        "eval",
        help="lm-evaluation-harness tasks on an export, through the serving engine (pip install 'laplace[eval]')",
    )
    add_config_arguments(p)
    p.add_argument("--model", default=None, help="export directory (default: artifacts/export)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", default=None, help="a directory of task YAMLs (lm-eval's --include_path)")
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    p.add_argument(
        "--model-args",
        default="",
        help="the laplace model's options, k=v,...: device, kernel, max_slots, compile, max_gen_toks",
    )
    p.add_argument("--output", default=None, help="write the results as JSON to this file")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")


def _add_compare_commands(sub: argparse._SubParsersAction) -> None:
    """The architecture comparison (compare/dvc.yaml): an arm, the table, an MQAR cell, the protocol."""
    p = sub.add_parser(
        "compare-arm",
        help="the architecture comparison, one arm (compare.arms): its stages, then its figures (compare/dvc.yaml)",
    )
    add_config_arguments(p)
    p.add_argument("arm", help="an arm of compare.arms (gla, hybrid-1in4, softmax, ...)")
    p.add_argument("--json", action="store_true", help="print the arm's figures as one JSON object")
    p = sub.add_parser(
        "compare",
        help="the architecture comparison's table, plots and MLflow runs, from every arm's figures "
        "(run the arms with `cd compare && dvc repro`)",
    )
    add_config_arguments(p)
    p.add_argument("--no-track", action="store_true", help="write the table and plots, log nothing to MLflow")
    p.add_argument("--json", action="store_true", help="print the table as one JSON object")

    p = sub.add_parser(
        "mqar-cell",
        help="the MQAR protocol, one cell: ARM at WIDTH trained at LR from SEED, then tested (compare/dvc.yaml)",
    )
    add_config_arguments(p)
    p.add_argument("arm", help="one of mqar.arms")
    p.add_argument("width", type=int, help="one of mqar.widths")
    p.add_argument("lr", type=float, help="one of mqar.lrs")
    p.add_argument("seed", type=int, help="one of mqar.seeds")
    p = sub.add_parser(
        "mqar",
        help="the MQAR protocol's summary from its cells: best rates, errors over seeds, the validity gate, "
        "the frontier (compare/mqar/protocol.json)",
    )
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    """serve: an export behind HTTP; its own options are laplace.pipeline.serve's."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions) until SIGTERM")
    add_config_arguments(p)
    serve.add_arguments(p)


def _print_info(facts: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(facts, indent=2))
        return
    c = facts["config"]
    print(f"{facts['model']}: {c['n_layers']} layers, hidden {c['d_model']}, {c['n_heads']} heads, ", end="")
    print(f"vocab {c['vocab_size']}")
    print(f"  parameters              {facts['params']:,} ({facts['params'] / 1e9:.3f} B)")
    print(
        f"  state per sequence      {facts['state_bytes_per_sequence']:,} bytes "
        f"({facts['state_bytes_per_sequence'] / 1e6:.2f} MB)"
    )
    print(
        f"  KV cache at 8,192 (bf16) {facts['kv_cache_bytes_8192']:,} bytes "
        f"({facts['kv_cache_bytes_8192'] / 1e9:.2f} GB)"
    )
    if facts["state_vs_kv_8192"] is not None:
        print(f"  KV / state              {facts['state_vs_kv_8192']:.1f}x")
    if facts.get("gdn_layers"):
        print(
            f"  Gated DeltaNet state    {facts['state_delta_bytes']:,} recurrent + "
            f"{facts['state_delta_conv_bytes']:,} short-conv bytes"
        )
    attn, gdn = facts["attn_layers"], facts.get("gdn_layers", [])
    kinds = f"{len(facts['gla_layers'])} GLA, " + (f"{len(gdn)} Gated DeltaNet {gdn}, " if gdn else "")
    print(f"  layers                  {kinds}{len(attn)} softmax attention {attn or ''}")
    print("  per sequence            state bytes + KV bytes = total")
    for n, b in facts["per_sequence"].items():
        print(
            f"    at {n:>6,} tokens      {b['state_bytes']:,} + {b['kv_bytes']:,} = {b['total_bytes']:,} "
            f"({b['total_bytes'] / 1e6:.2f} MB)"
        )


def _command_first(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`laplace --set k=v train` as `laplace train --set k=v`: the options are the command's, so a
    command named after them is moved in front of them (argparse would read k=v as the command)."""
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if not argv or not argv[0].startswith("-") or argv[0] in ("-h", "--help"):
        return argv
    first = next((i for i, token in enumerate(argv) if token in commands and not argv[i - 1] == "--set"), None)
    return argv if first is None else [argv[first], *argv[:first], *argv[first + 1 :]]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # the commands, not argparse's bare usage line
        parser.print_help()
        return INPUT_ERROR_EXIT
    args = parser.parse_args(_command_first(parser, argv))
    setup_logging()
    # no usage reports from MLflow (track, serve --model models:/...), as DVC's are off in DVC's runs
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if not sys.stderr.isatty():  # MLflow's artifact progress bars: a line per redraw in a log
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        return _run(args)
    except InputError as exc:  # bad params or data, a missed gate: exit 2, never retried
        print(f"laplace {args.command}: error: {exc}", file=sys.stderr)
        return INPUT_ERROR_EXIT
    except Failure as exc:  # a full disk, a killed worker, a server down: one line, retried by Prefect
        print(f"laplace {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_status if exc.exit_status > 0 else 1
    except KeyboardInterrupt:  # Ctrl-C outside a training job (which stops at a step boundary): one line
        print(f"laplace {args.command}: error: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT


def _run(args) -> int:
    """Dispatch by table: the commands that need no params file (a checkpoint converts and
    evaluates anywhere), then those given the loaded config; any other command is a stage."""
    if args.command == "export" and args.format == "hf":
        return _export_hf(args)
    if args.command in WITHOUT_PARAMS:
        return WITHOUT_PARAMS[args.command](args)
    cfg = load_config(args.params, args.overrides)
    return WITH_PARAMS.get(args.command, _stage)(args, cfg)


def _pipeline(args) -> int:
    """`laplace run`: the overrides into params.yaml, dvc repro, the summary."""
    from laplace.pipeline import repro
    from laplace.pipeline.params import write_params

    root = Path(args.root).resolve()
    if args.overrides:
        write_params(root / args.params, args.overrides)
    else:
        load_config(root / args.params)  # fail on bad params before DVC starts anything
    status, _ = repro.repro(root)
    if status != 0:
        print(f"laplace run: dvc repro failed with exit status {status}", file=sys.stderr)
        return status
    print(summary.as_text(summary.read(Paths.at(root)), root))
    return 0


def _import(args) -> int:
    from laplace.model.hf import import_checkpoint

    # under models/ by default: DVC hashes that directory for warmup and train (model.init)
    name = Path(str(args.src).rstrip("/")).name or Path(args.src).resolve().name
    out = Path(args.out) if args.out else Path(args.root) / "models" / name
    result = import_checkpoint(args.src, out)
    if args.json:
        print(json.dumps(result))
    else:
        m = result["model"]
        print(
            f"laplace import: {args.src} -> {out}: {result['parameters']:,} parameters, {m['n_layers']} layers, "
            f"hidden {m['d_model']}, vocab {m['vocab_size']} (train from it with --set model.init={out})"
        )
        for key in result["ignored_keys"]:  # computed as fla computes, which does not obey them
            print(f"laplace import: note: config.json {key}; imported as fla computes it")
    return 0


def _export_hf(args) -> int:
    from laplace.model.hf import export_hf

    out = Path(args.out) if args.out else Path(args.root) / "artifacts" / "export-hf"
    result = export_hf(Path(args.model) if args.model else Paths.at(args.root).export_dir, out)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"laplace export: {result['parameters']:,} parameters in the HF / fla layout -> {out}")
    return 0


def _info(args, cfg) -> int:
    _print_info(model_facts(args.preset, cfg), args.json)
    return 0


def _plan(args, cfg) -> int:
    from laplace.errors import ConfigError
    from laplace.training.plan import GIB, as_text, parse_bytes, plan

    world = args.nproc or cfg.train.nproc_per_node * cfg.train.nnodes
    if world < 1:
        raise ConfigError(f"--nproc must be >= 1, got {world}")
    t = cfg.train
    accum = args.grad_accum or t.grad_accum_steps
    micro = args.micro_batch
    if micro is None:
        micro = t.batch_size // (world * accum) if t.batch_size % (world * accum) == 0 else 1
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", micro), ("--grad-accum", accum)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    memory = args.hbm_gib if args.hbm_gib is not None else parse_bytes(args.device_memory, "--device-memory") / GIB
    result = plan(
        _model_config(args.preset, cfg),
        world,
        args.precision or t.precision,
        memory,
        seq_len=args.seq_len or t.seq_len,
        micro_batch=micro,
        grad_accum_steps=accum,
        activation_checkpoint=args.activation_checkpoint or t.activation_checkpoint,
    )
    print(json.dumps(result, indent=2) if args.json else as_text(result, _model_name(args.preset, cfg)))
    return 0


def _serve(args, cfg) -> int:
    # the address and policy default to server: here, not in serve.run, which serve-check's live
    # phase also runs (on an address and policy of its own: not serve-check's params)
    args.host = args.host or cfg.server.host
    args.port = cfg.server.port if args.port is None else args.port
    args.policy = args.policy or cfg.server.policy
    return serve.run(cfg, Paths.at(args.root), args)


def _summary(args, cfg) -> int:
    paths = Paths.at(args.root)
    info = summary.read(paths)
    if not any(info.values()):
        raise InputError(f"no pipeline run in {paths.root} yet (no metrics/*.json): run `laplace run` first")
    print(summary.as_text(info, paths.root))
    return 0


def _generate(args, cfg) -> int:
    from laplace.serving.generation import generate_text

    model_dir = Path(args.model) if args.model else Paths.at(args.root).export_dir
    if not args.model and not (model_dir / "config.json").exists():
        raise InputError(
            f"no exported model in {model_dir} yet: run `laplace run` (the whole pipeline), or "
            "`laplace train` then `laplace export`; or pass --model DIR"
        )
    g = cfg.generate
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else g.max_new_tokens
    result = generate_text(
        model_dir,
        args.prompt if args.prompt is not None else g.prompt,
        max_new_tokens,
        args.temperature if args.temperature is not None else g.temperature,
        args.top_p if args.top_p is not None else g.top_p,
        args.seed if args.seed is not None else g.seed,
        engine=cfg.engine,
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(result["prompt"] + result["completion"])
    if not result["completion"].strip():  # say why, rather than print the prompt alone
        why = (
            f"the model sampled end-of-text after {result['new_tokens']} token(s)"
            if result["new_tokens"] < max_new_tokens
            else f"its {result['new_tokens']} tokens decode to whitespace"
        )
        print(
            f"laplace generate: no text generated: {why}; try another --seed, or --temperature 0 (greedy)",
            file=sys.stderr,
        )
    return 0


def _stage(args, cfg) -> int:
    """`laplace <stage>`: the stage's run, then one line of outcome (the figures are in its
    metrics file, or MLflow for track)."""
    paths = Paths.at(args.root)
    stage = stages.STAGES[args.command]
    options = {"resume": not args.no_resume} if args.command == "train" else {}
    result = stage.run(cfg, paths, **options)
    if args.json:
        print(json.dumps(result, default=str))
        return 0
    where = paths.metrics_file(stage.metrics) if stage.metrics else paths.tracking_file
    line = summary.stage_line(stage.metrics, result, paths.root)
    print(f"laplace {args.command}: {line} ({where.relative_to(paths.root)})")
    return 0


def _compare(args, cfg, paths: Paths) -> int:
    from laplace.pipeline import compare, compare_table

    compare.check_arms(cfg)  # every arm's config, before any work
    if args.command == "compare-arm":
        result = compare.run_arm(cfg, paths, args.arm)
        if args.json:
            print(json.dumps(result, default=str))
        else:
            where = compare.arm_paths(paths, args.arm).metrics_dir.relative_to(paths.root)
            print(f"laplace compare-arm: {args.arm} measured ({where})")
        return 0
    table = compare_table.run_table(cfg, paths, track=not args.no_track)
    text = compare_table.format_table(table, cfg.compare.table_contexts)
    print(json.dumps(table, default=str) if args.json else text)
    return 0


def _mqar(args, cfg, paths: Paths) -> int:
    from laplace.pipeline import compare_mqar

    if args.command == "mqar-cell":  # run_cell and run_protocol check the protocol before any work
        r = compare_mqar.run_cell(cfg, paths, args.arm, args.width, args.lr, args.seed)
        cells = ", ".join(f"{p} pairs@{c}: {v:.3f}" for c, row in r["accuracy"].items() for p, v in row.items())
        print(f"laplace mqar-cell: {r['model']} lr {args.lr:g} seed {args.seed}: {cells} ({r['train_seconds']:.0f} s)")
        return 0
    result = compare_mqar.run_protocol(cfg, paths)
    print(json.dumps(result, default=str) if args.json else compare_mqar.format_protocol(result))
    return 0


def _eval(args, paths: Paths) -> int:
    from laplace.errors import ConfigError
    from laplace.fileio import atomic_write_bytes

    try:
        from laplace.evals import harness
    except ImportError as exc:
        raise ConfigError(f"lm-eval is not installed ({exc.name}): pip install 'laplace[eval]'") from exc
    model_args = {}
    for item in filter(None, args.model_args.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--model-args: expected k=v, got {item!r}")
        model_args[key.strip()] = value.strip()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    results = harness.evaluate(
        Path(args.model) if args.model else paths.export_dir, tasks, args.include_path, args.limit, model_args
    )
    text = harness.results_json(results)
    if args.output:
        atomic_write_bytes(Path(args.output), (text + "\n").encode())
    if args.json:
        print(text)
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
    return 0


# The commands that need no params file, and those run with the loaded config (any other is a stage).
WITHOUT_PARAMS = {"run": _pipeline, "import": _import, "eval": lambda args: _eval(args, Paths.at(args.root))}
WITH_PARAMS = {
    "info": _info,
    "plan": _plan,
    "serve": _serve,
    "summary": _summary,
    "generate": _generate,
    "compare-arm": lambda args, cfg: _compare(args, cfg, Paths.at(args.root)),
    "compare": lambda args, cfg: _compare(args, cfg, Paths.at(args.root)),
    "mqar-cell": lambda args, cfg: _mqar(args, cfg, Paths.at(args.root)),
    "mqar": lambda args, cfg: _mqar(args, cfg, Paths.at(args.root)),
}


if __name__ == "__main__":
    sys.exit(main())
