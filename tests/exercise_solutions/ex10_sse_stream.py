"""Exercise 10 answered by the project's own code: server/app.py's sse and server/text.py's IncrementalText
(skipped until the server of docs/07 is on this branch)."""

import pytest

pytest.importorskip("mini_transformer.server.text", reason="the OpenAI-compatible server (docs/07) is not here yet")

from mini_transformer.server.app import sse as sse_event  # noqa: E402
from mini_transformer.server.text import IncrementalText  # noqa: E402

__all__ = ["IncrementalText", "sse_event"]
