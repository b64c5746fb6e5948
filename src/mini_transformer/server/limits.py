"""What one request may cost, and where its costly work runs: off the event loop, or bounded there.

The event loop serves every client at once (/health, /metrics, each open stream), so a request that
makes it tokenise megabytes or compile a huge grammar would stall them all. So:

- a body past `max_body_bytes` is refused (a 400 naming the limit) as it arrives, before anything
  parses it (`BodyLimit`, an ASGI middleware);
- a body within it is parsed and validated on a worker (`Workers.parse`), not on the event loop as
  FastAPI would: a body of a million token ids takes seconds to validate, a deeply nested one is refused
  by the parser's own depth limit;
- a prompt text is refused past `max_prompt_bytes` before it is tokenised;
- a structured-output constraint is refused past `max_schema_bytes`, `max_schema_depth` nesting levels
  or `max_guided_choices` options before xgrammar sees it;
- what is left (parsing, tokenising, compiling the grammar) runs on small thread pools (`Workers`):
  xgrammar and the tokenizers release the GIL, the validators yield it at Python's switch interval, so
  the loop keeps answering; a compile that runs past `grammar_compile_timeout_s` is a 400 naming that limit.

Each limit is a serve option (cli/serve_command.py); docs/07 §3 says why.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException

from .._checks import positive_int, positive_number
from .errors import invalid_request
from .protocol import ErrorResponse


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 2 * 2**20  # a request body, as sent: bounds the JSON parsing left on the event loop
    max_prompt_bytes: int = 2**20  # one prompt text (or all messages' texts), UTF-8, before tokenising
    max_schema_bytes: int = 64 * 2**10  # a JSON schema, regex or grammar, as text
    max_schema_depth: int = 64  # nesting of objects and arrays in a JSON schema
    max_guided_choices: int = 1024  # options of a guided_choice
    grammar_compile_timeout_s: float = 10.0  # a compile still running after this is refused
    workers: int = 2  # threads for tokenising, and as many for compiling: heavy requests at once

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_bytes", "max_schema_bytes", "max_schema_depth",
                     "max_guided_choices", "workers"):
            positive_int(name, getattr(self, name))
        positive_number("grammar_compile_timeout_s", self.grammar_compile_timeout_s)


class Workers:
    """The bounded pools the HTTP handlers hand their heavy work to: one for tokenising, one for compiling
    grammars, so compiles that run long (they cannot be interrupted) never hold up tokenising."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="http-work")
        self.compile_pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="grammar-compile")

    async def run(self, fn, *args):
        """fn(*args) on a worker thread; the event loop serves others meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def parse(self, adapter: TypeAdapter, request: Request):
        """The request's JSON body validated as `adapter`'s type, on a worker thread: the 400s FastAPI's
        own parsing would give (errors.py words them), without holding up the event loop."""
        raw = await request.body()  # as it arrived; BodyLimit has bounded its size
        return await self.run(parse_body, adapter, raw, request.headers.get("content-type"))

    async def compile(self, what: str, fn, *args):
        """fn(*args) on a compile thread, or a 400 naming `what` once it has run the compile timeout (the
        thread finishes on its own: xgrammar cannot be interrupted, but the pool bounds such threads)."""
        seconds = self.limits.grammar_compile_timeout_s
        try:
            return await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self.compile_pool, fn, *args), seconds)
        except TimeoutError:
            raise ErrorResponse(400, f"{what}: compiling it took longer than the server's limit of {seconds:g} s "
                                     "(--grammar-compile-timeout); send a smaller constraint", param=what) from None

    def shutdown(self) -> None:
        """Queued work is dropped; work already running (a compile, the first one's import of xgrammar) is
        waited for, so no thread of the server outlives it."""
        for pool in (self.pool, self.compile_pool):
            pool.shutdown(wait=True, cancel_futures=True)


class _PausedCollector:
    """Python's cyclic garbage collector off while any body is parsed. A large body becomes up to a
    million lists or objects, and while they are made the collector would walk every tracked object of
    the process several times, each walk holding the GIL (the event loop waits). Paused, nothing walks
    them; a refused request's objects are freed by reference counting as it ends."""

    def __init__(self):
        self.lock, self.parsing, self.resume = threading.Lock(), 0, False

    def __enter__(self):
        with self.lock:
            if self.parsing == 0:
                self.resume = gc.isenabled()  # whoever turned it off (a test, an embedder) keeps it off
                gc.disable()
            self.parsing += 1

    def __exit__(self, *exc):
        with self.lock:
            self.parsing -= 1
            if self.parsing == 0 and self.resume:
                gc.enable()


PAUSED_COLLECTOR = _PausedCollector()


def parse_body(adapter: TypeAdapter, raw: bytes, content_type: str | None):
    """`raw` parsed and validated in one pass (pydantic's JSON parser, whose nesting limit refuses a deep
    body before it recurses); a body sent as another content type than JSON is not read as JSON."""
    media = (content_type or "application/json").partition(";")[0].strip().lower()
    if not (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))):
        raise ErrorResponse(400, f"the body must be a JSON object (Content-Type: application/json), got "
                                 f"Content-Type {content_type!r}")
    try:
        with PAUSED_COLLECTOR:
            return adapter.validate_json(raw)
    except ValidationError as err:  # without the inputs: a rejected value may be megabytes, and never read
        raise invalid_request(err.errors(include_url=False, include_input=False)) from None


def check_prompt_bytes(limits: Limits, text: str, param: str) -> None:
    """A 400 naming `param` for a prompt text too long to be worth tokenising."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_prompt_bytes:
        raise ErrorResponse(400, f"{param} is {size} bytes; the server's limit is {limits.max_prompt_bytes} "
                                 "(--max-prompt-bytes)", param=param, code="prompt_too_large")


def check_constraint_size(limits: Limits, name: str, value) -> None:
    """A 400 naming the field for a constraint past the size limits, before anything compiles it."""
    if name == "guided_choice" and isinstance(value, list | tuple):
        if len(value) > limits.max_guided_choices:
            raise ErrorResponse(400, f"guided_choice has {len(value)} options; the server's limit is "
                                     f"{limits.max_guided_choices} (--max-guided-choices)", param=name)
    text = value if isinstance(value, str) else _as_json(value)
    if len(text.encode("utf-8", "surrogatepass")) > limits.max_schema_bytes:
        raise ErrorResponse(400, f"{name} is larger than the server's limit of {limits.max_schema_bytes} bytes "
                                 "(--max-schema-bytes)", param=name)
    if name in ("guided_json", "response_format"):
        depth = nesting_depth(value if not isinstance(value, str) else _loads(text, name))
        if depth > limits.max_schema_depth:
            raise ErrorResponse(400, f"{name} is nested {depth} levels deep; the server's limit is "
                                     f"{limits.max_schema_depth} (--max-schema-depth)", param=name)


def nesting_depth(value) -> int:
    """How deep objects and arrays nest in a JSON value (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in children)
    return deepest


def _as_json(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return str(value)


def _loads(text: str, name: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise ErrorResponse(400, f"{name} nests too deeply to read", param=name) from None
    except ValueError:
        return None  # not JSON: the constraint's own check names that


class BodyLimit:
    """ASGI middleware: a request body past `max_bytes` gets a 400 before anything reads it whole,
    whether it announces its length (Content-Length) or streams it in chunks."""

    def __init__(self, app, max_bytes: int, metrics):
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen = 0

        async def counted():  # a chunked body: the route's body reading raises, its error handler answers
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(400, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes (--max-body-bytes)"

    async def _refuse(self, send) -> None:
        self.metrics.rejected.labels("400").inc()
        body = json.dumps(ErrorResponse(400, self._message(), code="request_too_large").body()).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
