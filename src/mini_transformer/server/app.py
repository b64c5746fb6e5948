"""The HTTP face: FastAPI routes in OpenAI's format, errors as OpenAI error objects, the live page.

    GET  /                     the live page (static/index.html)
    GET  /health               200 while serving, 503 while shutting down or once the engine thread is gone
    GET  /metrics              Prometheus text format
    GET  /v1/models            the one model served
    POST /v1/completions       text, texts or token ids; streamed (SSE) or not
    POST /v1/chat/completions  messages through the chat template; streamed (SSE) or not
    GET  /v1/engine/state      queues, block tables and the pool (JSON; ?stream=true for SSE)

Every /v1 route needs `Authorization: Bearer KEY` when the server has an api key.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import InvalidRequest
from . import protocol as P
from .engine_loop import EngineLoop
from .generation import ClientGone, Generation
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from .structured import check_structured
from .text import TextCodec

STATIC = Path(__file__).parent / "static"
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

    app = FastAPI(title="mini-transformer", lifespan=lifespan)
    app.state.ctx = ctx
    _install_error_handlers(app, ctx)

    async def require_key(request: Request) -> None:
        if ctx.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {ctx.api_key}".encode()):
            what = "missing" if not given else "wrong"
            raise ErrorResponse(401, f"{what} API key: send the header 'Authorization: Bearer <key>'",
                                code="invalid_api_key")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/health")
    async def health():
        if ctx.engine_loop.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not ctx.engine_loop.alive:
            return JSONResponse({"status": "engine thread not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models():
        return P.models_response(ctx.model_name, ctx.max_model_len)

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(body: CompletionRequest, request: Request):
        _check_common(ctx, body)
        for name, unsupported in (("echo", body.echo), ("logprobs", body.logprobs is not None),
                                  ("suffix", body.suffix is not None)):
            if unsupported:
                raise ErrorResponse(400, f"{name} is not supported by this server", param=name)
        prompts = _completion_prompts(ctx, body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        structured = check_structured(ctx.engine_loop.engine, body)
        params = [[body.sampling_params(max_tokens, j, structured) for j in range(body.n)] for _ in prompts]
        for i, prompt in enumerate(prompts):
            _check_with_engine(ctx, prompt, params[i][0], "prompt" if i == 0 else f"prompt[{i}]")
        gen = Generation(ctx.engine_loop, ctx.codec, prompts, params, body.stop_strings())
        return await _respond(gen, body, request, ctx, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_common(ctx, body)
        if body.logprobs:
            raise ErrorResponse(400, "logprobs is not supported by this server", param="logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = ctx.codec.encode(ctx.codec.render_chat(messages, body.add_generation_prompt), "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # OpenAI's default: as much as the context leaves
            max_tokens = max(1, min(ctx.max_model_len, ctx.pool_tokens) - len(prompt))
        structured = check_structured(ctx.engine_loop.engine, body)
        params = [[body.sampling_params(max_tokens, j, structured) for j in range(body.n)]]
        _check_with_engine(ctx, prompt, params[0][0], "messages")
        gen = Generation(ctx.engine_loop, ctx.codec, [prompt], params, body.stop_strings())
        return await _respond(gen, body, request, ctx, chat=True)

    @app.get("/v1/engine/state", dependencies=[Depends(require_key)])
    async def engine_state(request: Request, stream: bool = False):
        if not stream:
            return ctx.engine_loop.state()

        async def events():
            while not ctx.engine_loop.draining:  # ends when the server shuts down or the client leaves
                yield sse(ctx.engine_loop.state())
                await asyncio.sleep(STATE_STREAM_INTERVAL_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _install_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    def reply(err: ErrorResponse) -> JSONResponse:
        ctx.metrics.rejected.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ErrorResponse)
    async def on_error(request, err: ErrorResponse):
        return reply(err)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None
        elif not loc:  # the body as a whole: not a JSON object (or sent without a JSON content type)
            message = f"the body must be a JSON object (Content-Type: application/json): {message}"
        elif param:
            message = f"{param}: {message} (got {first.get('input')!r})"
        return reply(ErrorResponse(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request, err: StarletteHTTPException):
        return reply(ErrorResponse(err.status_code, str(err.detail)))


def _check_common(ctx: ServerContext, body) -> None:
    if body.model != ctx.model_name:
        raise ErrorResponse(400, f"model {body.model!r} does not exist; this server serves {ctx.model_name!r}",
                            param="model", code="model_not_found")


def _check_with_engine(ctx: ServerContext, prompt: list[int], params, param: str) -> None:
    """The engine's own add_request checks (token range, fits the context and the pool, stop ids), run
    here so a refusal is a 400 naming the request's parameter before anything is queued."""
    try:
        ctx.engine_loop.engine.check_request(prompt, params)
    except InvalidRequest as err:
        if err.argument == "stop_token_ids":
            raise ErrorResponse(400, str(err), param="stop_token_ids") from None
        code = "context_length_exceeded" if err.argument == "max_tokens" else None
        raise ErrorResponse(400, f"{param}: {err}", param=param, code=code) from None


def _completion_prompts(ctx: ServerContext, prompt) -> list[list[int]]:
    """OpenAI's four prompt forms -> a list of token id lists."""
    if isinstance(prompt, str):
        return [ctx.codec.encode(prompt)]
    if not prompt:
        raise ErrorResponse(400, "prompt is empty; give text or token ids", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [ctx.codec.encode(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    prompts = [prompt] if all(isinstance(t, int) for t in prompt) else prompt
    return [list(p) for p in prompts]  # token ranges: the engine's check_request


async def _respond(gen: Generation, body, request: Request, ctx: ServerContext, chat: bool):
    try:
        await gen.start(request.is_disconnected)
    except ClientGone:
        gen.close()
        return Response(status_code=499)
    except BaseException:
        gen.close()
        raise
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if not body.stream:
        try:
            choices = await gen.collect(request.is_disconnected)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; nginx's code for it
        finally:
            gen.close()
        build = P.chat_response if chat else P.completion_response
        return build(rid, ctx.model_name, choices, P.usage(gen.prompt_tokens, gen.completion_tokens))
    return ClosingStreamingResponse(_stream(gen, body, rid, ctx.model_name, chat), on_close=gen.close,
                                    media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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


async def _stream(gen: Generation, body, rid: str, model: str, chat: bool):
    """The SSE body: chunks as choices advance, a finish chunk per choice, usage if asked, [DONE]."""
    created, with_usage = P.now(), body.include_usage
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, piece: str | None, finish: str | None, role: bool = False) -> str:
        if not chat:
            return sse(P.completion_chunk(rid, model, created, index, piece or "", finish, with_usage))
        delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece else {})
        return sse(P.chat_chunk(rid, model, created, index, delta, finish, with_usage))

    try:
        if chat:  # OpenAI opens each chat choice with a chunk that only names the role
            for index in range(len(gen.choices)):
                yield chunk(index, None, None, role=True)
        async for index, piece, finish in gen.events():
            if piece:
                yield chunk(index, piece, None)
            if finish is not None:
                yield chunk(index, None, finish)
        if with_usage:
            yield sse(P.usage_chunk(rid, obj, model, created, P.usage(gen.prompt_tokens, gen.completion_tokens)))
    except ErrorResponse as err:  # the headers are gone already: the error travels as an event
        yield sse(err.body())
    finally:
        gen.close()
    yield sse("[DONE]")
