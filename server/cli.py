"""The `duet` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def run_server(app, settings) -> None:
    """uvicorn with duet's connection limits and shutdown (server/uvicorn_server.py)."""
    from .uvicorn_server import build_server

    build_server(app, settings).run()


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from engines import crash_stacks
    from engines.models.config import ConfigError

    from .app import create_app
    from .auth import exposure_warning
    from .settings import Settings

    overrides = {
        k: v for k, v in {
            "host": args.host, "port": args.port, "models_file": args.config,
            "model": args.model, "engine": args.engine, "device": args.device,
            "compile": args.compile, "mps_memory_fraction": args.mps_memory_fraction,
            "api_keys": args.api_key, "api_key_file": args.api_key_file,
            "cors_origins": args.cors_origin, "max_body_bytes": args.max_body_bytes,
            "max_queue": args.max_queue, "request_timeout_s": args.request_timeout,
            "max_batch": args.max_batch, "max_prefill_tokens": args.max_prefill_tokens,
            "kv_cache_memory": args.kv_cache_memory, "engine_process": args.engine_process,
            "tensor_parallel": args.tensor_parallel,
            "prefix_cache": args.prefix_cache, "keep_alive": args.keep_alive,
            "max_loaded_models": args.max_loaded_models, "memory_budget": args.memory_budget,
            "shutdown_timeout_s": args.shutdown_timeout, "max_connections": args.max_connections,
            "header_timeout_s": args.header_timeout, "body_timeout_s": args.body_timeout,
            "keep_alive_timeout_s": args.keep_alive_timeout,
        }.items() if v is not None
    }
    if args.mps_fallback:
        overrides["mps_fallback"] = True
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"duet: {exc}", file=sys.stderr)
        return 2
    if settings.mps_fallback:
        # torch reads this when it is first imported, which happens only when an engine loads.
        os.environ["PYTORCH_ENABLE_MPS_FALLBACK"] = "1"
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = create_app(settings)
        warning = exposure_warning(settings.host, bool(settings.accepted_api_keys()))
    except (ConfigError, ValueError) as exc:
        print(f"duet: {exc}", file=sys.stderr)
        return 2
    if warning:
        print(warning, file=sys.stderr, flush=True)
    crash_stacks.enable()
    run_server(app, settings)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    """Convert/locate a model's files now rather than on first start (used by the Docker image)."""
    from engines.models.config import ConfigError, load_models_file
    from engines.models.sources import ModelSourceError, resolve_model_dir

    from .registry import default_model_id
    from .settings import Settings

    settings = Settings(**({"models_file": args.config} if args.config else {}))
    try:
        specs = load_models_file(settings.models_file)
        spec = next(s for s in specs if s.id == default_model_id(specs, args.model))
        print(resolve_model_dir(spec))
    except (ConfigError, ModelSourceError, ValueError) as exc:
        print(f"duet: {exc}", file=sys.stderr)
        return 2
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench_report import run_from_cli

    return run_from_cli(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duet", description="A local OpenAI-compatible LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI API")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--config", help="model registry file (default: the repository's models.toml)")
    serve.add_argument("--model", help="model id to load at start-up (default: the first one)")
    serve.add_argument("--engine", choices=["auto", "torch", "mlx"], help="engine for that model")
    serve.add_argument("--device", help="torch device: auto, cpu, cuda or mps")
    serve.add_argument("--compile", choices=["auto", "on", "off"],
                       help="torch engine: compile the decode step (auto: on CUDA)")
    serve.add_argument("--mps-memory-fraction", type=float,
                       help="torch engine on MPS: cap memory (torch.mps.set_per_process_memory_fraction)")
    serve.add_argument("--mps-fallback", action="store_true",
                       help="run ops without an MPS kernel on the CPU (PYTORCH_ENABLE_MPS_FALLBACK=1)")
    serve.add_argument("--api-key", action="append", metavar="KEY",
                       help="accept this Bearer key (repeatable; also DUET_API_KEY, DUET_API_KEYS)")
    serve.add_argument("--api-key-file", metavar="FILE",
                       help="accept the keys in FILE, one per line")
    serve.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                       help="allow this browser origin (repeatable; '*' for any; default: CORS off)")
    serve.add_argument("--max-body-bytes", type=int, help="largest request body (default 1 MiB)")
    serve.add_argument("--max-queue", type=int,
                       help="requests that may wait per engine beyond its running batch "
                       "(default: as many as the batch, at least 32); more get 429")
    serve.add_argument("--tensor-parallel", type=int, metavar="N",
                       help="torch engine: split a model over N GPUs (tensor parallelism; "
                       "default 1); for models larger than one GPU, or faster decoding")
    serve.add_argument("--max-batch", type=int,
                       help="sequences an engine decodes at once (default 32; on CUDA as "
                       "many as the KV cache holds 2048-token sequences for, 32 to 128)")
    serve.add_argument("--max-prefill-tokens", type=int,
                       help="prompt tokens prefilled per step, long prompts in chunks between "
                       "decode steps (default 2048 on CUDA, 512 elsewhere)")
    serve.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                       default=None, help="prefill every prompt whole: no reuse of the KV of "
                       "earlier prompts (default: reused)")
    serve.add_argument("--kv-cache-memory", metavar="SIZE",
                       help="KV cache per engine, e.g. 4GiB (default: max-batch full contexts, "
                       "at most half the free memory; on CUDA 80%% of it)")
    serve.add_argument("--keep-alive", metavar="DURATION",
                       help="how long a model stays loaded after a request (30s, 5m, 1h30m; "
                       "0: unloaded after each; default -1: kept); a model's keep_alive in "
                       "models.toml and a request's keep_alive override it")
    serve.add_argument("--memory-budget", metavar="SIZE",
                       help="memory the weights and KV caches of all loaded models share, e.g. "
                       "20GiB (default: 90%% of a CUDA GPU, 75%% of the RAM elsewhere)")
    serve.add_argument("--max-loaded-models", type=int, metavar="N",
                       help="engines loaded at once at most; loading another unloads the least "
                       "recently used idle one (default: no bound)")
    serve.add_argument("--engine-process", choices=["auto", "on", "off"],
                       help="run each generating engine in a process of its own, so the HTTP "
                       "side never holds up its steps (default auto: on CUDA)")
    serve.add_argument("--request-timeout", type=float, metavar="SECONDS",
                       help="time limit of one generation, queueing included (default 600)")
    serve.add_argument("--shutdown-timeout", type=float, metavar="SECONDS",
                       help="on SIGTERM, time in-flight requests get to finish (default 10)")
    serve.add_argument("--max-connections", type=int,
                       help="open connections at most (default 512); more are refused with 503")
    serve.add_argument("--header-timeout", type=float, metavar="SECONDS",
                       help="time a client has to send a request's headers (default 10)")
    serve.add_argument("--body-timeout", type=float, metavar="SECONDS",
                       help="time a client has to send a request's body (default 30)")
    serve.add_argument("--keep-alive-timeout", type=float, metavar="SECONDS",
                       help="idle keep-alive connections are closed after this long (default 5)")
    prepare = sub.add_parser("prepare", help="convert a model into the cache and print its path")
    prepare.add_argument("--config", help="model registry file")
    prepare.add_argument("--model", help="model id (default: the first one)")
    bench = sub.add_parser(
        "bench", help="compare the engines (and references) on the same prompts",
        description="Runs the same prompts greedily through each engine, prints medians and p90, "
                    "writes JSON, a markdown table and a PNG chart.")
    bench.add_argument("--url", help="a running duet server (default: load the engines in-process)")
    bench.add_argument("--model", help="model id (default: the first in models.toml)")
    bench.add_argument("--engines", help="comma-separated, e.g. torch,mlx (default: all installed)")
    bench.add_argument("--references", help="comma-separated: transformers, mlx-lm")
    bench.add_argument("--preset", choices=["short", "long", "chat"], help="prompt set (default short)")
    bench.add_argument("--prompt", action="append", help="a raw text prompt (repeatable); replaces the preset")
    bench.add_argument("--max-tokens", type=int, help="tokens per run (default 64)")
    bench.add_argument("--repeats", type=int, help="measured runs per prompt (default 3)")
    bench.add_argument("--warmup", type=int, help="warm-up runs per engine (default 1)")
    bench.add_argument("--clients", help="load mode, with --url: client counts, e.g. 1,4,16; "
                                         "each level's clients stream through the server at once")
    bench.add_argument("--config", help="in-process: model registry file")
    bench.add_argument("--device", help="in-process: torch device (auto, cpu, cuda, mps)")
    bench.add_argument("--out", default="bench-results", help="directory for JSON, markdown and PNG")
    bench.add_argument("--name", help="file name stem (default: model and time)")
    bench.add_argument("--md-section", help="also write the markdown into a marked section of this file")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])[1:]
    return {"serve": _serve, "prepare": _prepare, "bench": _bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
