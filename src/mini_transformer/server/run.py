"""Build a server from a checkpoint directory and run it with uvicorn.

Shutdown (SIGTERM or Ctrl-C): uvicorn stops accepting connections and waits for the open ones; we also
mark the engine loop as draining, so new requests get 503 and /v1/engine/state streams end, while
requests already running finish normally. Then the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import signal
from pathlib import Path

from .._checks import non_negative_int
from ..checkpoint import resolve_checkpoint_dir
from ..engine.config import EngineConfig
from ..model.transformer import TransformerLM
from ..tokenizer import check_vocab_size
from .app import ServerContext, create_app
from .engine_loop import EngineLoop
from .limits import Limits
from .metrics import ServerMetrics
from .text import TextCodec

GRACEFUL_SHUTDOWN_S = 60  # running requests get this long to finish after SIGTERM


def build_context(checkpoint: str | Path, *, config: EngineConfig | None = None, model_name: str | None = None,
                  api_key: str | None = None, max_waiting: int = 256, device: str = "cpu", model=None,
                  kv_store: str | None = None, host_kv_bytes: int | None = None,
                  warm_up: bool = False, limits: Limits | None = None) -> ServerContext:
    """Load the model and tokenizer of `checkpoint` (ours or a Hugging Face GPT-2 / Llama directory) and
    put an engine around them, sized by `config` (None: EngineConfig's defaults). `model` may be given to
    serve a model already in memory. `kv_store`
    (redis://HOST:PORT) and `host_kv_bytes` add KV store tiers behind the pool (engine/kv_connector.py).
    `warm_up`: run warm_up_engine before returning, so no client pays for compiling. `limits`: what one
    request may cost (body, prompt, constraint sizes, grammar compile time; None: Limits' defaults)."""
    from ..engine import LLMEngine

    non_negative_int("max_waiting", max_waiting)  # EngineConfig checked its own fields
    config = EngineConfig() if config is None else config
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty; give a key, or none to serve without one")
    checkpoint = resolve_checkpoint_dir(checkpoint)  # `best` is found even in the middle of a save
    codec = TextCodec(checkpoint)
    if model is None:  # verifies the checkpoint's manifest first
        model = TransformerLM.from_pretrained(checkpoint, device=device)
    check_vocab_size(codec.tokenizer, model.config.vocab_size, checkpoint)  # refused here, not mid-generation
    connector = kv_connector(kv_store, host_kv_bytes)
    # the engine adds EOS to each request's stop ids itself (SamplingParams.stops), unless ignore_eos
    engine = LLMEngine(model, config, eos_token_id=codec.eos_token_id, kv_connector=connector,
                       tokenizer=codec.tokenizer)
    if warm_up:
        warm_up_engine(engine)
    stats = engine.stats()
    model_name = model_name or Path(checkpoint).resolve().name
    metrics = ServerMetrics(model_name)
    return ServerContext(
        engine_loop=EngineLoop(engine, metrics, max_waiting=max_waiting),
        codec=codec, metrics=metrics, model_name=model_name,
        max_model_len=model.config.max_seq_len, pool_tokens=stats["num_blocks"] * config.block_size,
        vocab_size=model.config.vocab_size, api_key=api_key, limits=Limits() if limits is None else limits,
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


def kv_connector(kv_store: str | None, host_kv_bytes: int | None):
    """The KV store tiers asked for, fastest first (host memory, then Redis), or None for none."""
    from ..engine.kv_connector import KVConnector
    from ..engine.kv_tiers import HostTier, RedisTier, parse_redis_url

    tiers = []
    if host_kv_bytes is not None:
        if isinstance(host_kv_bytes, bool) or not isinstance(host_kv_bytes, int) or host_kv_bytes < 1:
            raise ValueError(f"host_kv_bytes={host_kv_bytes!r} must be a positive number of bytes")
        tiers.append(HostTier(host_kv_bytes))
    if kv_store is not None:
        parse_redis_url(kv_store)  # refuse a bad url before the model loads
        tiers.append(RedisTier(kv_store))
    return KVConnector(tiers) if tiers else None


def serve(ctx: ServerContext, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    import uvicorn

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
