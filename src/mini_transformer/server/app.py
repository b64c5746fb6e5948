"""The HTTP face: FastAPI routes in OpenAI's format, errors as OpenAI error objects, the live page.

    GET  /                     the live page (static/index.html)
    GET  /health               200 while serving, 503 while shutting down or once the engine thread is gone
    GET  /get_load             {"load": requests in flight}, polled by vllm-router (power_of_two)
    GET  /metrics              Prometheus text format
    GET  /v1/models            the one model served
    GET  /v1/models/{id}       that model (404 for another id)
    POST /v1/completions       text, texts or token ids; streamed (SSE) or not
    POST /v1/chat/completions  messages through the chat template; streamed (SSE) or not
    GET  /v1/engine/state      queues, block tables and the pool: JSON, or SSE for a client that sends
                               `Accept: text/event-stream` (an EventSource; it runs until the client leaves)
    POST /tokenize, /detokenize, GET /tokenizer_info   the checkpoint's tokenizer (vLLM's shapes; tokenize.py)

Every /v1 and tokenizer route, and /metrics, needs `Authorization: Bearer KEY` when the server has an
api key, and every request must name the server in its Host header (access.py). The OpenAPI schema at
/openapi.json documents every response (schema.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter

from ..engine import InvalidRequest
from . import protocol as P
from .access import LOCAL_HOSTS, HostCheck, key_check
from .engine_loop import EngineLoop
from .errors import install_error_handlers
from .generation import ClientGone, Generation, Options
from .kv_transfer import KVTransfer
from .limits import BodyLimit, Limits, Workers, check_prompt_bytes
from .logprobs import CompletionLogprobs, chat_logprobs, prompt_logprobs_json, scored
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from .schema import METRICS_CONTENT, describe, install_openapi
from .structured import compile_structured
from .text import TextCodec
from .tokenize import add_tokenizer_routes

STATIC = Path(__file__).parent / "static"
COMPLETION_BODY = TypeAdapter(CompletionRequest)
CHAT_BODY = TypeAdapter(ChatCompletionRequest)
STATE_STREAM_INTERVAL_S = 0.25


@dataclass
class ServerContext:
    """What the routes share: the engine loop, the text codec and the limits checked at the door."""

    engine_loop: EngineLoop
    codec: TextCodec
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    pool_tokens: int  # num_blocks * block_size: no request can ever hold more
    vocab_size: int
    api_key: str | None = None
    allowed_hosts: frozenset[str] = LOCAL_HOSTS  # Host header names answered, without the port, lower case
    limits: Limits = Limits()
    workers: Workers | None = None  # made by create_app: the pools for tokenising and compiling
    kv_transfer: KVTransfer | None = None  # a prefill or decode server of a disaggregated pair


def sse(payload: dict | str) -> str:
    """One server-sent event: a `data: ` line and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def create_app(ctx: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.engine_loop.start()
        try:
            yield
        finally:
            ctx.engine_loop.draining = True
            await asyncio.to_thread(ctx.engine_loop.shutdown)
            await asyncio.to_thread(ctx.workers.shutdown)
            if ctx.engine_loop.engine.kv_events is not None:
                await asyncio.to_thread(ctx.engine_loop.engine.kv_events.close)

    app = FastAPI(title="mini-transformer", lifespan=lifespan)
    app.state.ctx = ctx
    ctx.workers = Workers(ctx.limits)
    app.add_middleware(BodyLimit, max_bytes=ctx.limits.max_body_bytes, metrics=ctx.metrics)
    install_error_handlers(app, ctx.metrics)
    app.add_middleware(HostCheck, allowed=ctx.allowed_hosts, metrics=ctx.metrics)
    install_openapi(app, ctx)
    require_key = key_check(ctx.api_key)
    _add_status_routes(app, ctx, require_key)
    _add_generation_routes(app, ctx, require_key)
    _add_state_route(app, ctx, require_key)
    add_tokenizer_routes(app, ctx, require_key)
    return app


def _add_status_routes(app: FastAPI, ctx: ServerContext, require_key: Callable) -> None:
    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/health", **describe("health"))
    async def health():
        if ctx.engine_loop.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not ctx.engine_loop.alive:
            return JSONResponse({"status": "engine thread not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/get_load", **describe("load"))  # like /health, open: a router polls it without a key
    async def load():
        return {"load": ctx.engine_loop.in_flight}

    @app.get("/metrics", dependencies=[Depends(require_key)], **describe("metrics"))
    async def metrics():
        return Response(ctx.metrics.render(), media_type=METRICS_CONTENT)

    @app.get("/v1/models", dependencies=[Depends(require_key)], **describe("models"))
    async def models():
        return P.models_response(ctx.model_name, ctx.max_model_len)

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_key)], **describe("model"))
    async def model(model_id: str):
        _check_model(ctx, model_id)
        return P.model_card(ctx.model_name, ctx.max_model_len)


def _add_generation_routes(app: FastAPI, ctx: ServerContext, require_key: Callable) -> None:
    @app.post("/v1/completions", dependencies=[Depends(require_key)],
              **describe("completions", (CompletionRequest,)))
    async def completions(request: Request):
        body: CompletionRequest = await ctx.workers.parse(COMPLETION_BODY, request)
        _check_common(ctx, body)
        prompts = await ctx.workers.run(_completion_prompts, ctx, body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        score_only = max_tokens == 0  # lm-eval's loglikelihood: the prompt's logprobs, nothing generated
        if score_only and not body.echo:
            raise ErrorResponse(400, "max_tokens=0 needs echo=true (it returns the prompt and generates nothing)",
                                param="max_tokens")
        # the engine scores the prompt once, for echo's logprobs and prompt_logprobs: the larger N serves both
        wanted = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
        prompt_logprobs = max(wanted, default=None)
        _check_capacity(ctx, len(prompts) * body.n)  # before anything is built per prompt
        structured = await compile_structured(ctx.engine_loop.engine, ctx.workers, body)
        params = [[body.sampling_params(max(max_tokens, 1), j, ctx.vocab_size, logprobs=body.logprobs,
                                        prompt_logprobs=prompt_logprobs, structured=structured)
                   for j in range(body.n)] for _ in prompts]
        await ctx.workers.run(_check_with_engine, ctx, prompts, [p[0] for p in params], "prompt")
        options = Options(tuple(body.stop_strings()), echo=body.echo, score_only=score_only,
                          logprobs=body.logprobs is not None, include_stop=body.include_stop_str_in_output,
                          min_tokens=body.min_tokens)
        gen = Generation(ctx.engine_loop, ctx.codec, prompts, params, options)
        return await _respond(gen, body, request, ctx, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)],
              **describe("chat", (ChatCompletionRequest,)))
    async def chat_completions(request: Request):
        body: ChatCompletionRequest = await ctx.workers.parse(CHAT_BODY, request)
        _check_common(ctx, body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ErrorResponse(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        prompt = await ctx.workers.run(_chat_prompt, ctx, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens == 0:
            raise ErrorResponse(400, "max_tokens must be at least 1 for chat completions", param="max_tokens")
        if max_tokens is None:  # OpenAI's default: as much as the context leaves
            max_tokens = max(1, min(ctx.max_model_len, ctx.pool_tokens) - len(prompt))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        structured = await compile_structured(ctx.engine_loop.engine, ctx.workers, body)
        params = [[body.sampling_params(max_tokens, j, ctx.vocab_size, logprobs=logprobs, structured=structured)
                   for j in range(body.n)]]
        _check_capacity(ctx, body.n)
        await ctx.workers.run(_check_with_engine, ctx, [prompt], [params[0][0]], "messages")
        options = Options(tuple(body.stop_strings()), logprobs=body.logprobs,
                          include_stop=body.include_stop_str_in_output, min_tokens=body.min_tokens)
        gen = Generation(ctx.engine_loop, ctx.codec, [prompt], params, options)
        return await _respond(gen, body, request, ctx, chat=True)


def _add_state_route(app: FastAPI, ctx: ServerContext, require_key: Callable) -> None:
    @app.get("/v1/engine/state", dependencies=[Depends(require_key)], **describe("state"))
    async def engine_state(request: Request):
        # only a client that asks for events gets the endless stream; an ordinary GET gets one JSON snapshot
        if "text/event-stream" not in request.headers.get("accept", ""):
            return ctx.engine_loop.state()

        async def events():
            while not ctx.engine_loop.draining:  # ends when the server shuts down or the client leaves
                yield sse(ctx.engine_loop.state())
                await asyncio.sleep(STATE_STREAM_INTERVAL_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _check_model(ctx: ServerContext, model: str) -> None:
    if model != ctx.model_name:  # 404, as OpenAI and vLLM answer (the client raises NotFoundError)
        raise ErrorResponse(404, f"model {model!r} does not exist; this server serves {ctx.model_name!r}",
                            param="model", code="model_not_found")


def _check_common(ctx: ServerContext, body) -> None:
    _check_model(ctx, body.model)
    body.check_supported()


def _check_capacity(ctx: ServerContext, choices: int) -> None:
    """A request with more choices than the server ever holds in flight could never be admitted: 400, not
    a 429 that a client would retry for nothing."""
    capacity = ctx.engine_loop.capacity
    if choices > capacity:
        raise ErrorResponse(400, f"this request has {choices} choices (prompts x n) but the server holds at most "
                                 f"{capacity} in flight (--max-num-seqs + --max-waiting); send fewer at a time",
                            param="n")


def _check_with_engine(ctx: ServerContext, prompts: list[list[int]], params: list, param: str) -> None:
    """The engine's own add_request checks (token range, fits the context and the pool, stop ids), run
    here (on a worker: a prompt may hold a million ids) so a refusal is a 400 naming the request's
    parameter before anything is queued."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        name = param if i == 0 else f"{param}[{i}]"
        try:
            ctx.engine_loop.engine.check_request(prompt, p)
        except InvalidRequest as err:
            if err.argument == "stop_token_ids":
                raise ErrorResponse(400, str(err), param="stop_token_ids") from None
            code = "context_length_exceeded" if err.argument == "max_tokens" else None
            raise ErrorResponse(400, f"{name}: {err}", param=name, code=code) from None


def _chat_prompt(ctx: ServerContext, body: ChatCompletionRequest) -> list[int]:
    """The messages through the chat template, tokenised (on a worker thread: it may be long)."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    check_prompt_bytes(ctx.limits, "".join(m["content"] or "" for m in messages), "messages")
    return ctx.codec.encode(ctx.codec.render_chat(messages, body.add_generation_prompt), "messages")


def _completion_prompts(ctx: ServerContext, prompt) -> list[list[int]]:
    """OpenAI's four prompt forms -> a list of token id lists (on a worker thread: texts may be long)."""
    if isinstance(prompt, str):
        check_prompt_bytes(ctx.limits, prompt, "prompt")
        return [ctx.codec.encode(prompt)]
    if not prompt:
        raise ErrorResponse(400, "prompt is empty; give text or token ids", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        for i, p in enumerate(prompt):
            check_prompt_bytes(ctx.limits, p, f"prompt[{i}]")
        return [ctx.codec.encode(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    # the parsed lists as they are (token ranges: the engine's check_request): copying a body's half a
    # million lists would make as many objects again for the garbage collector to walk
    return [prompt] if isinstance(prompt[0], int) else prompt


async def _respond(gen: Generation, body, request: Request, ctx: ServerContext, chat: bool):
    if ctx.kv_transfer is not None:  # a decode server: the prefill server's blocks first (bounded wait)
        await ctx.kv_transfer.before_start(body, gen.prompts)
    try:
        await gen.start(request.is_disconnected)
    except ClientGone:
        gen.close()
        return Response(status_code=499)
    except BaseException:
        gen.close()
        raise
    given = P.client_request_id(request.headers.get("x-request-id"))
    rid = P.new_id("chatcmpl" if chat else "cmpl") if given is None else f"{'chatcmpl' if chat else 'cmpl'}-{given}"
    echo = {} if given is None else {"X-Request-Id": given}  # a router follows one request across replicas
    if not body.stream:
        try:
            choices = await gen.collect(request.is_disconnected)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; nginx's code for it
        finally:
            gen.close()
        use = P.usage(gen.prompt_tokens, gen.completion_tokens)
        logprobs = [_logprobs_json(ctx, gen, c.tokens, chat, CompletionLogprobs(ctx.codec.token_text))
                    for c in choices]
        texts = [(c.out, c.finish_reason) for c in choices]
        if chat:
            response = P.chat_response(rid, ctx.model_name, texts, logprobs, use)
        else:
            prompt_logprobs = None if body.prompt_logprobs is None else [
                prompt_logprobs_json(scored(c.prompt, c.prompt_entries), body.prompt_logprobs, ctx.codec.token_text)
                for c in choices]
            response = P.completion_response(rid, ctx.model_name, texts, logprobs, use, prompt_logprobs)
        if ctx.kv_transfer is not None and (transfer := await ctx.kv_transfer.after_finish()) is not None:
            response["kv_transfer_params"] = transfer  # a prefill server: its blocks are in the store now
        return JSONResponse(response, headers=echo)
    return ClosingStreamingResponse(_stream(gen, body, rid, ctx, chat), on_close=gen.close,
                                    media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **echo})


def _logprobs_json(ctx: ServerContext, gen: Generation, tokens, chat: bool, formatter: CompletionLogprobs):
    if not gen.options.logprobs:
        return None
    return chat_logprobs(tokens, ctx.codec.token_text) if chat else formatter.part(tokens)


class ClosingStreamingResponse(StreamingResponse):
    """A stream that calls `on_close` however it ends: the body generator's own `finally` never runs when
    the client is gone before the first chunk (the generator was never started), and the request's
    choices would run on in the engine and hold their capacity."""

    def __init__(self, content, *, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _stream(gen: Generation, body, rid: str, ctx: ServerContext, chat: bool):
    """The SSE body: chunks as choices advance (each with the logprobs of its tokens when asked for), a
    finish chunk per choice, usage if asked, [DONE]."""
    created, with_usage, model = P.now(), body.include_usage, ctx.model_name
    obj = "chat.completion.chunk" if chat else "text_completion"
    formatters = [CompletionLogprobs(ctx.codec.token_text) for _ in gen.choices]  # text_offset runs per choice

    def chunk(index: int, piece: str | None, finish: str | None, tokens=(), role: bool = False) -> str:
        logprobs = _logprobs_json(ctx, gen, list(tokens), chat, formatters[index]) if tokens else None
        if not chat:
            return sse(P.completion_chunk(rid, model, created, index, piece or "", logprobs, finish, with_usage))
        delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece else {})
        return sse(P.chat_chunk(rid, model, created, index, delta, logprobs, finish, with_usage))

    try:
        if chat:  # OpenAI opens each chat choice with a chunk that only names the role
            for index in range(len(gen.choices)):
                yield chunk(index, None, None, role=True)
        async for event in gen.events():
            if event.text or event.tokens:
                yield chunk(event.index, event.text, None, event.tokens)
            if event.finish_reason is not None:
                yield chunk(event.index, None, event.finish_reason)
        if ctx.kv_transfer is not None:  # a prefill server answers once its blocks are in the store
            await ctx.kv_transfer.after_finish()
        if with_usage:
            yield sse(P.usage_chunk(rid, obj, model, created, P.usage(gen.prompt_tokens, gen.completion_tokens)))
    except ErrorResponse as err:  # the headers are gone already: the error travels as an event
        yield sse(err.body())
    finally:
        gen.close()
    yield sse("[DONE]")
