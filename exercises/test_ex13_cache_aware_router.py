"""Grader for ex13_cache_aware_router: the radix tree's shape, its longest match and the router's choice,
against a reference that keeps every prompt each worker was sent in a plain list and compares them token by
token (no tree), and against hand-built cases for each threshold."""

from __future__ import annotations

import random

EXERCISE = "ex13_cache_aware_router"


class Reference:
    """What the tree must answer, from the prompts themselves."""

    def __init__(self):
        self.sent: dict[str, list[tuple[int, ...]]] = {}

    def insert(self, tokens, worker):
        self.sent.setdefault(worker, []).append(tuple(tokens))

    def match(self, tokens):
        def common(p):
            n = 0
            while n < min(len(p), len(tokens)) and p[n] == tokens[n]:
                n += 1
            return n

        best = {w: max(common(p) for p in prompts) for w, prompts in self.sent.items()}
        n = max(best.values(), default=0)
        return (n, {w for w, m in best.items() if m == n}) if n else (0, set())

    def route(self, tokens, loads, cache_threshold, abs_threshold, rel_threshold):
        most, least = max(loads.values()), min(loads.values())
        order = sorted(loads, key=lambda w: (loads[w], list(loads).index(w)))
        if most - least > abs_threshold and most > least * rel_threshold:
            worker, why = order[0], "load_balance"
        else:
            n, holders = self.match(tokens)
            live = [w for w in order if w in holders]
            if tokens and n / len(tokens) > cache_threshold and live:
                worker, why = live[0], "cache_hit"
            else:
                worker, why = order[0], "low_match"
        self.insert(tokens, worker)
        return worker, why


def walk(node):
    for child in node.children.values():
        yield node, child
        yield from walk(child)


def test_insert_splits_an_edge_where_a_prompt_leaves_it(solution):
    tree = solution.RadixTree()
    tree.insert((1, 2, 3, 4), "A")
    assert list(tree.root.children) == [1] and tree.root.children[1].key == (1, 2, 3, 4), "one edge, four tokens"
    tree.insert((1, 2, 5), "B")
    head = tree.root.children[1]
    assert head.key == (1, 2) and head.workers == {"A", "B"}, "(1 2 3 4) splits into (1 2) and (3 4)"
    assert {k: (c.key, c.workers) for k, c in head.children.items()} == {3: ((3, 4), {"A"}), 5: ((5,), {"B"})}
    tree.insert((1, 2), "C")
    assert tree.nodes() == 3 and head.workers == {"A", "B", "C"}, "a prompt ending at a node adds no node"
    tree.insert((1,), "D")
    assert tree.root.children[1].key == (1,) and tree.root.children[1].children[2].key == (2,), \
        "a prompt ending inside an edge splits it too"
    assert tree.nodes() == 4


def test_match_counts_the_tokens_matched_inside_an_edge(solution):
    tree = solution.RadixTree()
    tree.insert((1, 2, 3, 4), "A")
    assert tree.match((1, 2, 3, 9)) == (3, {"A"}), "the match ends in the middle of the edge (1 2 3 4)"
    assert tree.match((1, 2)) == (2, {"A"})
    assert tree.match((9, 1, 2)) == (0, set()), "no first token in common: no match"
    tree.insert((1, 2, 5), "B")
    assert tree.match((1, 2)) == (2, {"A", "B"})
    assert tree.match((1, 2, 5, 6)) == (3, {"B"})
    assert tree.match((1, 2, 3, 4, 5)) == (4, {"A"})
    assert tree.match(()) == (0, set())


def test_the_tree_stays_compressed(solution):
    rng = random.Random(1)
    tree = solution.RadixTree()
    bases = [tuple(rng.randrange(50) for _ in range(30)) for _ in range(4)]
    for i in range(60):
        before = tree.nodes()
        tail = tuple(rng.randrange(50) for _ in range(rng.randint(0, 8)))
        tree.insert(rng.choice(bases)[:rng.randint(1, 30)] + tail, f"w{i % 3}")
        assert tree.nodes() - before <= 2, "an insert adds at most a split and a leaf (a node per token is a trie)"
    for parent, child in walk(tree.root):
        assert child.key, "only the root has an empty key"
        assert parent.children[child.key[0]] is child, "children are keyed by their first token"
        assert parent is tree.root or child.workers <= parent.workers, "a worker covering a node covers its parent"


def traffic(rng, count):
    """Prompts over a few shared system prompts, with tails: what a cache-aware router is for."""
    systems = [tuple(rng.randrange(40) for _ in range(rng.randint(3, 20))) for _ in range(5)]
    for _ in range(count):
        tail = tuple(rng.randrange(40) for _ in range(rng.randint(0, 12)))
        yield rng.choice(systems)[:rng.randint(0, 20)] + tail


def test_match_equals_the_longest_common_prefix(solution):
    rng = random.Random(2)
    tree, ref = solution.RadixTree(), Reference()
    for i, prompt in enumerate(traffic(rng, 300)):
        assert tree.match(prompt) == ref.match(prompt), f"request {i}: {prompt}"
        worker = rng.choice("ABCD")
        tree.insert(prompt, worker)
        ref.insert(prompt, worker)


def test_imbalance_needs_both_thresholds(solution):
    assert solution.imbalanced({"A": 70, "B": 0}, 64, 1.5), "70 - 0 > 64 and 70 > 0 × 1.5"
    assert not solution.imbalanced({"A": 60, "B": 0}, 64, 1.5), "60 - 0 is not more than 64"
    assert not solution.imbalanced({"A": 300, "B": 220}, 64, 1.5), "300 is not more than 220 × 1.5"
    assert solution.imbalanced({"A": 340, "B": 220, "C": 250}, 64, 1.5), "busiest against idlest"
    assert not solution.imbalanced({"A": 64, "B": 0}, 64, 1.5), "the absolute threshold is strict"
    assert not solution.imbalanced({"A": 150, "B": 100}, 10, 1.5), "the relative threshold is strict"


def test_route_takes_the_longest_match_above_the_threshold(solution):
    tree = solution.RadixTree()
    tree.insert(tuple(range(10)), "A")
    tree.insert((50, 51, 52), "B")
    loads = {"A": 5, "B": 0}
    assert solution.route(tree, tuple(range(8)) + (99, 98), loads) == ("A", "cache_hit"), "8 of 10 tokens held by A"
    assert solution.route(tree, (0, 1, 2) + tuple(range(70, 77)), loads) == ("B", "low_match"), \
        "a match of exactly 0.3 of the prompt is not more than the threshold: the least loaded worker"
    assert solution.route(tree, (0, 1, 2, 3) + tuple(range(80, 86)), loads) == ("A", "cache_hit"), "0.4 > 0.3"
    assert solution.route(tree, (), loads) == ("B", "low_match"), "an empty prompt matches nothing"


def test_route_balances_first_and_still_learns(solution):
    tree = solution.RadixTree()
    tree.insert(tuple(range(10)), "A")
    prompt = tuple(range(12))
    assert solution.route(tree, prompt, {"A": 100, "B": 20}) == ("B", "load_balance"), "out of balance: idlest"
    assert tree.match(prompt) == (12, {"B"}), "the tree learns where a load-balanced prompt went"
    assert solution.route(tree, prompt, {"A": 0, "B": 3}) == ("B", "cache_hit"), "... and sends it there again"
    assert solution.route(tree, tuple(range(9)), {"A": 2, "B": 1, "C": 0}) == ("B", "cache_hit"), \
        "A and B both hold it: the less loaded of the two, not the idlest overall"
    assert solution.route(tree, tuple(range(9)), {"C": 0, "D": 0}) == ("C", "low_match"), \
        "the holders are gone: the least loaded live worker, the first of a tie"


def test_route_matches_the_reference_on_random_traffic(solution):
    rng = random.Random(3)
    tree, ref = solution.RadixTree(), Reference()
    workers = ["w0", "w1", "w2"]
    for i, prompt in enumerate(traffic(rng, 300)):
        loads = {w: rng.choice([0, 1, 2, 5, 40, 90]) for w in workers}
        threshold = rng.choice([0.0, 0.3, 0.5])
        expected = ref.route(prompt, loads, threshold, 64, 1.5)
        assert solution.route(tree, prompt, loads, threshold) == expected, f"request {i}: {prompt}, loads {loads}"
