"""Exercise (docs/13 section 3): the cache-aware router's choice, made the way SGLang's router and
vllm-router's `cache_aware` policy make it. A radix tree remembers which worker was sent which prompt; a
request goes to the worker that holds its longest prefix, unless the workers' loads are out of balance.

Fill in `RadixTree.insert`, `RadixTree.match`, `imbalanced` and `route`, then grade them:

    uv run pytest exercises/test_ex13_cache_aware_router.py

The tree is a radix tree (a compressed trie) over token ids: an edge carries a run of tokens, not a single
one, so every node below the root either ends a prompt or branches. Each node also records the workers
whose prompts cover all of it. The tree is "approximate": it records where prompts were SENT, not what a
worker's KV cache still holds (the worker may have evicted those blocks long ago).

    insert (1 2 3 4) for A      root ── (1 2 3 4){A}
    insert (1 2 5) for B        root ── (1 2){A, B} ─┬─ (3 4){A}
                                                     └─ (5){B}
    match (1 2 3 9)             (3, {A}): three tokens match, and only A's prompts reach that far
"""

from __future__ import annotations


class Node:
    def __init__(self, key: tuple[int, ...] = ()):
        self.key = key  # the edge's tokens, from the parent down to this node (the root's is empty)
        self.children: dict[int, Node] = {}  # a child's first token -> the child: siblings never share one
        self.workers: set[str] = set()  # the workers that were sent a prompt covering this whole node


class RadixTree:
    def __init__(self):
        self.root = Node()

    def insert(self, tokens: tuple[int, ...], worker: str) -> None:
        """Record that `worker` was sent `tokens`."""
        # TODO 1: walk down from the root as far as the tree already spells `tokens`, recording the worker on
        #         every node it covers; where the prompt leaves an edge in the middle, that edge must become
        #         two nodes; whatever is left of the prompt hangs below as one new node
        raise NotImplementedError("TODO: exercise ex13_cache_aware_router, RadixTree.insert")

    def match(self, tokens: tuple[int, ...]) -> tuple[int, set[str]]:
        """(n, workers): the longest prefix of `tokens` that the tree spells, n tokens long, and the workers
        whose prompts cover all n of them. (0, set()) when not even the first token matches."""
        # TODO 2: walk down as far as the tokens agree with the edges; think about where a match can end
        #         and whose prompts reach that far
        raise NotImplementedError("TODO: exercise ex13_cache_aware_router, RadixTree.match")

    def nodes(self) -> int:
        """How many nodes hang below the root."""
        stack, count = list(self.root.children.values()), 0
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count


def imbalanced(loads: dict[str, int], abs_threshold: int, rel_threshold: float) -> bool:
    """Are the loads (worker -> requests in flight) so uneven that the cache must give way to balance?"""
    # TODO 3: the router's two thresholds, one absolute and one relative, compare the busiest worker with
    #         the idlest (docs/13 section 3 says how they combine)
    raise NotImplementedError("TODO: exercise ex13_cache_aware_router, imbalanced")


def route(tree: RadixTree, tokens: tuple[int, ...], loads: dict[str, int], cache_threshold: float = 0.3,
          balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5) -> tuple[str, str]:
    """Choose the worker for a prompt: (worker, why). `loads` lists the live workers in the router's order
    with their requests in flight; a tie goes to the earliest of them. The defaults are vllm-router's.

    why = "load_balance": the loads are out of balance, so the least loaded worker, whatever its cache;
          "cache_hit":    the longest match covers MORE than cache_threshold of the prompt: the least
                          loaded of the live workers holding it;
          "low_match":    otherwise (a short match, or none of its holders is live): the least loaded worker.
    Whichever it is, the tree then learns that the chosen worker was sent `tokens`."""
    # TODO 4: decide in the order above, as a share of the prompt's tokens, and keep the tree up to date
    raise NotImplementedError("TODO: exercise ex13_cache_aware_router, route")
