"""The OpenAPI schema tells the truth: what each route answers, with which status and content type.

FastAPI documents a route's 200 from its return annotation (none here: the routes return plain dicts or
streams, for speed) and adds a 422 that this server never sends. So each route gets `describe(name)`:
its 200 body as the pydantic models below, an SSE or Prometheus content type where that is what comes,
OpenAI's error object for each error status it can answer, and the request body a route parses itself
(on a worker, limits.py; FastAPI documents only the bodies it parses). `install_openapi` then drops the 422s
and writes the limits only the loaded model knows (max_model_len, vocab_size) into the request schemas,
so a schema-driven client (schemathesis, a generated SDK) sees the same bounds the engine enforces.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.models import OpenAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

METRICS_CONTENT = CONTENT_TYPE_LATEST  # Prometheus' text exposition format
SSE_CONTENT = "text/event-stream"
# OpenAPI 3.1 has the schema of a text/event-stream describe one event (the convention schemathesis
# follows): each event carries a `data` line, a JSON chunk of the 200's shape, an error object, or [DONE]
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a JSON chunk, an error object, or [DONE]"},
                            "event": {"type": "string"}, "id": {"type": "string"}}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error object."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None  # among the N asked for; null for a prompt token outside them
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # with prompt_logprobs=N (vLLM's field): null for the first prompt token, then token id -> its logprob
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """A completion; a stream (stream=true, text/event-stream) sends chunks of the same shape, with
    "usage": null on each but the last (when stream_options.include_usage)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill server's (--kv-role producer) answer


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """A chat completion; a stream sends chat.completion.chunk objects with `delta` instead of `message`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill server's (--kv-role producer) answer


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str


class Load(BaseModel):
    """What a router's load-aware policies poll (SGLang's /get_load shape, as vllm-router reads it)."""

    load: int  # requests in flight: submitted and not yet ended


class EngineState(BaseModel):
    """Queues, block tables and the pool (see state.py); the live page reads it."""

    model_config = ConfigDict(extra="allow")

    block_size: int
    num_blocks: int
    blocks_in_use: int
    running: list[dict[str, Any]]
    waiting: list[dict[str, Any]]
    pool: dict[str, list[int]]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    eos_token: str | None
    bos_token: str | None
    chat_template: str | None


_ERRORS = {400: "a parameter is missing, malformed or outside its range (`param` names it)",
           401: "the server has an API key and the request's Authorization header is missing or wrong",
           404: "no such model (`model_not_found`)",
           421: "the Host header is not a name of this server (`misdirected_request`; see --allowed-hosts)",
           429: "too many requests in flight; retry after the Retry-After header's seconds",
           500: "the engine failed on this request; the server goes on",
           503: "the server is shutting down, or its engine thread is gone"}
# what any route may answer before it runs: a body past the size limit (limits.BodyLimit), a Host the server
# does not go by (access.HostCheck)
_ANY_ROUTE = {400: "the request body is larger than the server's limit (`request_too_large`)", 421: _ERRORS[421]}
_ROUTES: dict[str, tuple[type[BaseModel], str | None, tuple[int, ...]]] = {
    # name: (200 body, another 200 content type, error statuses)
    "health": (Health, None, ()),
    "load": (Load, None, ()),
    "metrics": (None, METRICS_CONTENT, (401,)),
    "models": (ModelList, None, (401,)),
    "model": (ModelCard, None, (401, 404)),
    "completions": (CompletionResponse, SSE_CONTENT, (400, 401, 404, 429, 500, 503)),
    "chat": (ChatCompletionResponse, SSE_CONTENT, (400, 401, 404, 429, 500, 503)),
    "state": (EngineState, None, (401,)),
    "tokenize": (TokenizeResponse, None, (400, 401, 404)),
    "detokenize": (DetokenizeResponse, None, (400, 401, 404)),
    "tokenizer_info": (TokenizerInfo, None, (401,)),
}


_REF = "#/components/schemas/{model}"
_BODIES: set[type[BaseModel]] = set()  # the request bodies routes parse themselves: install_openapi adds them


def describe(name: str, body: tuple[type[BaseModel], ...] = ()) -> dict:
    """The route decorator's documentation arguments for route `name`, whose JSON body is one of `body`."""
    model, other_content, errors = _ROUTES[name]
    ok: dict = {"description": "OK"}
    if model is not None:
        ok["model"] = model
    if other_content is not None:
        schema = SSE_EVENT if other_content == SSE_CONTENT else {"type": "string"}
        ok["content"] = {other_content: {"schema": schema}}
    responses: dict = {200: ok}
    if name == "health":
        responses[503] = {"model": Health, "description": "shutting down, or the engine thread is gone"}
    for status in sorted({*errors, *_ANY_ROUTE}):
        described = _ERRORS[status] if status in errors else _ANY_ROUTE[status]
        responses[status] = {"model": ErrorBody, "description": described}
        if model is None:  # FastAPI would file the error under the route's own media type; it is JSON
            ref = {"$ref": _REF.format(model=ErrorBody.__name__)}
            responses[status] = {"description": described, "content": {"application/json": {"schema": ref}}}
    if 429 in errors:
        responses[429]["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
    kwargs: dict = {"responses": responses}
    if body:
        _BODIES.update(body)
        refs = [{"$ref": _REF.format(model=b.__name__)} for b in body]
        schema = refs[0] if len(refs) == 1 else {"anyOf": refs, "title": "Body"}
        kwargs["openapi_extra"] = {"requestBody": {"content": {"application/json": {"schema": schema}},
                                                   "required": True}}
    if model is None:  # the only 200 content is the other type (not application/json)
        kwargs["response_class"] = _media_response(other_content)
    return kwargs


def _media_response(media_type: str):
    from fastapi.responses import Response

    return type("MediaResponse", (Response,), {"media_type": media_type})


# properties whose upper bound is the loaded model's: (schema, property) -> what bounds it
_MODEL_BOUNDS = {("CompletionRequest", "max_tokens"): "len", ("CompletionRequest", "min_tokens"): "len",
                 ("ChatCompletionRequest", "max_tokens"): "len", ("ChatCompletionRequest", "min_tokens"): "len",
                 ("ChatCompletionRequest", "max_completion_tokens"): "len",
                 ("CompletionRequest", "prompt"): "id", ("CompletionRequest", "stop_token_ids"): "id",
                 ("ChatCompletionRequest", "stop_token_ids"): "id", ("DetokenizeRequest", "tokens"): "id"}


# text the tokenizer must encode (a character vocabulary knows only its characters)
_TEXTS = (("CompletionRequest", "prompt"), ("ChatMessage", "content"), ("TextPart", "text"), ("TokenizeText", "prompt"))


def install_openapi(app: FastAPI, ctx) -> None:
    """Replace app.openapi: FastAPI's schema, less the 422s, with the model's bounds written in."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            _, bodies = models_json_schema([(b, "validation") for b in sorted(_BODIES, key=lambda b: b.__name__)],
                                           ref_template=_REF)
            for name, definition in bodies.get("$defs", {}).items():
                components.setdefault(name, definition)
            # through FastAPI's own OpenAPI model, as get_openapi's output went: the same numbers, no nulls
            schema = jsonable_encoder(OpenAPI(**schema), by_alias=True, exclude_none=True)
            components = schema["components"]["schemas"]
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for model in ("CompletionRequest", "ChatCompletionRequest"):  # the one model served
                components[model]["properties"]["model"] = {"type": "string", "enum": [ctx.model_name]}
            for model in ("TokenizeText", "TokenizeChat", "DetokenizeRequest"):
                components[model]["properties"]["model"] = {
                    "anyOf": [{"type": "string", "enum": [ctx.model_name]}, {"type": "null"}]}
            limits = {"len": ctx.max_model_len, "id": ctx.vocab_size - 1}
            for (model, prop), kind in _MODEL_BOUNDS.items():
                if prop in components.get(model, {}).get("properties", {}):
                    _bound_integers(components[model]["properties"][prop], limits[kind])
            _add_examples(schema["paths"], ctx)
            pattern = _vocabulary_pattern(ctx.codec.tokenizer)
            if pattern is not None:  # a character vocabulary: a text may hold its characters only
                for model, prop in _TEXTS:
                    if prop in components.get(model, {}).get("properties", {}):
                        _pattern_strings(components[model]["properties"][prop], pattern)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _add_examples(paths: dict, ctx) -> None:
    """A plain and a streamed example request per generation route, valid for the loaded model (token
    ids every vocabulary has), so a schema-driven client also tries the text/event-stream answer."""
    text = ctx.codec.decode([0, 1])
    bodies = {"/v1/completions": {"model": ctx.model_name, "prompt": [0, 1], "max_tokens": 2},
              "/v1/chat/completions": {"model": ctx.model_name, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": text}]}}
    for path, body in bodies.items():
        content = paths[path]["post"]["requestBody"]["content"]["application/json"]
        content["examples"] = {"plain": {"value": body}, "streamed": {"value": {**body, "stream": True}}}


def _bound_integers(node, maximum: int) -> None:
    """Set `maximum` on every integer schema inside `node` (through anyOf / items)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = min(maximum, node.get("maximum", maximum))
        for value in node.values():
            _bound_integers(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _bound_integers(value, maximum)


def _vocabulary_pattern(tokenizer) -> str | None:
    """For a character vocabulary, the regular expression of its texts: ^[chars]*$ (every character as a
    \\uXXXX escape, which both JSON Schema's ECMA-262 and Python's re read); None for any other tokenizer,
    or a vocabulary with a character outside the Basic Multilingual Plane (no \\uXXXX for it)."""
    chars = getattr(tokenizer, "chars", None)
    if tokenizer.kind != "char" or chars is None or any(ord(c) > 0xFFFF for c in chars):
        return None
    return "^[" + "".join(f"\\u{ord(c):04x}" for c in chars) + "]*$"


def _pattern_strings(node, pattern: str) -> None:
    """Set `pattern` on every string schema inside `node` that is not an enum."""
    if isinstance(node, dict):
        if node.get("type") == "string" and "enum" not in node and "const" not in node:
            node["pattern"] = pattern
        for value in node.values():
            _pattern_strings(value, pattern)
    elif isinstance(node, list):
        for value in node:
            _pattern_strings(value, pattern)
