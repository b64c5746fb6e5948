"""Exercise answered by the project's own code: server.text.IncrementalText."""

from mini_transformer.server.text import IncrementalText

__all__ = ["IncrementalText"]
