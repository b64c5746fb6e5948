"""The OpenAI-compatible HTTP server around the serving engine, and its live page.

    mini-transformer serve --checkpoint DIR [--port 8000]

`build_context` loads a checkpoint and starts nothing; `create_app` makes the FastAPI app (the engine
loop thread starts and stops with it); `serve` runs it under uvicorn. `Limits` bounds what one request
may cost (build_context's `limits`).
"""

from .app import ServerContext, create_app
from .limits import Limits
from .run import build_context, serve

__all__ = ["Limits", "ServerContext", "build_context", "create_app", "serve"]
