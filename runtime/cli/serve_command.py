"""``serve``: an OpenAI-compatible HTTP server with per-request adapters (needs the ``serve`` extra)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from runtime.cli.options import add_compile_mode, add_weight_cache_dir, weight_cache_settings
from runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from runtime.util.native_logs import print_to_stderr

API_KEY_VARIABLE = "RUNTIME_API_KEY"
SWITCH_INTERVAL_S = 0.0005


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Registers the ``serve`` sub-command."""
    parser = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API, with per-request adapters",
        description="Serves /v1/completions, /v1/chat/completions (streaming too), /v1/models[/ID], "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter, /v1/adapter_files, /tokenize, /detokenize, /tokenizer_info, "
        "/health, /metrics, and a chat page at /. A request's model "
        "is the base model's name, an adapter's name, or BASE::ADAPTER; its 'lora' field "
        "([{\"name\", \"scale\"}]) blends adapters. Needs: pip install 'runtime[serve]'.",
    )
    parser.add_argument("--model", type=Path, required=True, help="a .tflite model or .litertlm bundle")
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument("--tokenizer", type=Path, help="a tokenizer.json or SentencePiece model")
    tokens.add_argument("--byte-tokens", action="store_true", help="UTF-8 bytes are the tokens")
    parser.add_argument("--stop-token", type=int, action="append", default=None,
                        help="with --byte-tokens: a byte that ends an answer (e.g. 10, a newline); repeatable")
    parser.add_argument("--chat-template", type=Path,
                        help="a Jinja2 chat template file for /v1/chat/completions (else the bundle's)")
    parser.add_argument("--adapters", type=Path, metavar="DIR",
                        help="registers every adapter in DIR by file or directory name; loads over HTTP go here")
    parser.add_argument("--served-model-name", help="the base model's id in requests (default: the file's stem)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_VARIABLE),
                        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                        f"(default: ${API_KEY_VARIABLE})")
    parser.add_argument("--allowed-hosts", nargs="+", metavar="HOST[:PORT]",
                        help="Host headers answered (against DNS rebinding); '*': any (default: the loopback "
                        "names localhost, 127.0.0.1, ::1 when --host is a loopback address, else any)")
    parser.add_argument("--max-concurrent", type=int, default=16, help="generations running at once (each prompt x "
                        "choice of a request); a request past it gets 429, one asking more on its own 400 (default: 16)")
    parser.add_argument("--max-prompts", type=int, default=64, help="prompts in one /v1/completions request's "
                        "list; more get 400, as do more prompts x choices than --max-concurrent (default: 64)")
    parser.add_argument("--score-by-decode", action="store_true",
                        help="answer echo (a prompt's logprobs, what lm-eval's loglikelihood asks) on a model whose "
                        "prefill returns no logits and that has no score signatures with one decode step per prompt "
                        "token (slow on a real model: export it with --score-lengths instead); without it such "
                        "requests get 400")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413 "
                        "(default: 1 MiB)")
    parser.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="a request's head, and then its body, must arrive within it (default: 10)")
    parser.add_argument("--idle-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="an idle keep-alive connection is closed after it (default: 5)")
    parser.add_argument("--strict-adapters", action="store_true",
                        help="stop at start if an adapter in --adapters DIR cannot be registered "
                        "(default: skip it, with a warning line, and list it in /v1/models)")
    parser.add_argument("--no-draft-heads", action="store_true",
                        help="register Turbo LoRA adapters without their draft heads (plain decoding; also what a "
                        "model exported without --verify-lengths needs)")
    parser.add_argument("--allow-download-from", nargs="+", default=[], metavar="HOST[:PORT]",
                        help="hosts /v1/load_lora_adapter may download a url from (default: none); a loopback "
                        "or private address is reached only if that address itself is listed")
    parser.add_argument("--max-download-bytes", type=int, default=256 << 20,
                        help="cap on an adapter downloaded by /v1/load_lora_adapter with a url (default: 256 MiB)")
    parser.add_argument("--download-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="time limit of one whole download (default: 60)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per executor")
    add_weight_cache_dir(parser)
    add_compile_mode(parser)
    parser.add_argument("--executors", type=int, default=1,
                        help="copies of the model running sessions in parallel (each costs the model's memory)")
    parser.add_argument("--prefix-cache-mb", type=float, default=64.0,
                        help="memory for the KV rows of recent prompts per adapter: a prompt beginning like a "
                        "cached one (a chat template's system prompt, earlier turns) prefills only the rest "
                        "(default: 64; 0: off)")
    cluster = parser.add_argument_group("replicas (needs the cluster extra: pip install -e \".[cluster]\")")
    cluster.add_argument("--replicas", type=int, metavar="N",
                         help="run N engine replicas on Ray Serve behind this server, each request sent to a replica "
                         "already holding its adapters (default: one engine in this process)")
    cluster.add_argument("--ray-address", metavar="HOST:PORT",
                         help="with --replicas: join this Ray cluster (default: start a local Ray, stopped with the "
                         "server)")
    cluster.add_argument("--max-adapters-per-replica", type=int, metavar="K",
                         help="with --replicas: adapter sets one replica holds, the least recently used let go "
                         "beyond it (default: 8)")
    cluster.add_argument("--replica-timeout", type=float, metavar="SECONDS",
                         help="with --replicas: a request whose replica sends nothing of its answer (no token, not its "
                         "end) for this long, or that no replica takes, ends with a 503 naming the replica "
                         "(default: 60; 0: wait forever)")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Loads the model and the adapters, binds the address, serves until interrupted."""
    try:  # the serve extra, checked before anything starts
        import uvicorn  # noqa: F401

        from runtime.serve.app import ServeSettings
        from runtime.serve.download import DownloadPolicy
        from runtime.serve.hosts import LOOPBACK_NAMES, HostPort, is_loopback
    except ImportError as exc:
        raise FailedPreconditionError(
            f"serve needs the serve extra ({exc.name} is missing): pip install 'runtime[serve]'"
        ) from None
    from runtime import ByteTokenizer, EngineSettings

    if args.stop_token and not args.byte_tokens:
        raise InvalidArgumentError("--stop-token goes with --byte-tokens (a tokenizer brings its own stop tokens)")
    if args.allowed_hosts is not None:
        hosts = None if "*" in args.allowed_hosts else args.allowed_hosts
    else:
        hosts = LOOPBACK_NAMES if is_loopback(args.host) else None
    settings = ServeSettings(
        model_name=args.served_model_name or args.model.stem,
        api_key=args.api_key,
        max_concurrent=args.max_concurrent,
        max_body_bytes=args.max_body_bytes,
        allowed_hosts=None if hosts is None else tuple(HostPort.parse(h, "--allowed-hosts") for h in hosts),
        header_timeout_s=args.header_timeout,
        idle_timeout_s=args.idle_timeout,
        max_prompts=args.max_prompts,
        score_by_decode=args.score_by_decode,
    )
    downloads = DownloadPolicy.of(args.allow_download_from, args.max_download_bytes, args.download_timeout)
    tokenizer = ByteTokenizer(stop_token_ids=args.stop_token or ()) if args.byte_tokens else args.tokenizer
    chat_template = _read_template(args.chat_template) if args.chat_template is not None else None
    if not 0 <= args.prefix_cache_mb < 1 << 40:  # NaN and infinity too
        raise InvalidArgumentError(f"--prefix-cache-mb {args.prefix_cache_mb}: expected 0 or more")
    engine_settings = EngineSettings(num_threads=args.threads, executors=args.executors,
                                     prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
                                     compile=args.compile, **weight_cache_settings(args))
    options = _cluster_options(args, settings)
    from runtime import Engine

    # What one process checks (the model, the tokenizer, the port) is checked before Ray starts.
    with Engine(args.model, engine_settings, tokenizer=tokenizer, chat_template=chat_template) as engine:
        listener = _bind(args.host, args.port)
        try:
            cluster = _start_cluster(args, options, engine_settings)
            try:
                return _serve(args, settings, engine, listener, downloads, cluster)
            finally:
                if cluster is not None:
                    cluster.stop()
        finally:
            listener.close()


def _serve(args, settings, engine, listener, downloads, cluster) -> int:
    import uvicorn

    from runtime.serve.app import create_app
    from runtime.serve.catalog import AdapterCatalog
    from runtime.serve.connection import uvicorn_config
    from runtime.serve.hosts import is_loopback

    catalog = (cluster.catalog if cluster is not None else AdapterCatalog)(
        engine, args.adapters, reserved_names=[settings.model_name], downloads=downloads,
        draft_heads=not args.no_draft_heads)
    entries = catalog.scan(strict=args.strict_adapters)
    for skipped in catalog.skipped:
        print_to_stderr(f"warning: skipped adapter {skipped.file}: {skipped.reason}")
    app = create_app(engine, catalog, settings, extend=cluster.extend if cluster is not None else None)
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {settings.model_name} at http://{shown}:{port}/v1 "
          f"({len(entries)} adapters: {', '.join(e.name for e in entries) or 'none'}; "
          f"{'chat template' if engine.chat_template else 'no chat template'}; "
          f"{'API key required' if settings.api_key else 'no API key'}"
          f"{f'; {args.replicas} replicas' if cluster is not None else ''})", flush=True)
    if settings.api_key is None and not is_loopback(host):
        print_to_stderr(f"warning: listening on {host} without --api-key: anyone who can reach it can use it")
    # The event loop sends each token as soon as it gets the GIL from the threads that
    # generate; with the default 5 ms switch interval tokens would leave in bursts.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    config = uvicorn_config(app, settings, log_level=args.log_level,
                            access_log=args.log_level in ("info", "debug"), timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[listener])
    except KeyboardInterrupt:
        pass  # uvicorn shut down gracefully, then re-raised the Ctrl-C it had caught
    return 0


def _cluster_options(args: argparse.Namespace, settings):
    """With ``--replicas``: the cluster's options, checked (and the extra's presence) before
    anything starts; else ``None``, refusing the options that need ``--replicas``."""
    max_adapters = args.max_adapters_per_replica
    if args.replicas is None:
        for flag, value in (("--ray-address", args.ray_address), ("--max-adapters-per-replica", max_adapters),
                            ("--replica-timeout", args.replica_timeout)):
            if value is not None:
                raise InvalidArgumentError(f"{flag} goes with --replicas N")
        return None
    from runtime.serve.cluster import import_ray
    from runtime.serve.cluster.launch import ClusterOptions, available_cpus, check_reachable

    given = {"max_adapters": max_adapters, "replica_timeout": args.replica_timeout}
    options = ClusterOptions(args.replicas, args.ray_address, max_ongoing=settings.max_concurrent,
                             threads=args.threads, executors=args.executors,
                             **{key: value for key, value in given.items() if value is not None})
    if args.ray_address is not None:
        check_reachable(args.ray_address)
    else:  # a local Ray: the replicas must fit on this machine
        options.check_fits(available_cpus())
    import_ray()  # one line naming the extra if it is missing
    return options


def _start_cluster(args: argparse.Namespace, options, engine_settings):
    """With ``options`` (``--replicas``): Ray (joined or started) and the engine replicas,
    ready; else ``None``."""
    if options is None:
        return None
    from runtime.serve.cluster.launch import Cluster
    from runtime.serve.cluster.replica import ReplicaConfig

    config = ReplicaConfig(str(args.model.resolve()), engine_settings,
                           tokenizer=None if args.tokenizer is None else str(args.tokenizer.resolve()),
                           byte_tokens=args.byte_tokens, stop_tokens=tuple(args.stop_token or ()),
                           draft_heads=not args.no_draft_heads)
    print(f"starting {args.replicas} replicas on "
          f"{f'the Ray cluster at {args.ray_address}' if args.ray_address else 'a local Ray'}", flush=True)
    return Cluster.start(options, config)


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NotFoundError(f"{path}: no such chat template file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"{path}: cannot read the chat template: {exc}") from None


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port < 65536:
        raise InvalidArgumentError(f"--port {port}: expected 0-65535")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)  # connections wait in the backlog until the server runs
    except OSError as exc:
        raise FailedPreconditionError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    listener.set_inheritable(True)
    return listener
