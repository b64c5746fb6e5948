"""Build a server from a checkpoint directory and run it with uvicorn.

Shutdown (SIGTERM or Ctrl-C): uvicorn stops accepting connections and waits for the open ones; we also
mark the engine loop as draining, so new requests get 503 and /v1/engine/state streams end, while
requests already running finish normally. Then the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
from pathlib import Path

from .._checks import non_negative_int
from ..checkpoint import resolve_checkpoint_dir
from ..engine.config import EngineConfig
from ..model.transformer import TransformerLM
from ..tokenizer import check_vocab_size
from .access import allowed_hosts
from .app import ServerContext, create_app
from .engine_loop import EngineLoop
from .kv_transfer import ROLES as KV_ROLES
from .kv_transfer import KVTransfer
from .limits import Limits
from .metrics import ServerMetrics
from .text import TextCodec

GRACEFUL_SHUTDOWN_S = 60  # running requests get this long to finish after SIGTERM
# secrets come from the environment or a file, never the command line, where `ps` shows them
API_KEY_ENV = "MINI_TRANSFORMER_API_KEY"
KV_STORE_SECRET_ENV = "MINI_TRANSFORMER_KV_STORE_SECRET"
REDIS_USERNAME_ENV, REDIS_PASSWORD_ENV = "MINI_TRANSFORMER_REDIS_USERNAME", "MINI_TRANSFORMER_REDIS_PASSWORD"
UNSIGNED_STORE = ("kv store: entries are not signed (no --kv-store-secret-file or {env}); that is safe only "
                  "when no process but this machine's trusted ones can write to the store")


def build_context(checkpoint: str | Path, *, config: EngineConfig | None = None, model_name: str | None = None,
                  api_key: str | None = None, max_waiting: int = 256, device: str = "cpu", model=None,
                  kv_store: str | None = None, host_kv_bytes: int | None = None,
                  kv_store_secret: bytes | None = None, warm_up: bool = False,
                  limits: Limits | None = None, kv_events: dict | None = None, kv_role: str | None = None,
                  kv_load_timeout_s: float = 1.0) -> ServerContext:
    """Load the model and tokenizer of `checkpoint` (ours or a Hugging Face GPT-2 / Llama directory) and
    put an engine around them, sized by `config` (None: EngineConfig's defaults). `model` may be given to
    serve a model already in memory. `kv_store`
    (redis://HOST:PORT) and `host_kv_bytes` add KV store tiers behind the pool (engine/kv_connector.py),
    whose entries are signed with `kv_store_secret` (shared by the replicas; kv_store_secret_from).
    `warm_up`: run warm_up_engine before returning, so no client pays for compiling. `limits`: what one
    request may cost (body, prompt, constraint sizes, grammar compile time; None: Limits' defaults).
    `kv_events`: publish the prefix cache's changes for a KV-aware router, with these KVEventPublisher
    arguments (endpoint=, replay_endpoint=, topic=; engine/kv_events.py).
    `kv_role` ("producer" or "consumer", with `kv_store`): one side of a prefill/decode pair
    (kv_transfer.py); a consumer waits up to `kv_load_timeout_s` for a producer's blocks."""
    from ..engine import LLMEngine

    non_negative_int("max_waiting", max_waiting)  # EngineConfig checked its own fields
    config = EngineConfig() if config is None else config
    if kv_role not in (None, *KV_ROLES):
        raise ValueError(f"kv_role={kv_role!r} must be one of {', '.join(KV_ROLES)}")
    if kv_role is not None and kv_store is None:
        raise ValueError(f"kv_role={kv_role!r} needs a kv_store (--kv-store redis://...): the KV moves through it")
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty; give a key, or none to serve without one")
    checkpoint = resolve_checkpoint_dir(checkpoint)  # `best` is found even in the middle of a save
    codec = TextCodec(checkpoint)
    if model is None:  # verifies the checkpoint's manifest first
        model = TransformerLM.from_pretrained(checkpoint, device=device)
    check_vocab_size(codec.tokenizer, model.config.vocab_size, checkpoint)  # refused here, not mid-generation
    connector = kv_connector(kv_store, host_kv_bytes, kv_store_secret)
    # the engine adds EOS to each request's stop ids itself (SamplingParams.stops), unless ignore_eos
    engine = LLMEngine(model, config, eos_token_id=codec.eos_token_id, kv_connector=connector,
                       tokenizer=codec.tokenizer)
    if kv_events is not None:
        from ..engine.kv_events import KVEventPublisher

        engine.publish_kv_events(KVEventPublisher(block_size=config.block_size, **kv_events))
    if warm_up:
        warm_up_engine(engine)
    stats = engine.stats()
    model_name = model_name or Path(checkpoint).resolve().name
    metrics = ServerMetrics(model_name)
    transfer = None if kv_role is None else KVTransfer(kv_role, connector, metrics, kv_load_timeout_s)
    return ServerContext(
        engine_loop=EngineLoop(engine, metrics, max_waiting=max_waiting),
        codec=codec, metrics=metrics, model_name=model_name,
        max_model_len=model.config.max_seq_len, pool_tokens=stats["num_blocks"] * config.block_size,
        vocab_size=model.config.vocab_size, api_key=api_key, limits=Limits() if limits is None else limits,
        kv_transfer=transfer,
    )


def warm_up_engine(engine) -> None:
    """Step a few dummy requests through the engine before the server says it is ready. On the CPU the
    decode rows run the C++ kernel (attention/paged_cpu.py), built when the engine is made, so this is
    quick; where that kernel cannot be built, the paged decode attention is compiled on first use, and
    compiled again for each shape family it meets: one or several sequences, one or several blocks per
    table, decode-only or mixed with prefill (torch.compile specialises sizes 0 and 1 and the slices of a
    mixed step). Without this, the first clients would wait for those compilations (docs/07 has the times).
    The dummy requests count in the engine's stats (steps, tokens computed) like any others; their blocks
    are freed when they finish."""
    from ..inference.sampling import SamplingParams

    cfg = engine.model_config
    short = max(1, min(3, cfg.max_seq_len - 2))
    long = max(1, min(engine.block_size + 2, cfg.max_seq_len - 2))  # reaches a second block
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def prompt(n: int, first: int) -> list[int]:
        return [(first + i) % cfg.vocab_size for i in range(n)]

    for lengths in ((short,), (short, short), (long,), (long, long)):  # decode-only steps of each family
        engine.generate([prompt(n, i) for i, n in enumerate(lengths)], params, use_tqdm=False)
    for running in (1, 2):  # decode rows of `running` sequences beside prefill rows in one step
        ids = [engine.add_request(prompt(short, i), params) for i in range(running)]
        engine.step()  # their prefill: from here on they decode
        ids += [engine.add_request(prompt(long, 7 + i), params) for i in range(2)]
        while engine.has_unfinished_requests():
            engine.step()


def kv_connector(kv_store: str | None, host_kv_bytes: int | None, secret: bytes | None = None):
    """The KV store tiers asked for, fastest first (host memory, then Redis), or None for none. Redis's
    user and password may come from the environment (REDIS_USERNAME_ENV, REDIS_PASSWORD_ENV)."""
    from ..engine.kv_connector import KVConnector
    from ..engine.kv_tiers import HostTier, RedisTier, parse_redis_url

    tiers = []
    if host_kv_bytes is not None:
        if isinstance(host_kv_bytes, bool) or not isinstance(host_kv_bytes, int) or host_kv_bytes < 1:
            raise ValueError(f"host_kv_bytes={host_kv_bytes!r} must be a positive number of bytes")
        tiers.append(HostTier(host_kv_bytes))
    if kv_store is not None:
        parse_redis_url(kv_store)  # refuse a bad url before the model loads
        if secret is None:
            print(UNSIGNED_STORE.format(env=KV_STORE_SECRET_ENV), file=sys.stderr, flush=True)
        tiers.append(RedisTier(kv_store, username=os.environ.get(REDIS_USERNAME_ENV) or None,
                               password=os.environ.get(REDIS_PASSWORD_ENV) or None))
    return KVConnector(tiers, secret=secret) if tiers else None


def read_secret(name: str, path: str | Path | None, env: str) -> str | None:
    """A secret from the file `path` (its trailing newline dropped), else from the environment variable
    `env`, else None. `name` is the flag that gave the file, for the error messages."""
    if path is not None:
        try:
            secret = Path(path).read_text().rstrip("\r\n")
        except OSError as err:
            raise ValueError(f"{name} {path}: cannot read it ({err.strerror})") from None
        if not secret:
            raise ValueError(f"{name} {path} is empty; put the secret in it")
        return secret
    return os.environ.get(env) or None


def api_key_from(api_key: str | None, api_key_file: str | Path | None) -> str | None:
    """The server's api key: --api-key, or --api-key-file, or API_KEY_ENV (one of the first two at most)."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    return api_key if api_key is not None else read_secret("--api-key-file", api_key_file, API_KEY_ENV)


def kv_store_secret_from(secret_file: str | Path | None) -> bytes | None:
    """The KV store's shared secret: --kv-store-secret-file, else KV_STORE_SECRET_ENV, else None."""
    from ..engine.kv_entry import MIN_SECRET_BYTES

    secret = read_secret("--kv-store-secret-file", secret_file, KV_STORE_SECRET_ENV)
    if secret is not None and len(secret.encode()) < MIN_SECRET_BYTES:
        where = f"--kv-store-secret-file {secret_file}" if secret_file is not None else KV_STORE_SECRET_ENV
        raise ValueError(f"{where} holds {len(secret.encode())} bytes; the secret needs at least {MIN_SECRET_BYTES}")
    return None if secret is None else secret.encode()


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server to this machine (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """One line when the server binds beyond this machine with no key: anyone who reaches it may use it."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"warning: serving on {host} without an api key: anyone who can reach this address can use the "
            f"server; set {API_KEY_ENV} or --api-key-file")


def serve(ctx: ServerContext, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          host_names: tuple[str, ...] = ()) -> None:
    """Serve until SIGTERM, answering the Host names of `host` and `host_names` (access.py)."""
    import uvicorn

    ctx.allowed_hosts = allowed_hosts(host, host_names)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            ctx.engine_loop.draining = True  # new requests: 503; state streams end so connections can close
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(ctx), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    # uvicorn re-raises the signal that stopped it once it is done, under the handler that was there
    # before it started. Put a no-op there, so a graceful SIGTERM ends with exit status 0.
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
