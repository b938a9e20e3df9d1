"""`laplace serve`: load a model (an export directory or a registered MLflow model), start from
the warmup stage's compile cache, and serve it over HTTP until SIGTERM (laplace.serving.server).

`python -m laplace.pipeline.serve` takes the same arguments, with --host, --port and --policy
required; serve-check's live phase (ServerProcess) starts the server that way, in a new process.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from laplace.config import Config
from laplace.errors import InputError
from laplace.pipeline.layout import Paths
from laplace.pipeline.logs import setup_logging

log = logging.getLogger("laplace.serve")

REGISTRY_SCHEMES = ("models:/", "runs:/")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="an export directory, or a registered model such as models:/laplace-gla@champion "
        "(default: artifacts/export)",
    )
    p.add_argument("--host", default=None, help="address to listen on (default: server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: server.port)")
    p.add_argument(
        "--policy", choices=("padded", "exact", "eager"), default=None, help="default: server.policy (padded)"
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        help="the warmup compile cache to start from (default: artifacts/warmup/compile-cache); it is copied, "
        "never written",
    )


def export_dir_of(model: str | None, paths: Paths, scratch: Path) -> Path:
    """The export directory to serve: a path, or a registered model downloaded from MLflow."""
    if model is None:
        return paths.export_dir
    if model.startswith(REGISTRY_SCHEMES):
        from laplace.tracking.mlflow_model import download_export
        from laplace.tracking.store import tracking_uri

        uri = tracking_uri(paths.root)
        if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
            # nothing tracked yet: say what to run, and do not let MLflow create an empty store
            raise InputError(
                f"--model {model}: nothing is tracked yet (no {uri.removeprefix('sqlite:///')}); run `laplace run` "
                "first, which trains, tracks and registers the model"
            )
        return download_export(model, uri, scratch / "registered")
    path = Path(model)
    if not (path / "config.json").is_file():
        raise InputError(f"--model {model}: not an export directory (no config.json) nor a models:/ URI")
    return path


def use_compile_cache(cache: Path | None, scratch: Path, policy: str) -> Path | None:
    """Point this process's compile cache at a copy of `cache` (the artifact stays untouched), or,
    without one, at an empty scratch directory of its own: a server never compiles into the user's
    shared default Inductor cache (/tmp/torchinductor_USER), which other processes read."""
    from laplace.pipeline.workers import CACHE_ENV

    if policy == "eager":
        return None
    copy = scratch / "compile-cache"
    if cache is None or not cache.is_dir():
        log.warning(
            "no warmup compile cache at %s (run `laplace warmup`): every graph compiles at startup, into a "
            "scratch cache of this server's own",
            cache,
        )
        copy.mkdir()
        for name in CACHE_ENV:
            os.environ[name] = str(copy)
        return None
    shutil.copytree(cache, copy)
    for name in CACHE_ENV:
        os.environ[name] = str(copy)
    return copy


def run(cfg: Config, paths: Paths, args: argparse.Namespace) -> int:
    """Serve until SIGTERM on `args.host`, `args.port` and `args.policy` (given: `laplace serve`
    defaults them from `server:`, serve-check's live phase picks its own, so they are not its
    params); the exit status (0 after a graceful drain, 1 when the port is busy or warmup failed)."""
    from laplace.serving.listen import PortInUse, bind_socket

    try:  # first of all, before torch is imported: a busy port fails now, not after loading and compiling
        sock = bind_socket(args.host, args.port)
    except PortInUse as exc:
        print(f"laplace serve: error: {exc.strerror} (is another server running? pick another --port)", file=sys.stderr)
        return 1
    from laplace.runtime import resolve_device
    from laplace.serving.engine import DecodeEngine
    from laplace.serving.server import serve, warmup_interrupted
    from laplace.serving.warmup import apply_compile_settings, settings_mismatch

    settings = apply_compile_settings(cfg.server.threads)  # as warmup compiled: the thread count is in the cache key
    policy = args.policy
    with tempfile.TemporaryDirectory(prefix="laplace-serve-") as tmp:
        scratch = Path(tmp)
        export_dir = export_dir_of(args.model, paths, scratch)
        cache = Path(args.compile_cache) if args.compile_cache else paths.warmup_cache
        if use_compile_cache(cache, scratch, policy) is not None and (why := settings_mismatch(cache, settings)):
            log.warning(why)
        device = resolve_device(cfg.engine.device)
        engine, tokenizer, config = DecodeEngine.from_export(
            export_dir, cfg.engine, policy, device=device, kernel=cfg.model.kernel
        )
        log.info(
            "serving %s (%s parameters) on %s, policy %s, as %r",
            args.model or export_dir,
            f"{config['parameters']:,}",
            device,
            policy,
            cfg.tracking.model_name,
        )
        status = serve(
            engine,
            tokenizer,
            config.get("eos_id"),
            host=args.host,
            port=args.port,
            model_name=cfg.tracking.model_name,
            max_tokens_limit=cfg.server.max_new_tokens,
            shutdown_grace_s=cfg.server.shutdown_grace_s,
            max_request_bytes=cfg.server.max_request_bytes,
            max_stop_chars=cfg.server.max_stop_chars,
            sock=sock,
            chat_template=config.get("chat_template"),
            special_tokens=special_token_strings(tokenizer, config),
        )
    if warmup_interrupted.is_set():
        # A signal during warmup: the abandoned compile's thread (a daemon, mid Dynamo trace) and
        # Inductor's compile pools would hold the interpreter's exit for seconds; the scratch
        # directory is already gone and the log is flushed, so nothing is lost by leaving now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def special_token_strings(tokenizer, config: dict) -> dict[str, str]:
    """bos_token / eos_token as text, for the chat template (transformers passes its special tokens map)."""
    out = {}
    for key, token_id in (("bos_token", config.get("bos_id")), ("eos_token", config.get("eos_id"))):
        if token_id is not None and (token := tokenizer.id_to_token(token_id)) is not None:
            out[key] = token
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`laplace serve` in a child process (`python -m laplace.pipeline.serve`), as a context manager:
    started on a free loopback port, ready once GET /health answers 200, stopped with SIGTERM
    (a graceful drain) and killed only if it outlives the grace period by a minute."""

    def __init__(
        self,
        cfg: Config,
        *,
        model: Path | str,
        policy: str,
        compile_cache: Path | None = None,
        root: Path | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        echo: Callable[[str], None] | None = None,
        extra_args: list[str] | None = None,
    ):
        self.cfg, self.model, self.policy, self.compile_cache = cfg, model, policy, compile_cache
        self.root = Path(root) if root else Path.cwd()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env, self.echo, self.extra_args = env, echo, extra_args or []
        self.lines: deque[str] = deque(maxlen=2000)
        self.proc: subprocess.Popen | None = None
        self.exit_status: int | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._reader: threading.Thread | None = None

    def command(self, params_file: Path) -> list[str]:
        cmd = [sys.executable, "-m", "laplace.pipeline.serve", "--params", str(params_file), "--root", str(self.root)]
        cmd += ["--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port), "--policy", self.policy]
        if self.compile_cache is not None:
            cmd += ["--compile-cache", str(self.compile_cache)]
        return cmd + self.extra_args

    def start(self) -> ServerProcess:
        from laplace.pipeline.params import dump_yaml
        from laplace.pipeline.repro import subprocess_env

        self._tmp = tempfile.TemporaryDirectory(prefix="laplace-serve-params-")
        params_file = Path(self._tmp.name) / "params.yaml"
        params_file.write_text(dump_yaml(self.cfg.to_dict()))
        self.proc = subprocess.Popen(
            self.command(params_file),
            cwd=self.root,
            env=self.env or subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if self.echo:
                self.echo(line)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until GET /health answered 200; raises if the server exits or takes too long."""
        import httpx

        started = time.perf_counter()
        while time.perf_counter() - started < timeout_s:
            if self.proc.poll() is not None:
                self._reader.join(5)
                tail = "\n".join(list(self.lines)[-15:])
                raise RuntimeError(
                    f"laplace serve exited with status {self.proc.returncode} before it was ready:\n{tail}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"laplace serve was not ready after {timeout_s:.0f}s ({self.url}/health)")

    def stop(self, grace_s: float | None = None) -> int:
        """SIGTERM, then wait for the drain; the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=(self.cfg.server.shutdown_grace_s if grace_s is None else grace_s) + 60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self.exit_status = self.proc.returncode
        return self.exit_status

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m laplace.pipeline.serve`: `laplace serve` without the rest of the CLI."""
    from laplace.errors import INPUT_ERROR_EXIT
    from laplace.pipeline.params import add_config_arguments, load_config

    parser = argparse.ArgumentParser(prog="laplace serve", description=__doc__)
    add_config_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if None in (args.host, args.port, args.policy):  # the child of ServerProcess, which gives all three
        parser.error("--host, --port and --policy are required here (`laplace serve` defaults them from server:)")
    setup_logging()
    try:
        return run(load_config(args.params, args.overrides), Paths.at(args.root), args)
    except InputError as exc:
        print(f"laplace serve: error: {exc}", file=sys.stderr)
        return INPUT_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
