"""`mini-transformer serve`: the OpenAI-compatible HTTP server (and its live page) on the engine."""

from __future__ import annotations

import sys

from .options import add_model_options, load_model


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (and a live page at /) on the engine")
    p.add_argument("--checkpoint", required=True, help="our checkpoint dir or a Hugging Face GPT-2/Llama dir")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes and /metrics (`ps` shows "
                   "it: prefer --api-key-file or MINI_TRANSFORMER_API_KEY)")
    p.add_argument("--api-key-file", metavar="PATH", help="read the api key from this file")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME", help="Host header names answered "
                   "besides localhost, 127.0.0.1, [::1] and --host (e.g. the DNS name clients use)")
    p.add_argument("--model-name", help="the model id clients send (default: the checkpoint directory's name)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--kv-cache-bytes", type=int, help="memory for the KV block pool (default: the engine's)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued beyond that before 429")
    p.add_argument("--kv-store", metavar="URL", help="share KV blocks with other replicas in Redis, e.g. "
                   "redis://127.0.0.1:6379, redis://USER@HOST:PORT/DB, rediss:// for TLS; the password from "
                   "MINI_TRANSFORMER_REDIS_PASSWORD (see docs/11-kv-store.md)")
    p.add_argument("--kv-store-secret-file", metavar="PATH", help="the secret the replicas sign store entries "
                   "with (or MINI_TRANSFORMER_KV_STORE_SECRET); without one they are not signed")
    p.add_argument("--host-kv-bytes", type=int, metavar="N", help="keep up to N bytes of KV blocks in host "
                   "memory behind the pool (an LRU tier in front of --kv-store)")
    p.add_argument("--kv-events-endpoint", metavar="URL", help="publish the prefix cache's changes (vLLM's KV "
                   "events: msgpack over a ZeroMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557) for "
                   "vllm-router --policy kv_aware --kv-event-source http://THIS_SERVER=URL; off by default")
    p.add_argument("--kv-events-replay-endpoint", metavar="URL", help="also answer requests for missed event "
                   "batches on a ZeroMQ ROUTER socket bound here (vllm-router --kv-event-replay-source)")
    p.add_argument("--kv-events-topic", default="", help="the topic frame of each event message (default empty)")
    _add_kv_role_options(p)
    p.add_argument("--device", default="cpu")
    add_model_options(p)
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false", help="skip the dummy requests "
                   "stepped before the server reports ready (they compile the CPU decode attention)")
    _add_limit_options(p)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=_run_serve)


def _add_kv_role_options(p) -> None:
    """One side of prefill/decode disaggregation behind `vllm-router --vllm-pd-disaggregation`
    (server/kv_transfer.py); the KV moves through --kv-store."""
    p.add_argument("--kv-role", choices=("producer", "consumer"), help="producer: a prefill server, answers "
                   "once the prompt's KV blocks are in --kv-store; consumer: a decode server, loads them from there")
    p.add_argument("--kv-load-timeout", type=float, default=1.0, metavar="SECONDS", help="how long a consumer "
                   "waits for a producer's blocks still in flight before it recomputes them")


def _add_limit_options(p) -> None:
    """What one request may cost before it is refused with a 400 naming the limit (server/limits.py)."""
    p.add_argument("--max-body-bytes", type=int, default=2 * 2**20, help="largest request body")
    p.add_argument("--max-prompt-bytes", type=int, default=2**20, help="largest prompt text, before tokenising")
    p.add_argument("--max-schema-bytes", type=int, default=64 * 2**10,
                   help="largest structured-output constraint (JSON schema, regex, grammar, choices)")
    p.add_argument("--max-schema-depth", type=int, default=64, help="deepest nesting of a JSON schema")
    p.add_argument("--max-guided-choices", type=int, default=1024, help="most options of a guided_choice")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a constraint still compiling after this is refused")


def _limits(args):
    from ..server.limits import Limits

    return Limits(max_body_bytes=args.max_body_bytes, max_prompt_bytes=args.max_prompt_bytes,
                  max_schema_bytes=args.max_schema_bytes, max_schema_depth=args.max_schema_depth,
                  max_guided_choices=args.max_guided_choices, grammar_compile_timeout_s=args.grammar_compile_timeout)


def _kv_events(args) -> dict | None:
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    return {"endpoint": args.kv_events_endpoint, "replay_endpoint": args.kv_events_replay_endpoint,
            "topic": args.kv_events_topic}


def _run_serve(args) -> None:
    from .._checks import integer
    from ..checkpoint import resolve_checkpoint_dir
    from ..engine.config import EngineConfig
    from ..server import build_context, serve
    from ..server.run import api_key_from, exposure_warning, kv_store_secret_from

    integer("--port", args.port, low=0, high=65535)
    api_key = api_key_from(args.api_key, args.api_key_file)
    kv_store_secret = kv_store_secret_from(args.kv_store_secret_file)
    if (warning := exposure_warning(args.host, api_key)) is not None:
        print(warning, file=sys.stderr, flush=True)
    model = None  # build_context loads a float32 checkpoint itself
    if args.quantize or args.dtype != "float32":
        model = load_model(resolve_checkpoint_dir(args.checkpoint), args.device, args)
    config = EngineConfig(block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    ctx = build_context(args.checkpoint, config=config, model=model, model_name=args.model_name,
                        api_key=api_key, max_waiting=args.max_waiting, device=args.device, kv_store=args.kv_store,
                        host_kv_bytes=args.host_kv_bytes, kv_store_secret=kv_store_secret, warm_up=args.warm_up,
                        limits=_limits(args), kv_events=_kv_events(args), kv_role=args.kv_role,
                        kv_load_timeout_s=args.kv_load_timeout)
    print(f"serving {ctx.model_name!r} on http://{args.host}:{args.port} (live page at /, API under /v1)",
          flush=True)
    serve(ctx, host=args.host, port=args.port, log_level=args.log_level, host_names=tuple(args.allowed_hosts))
