"""Exercise answered the way vllm-router's `cache_aware` policy decides (src/policies/cache_aware.rs, over
its multi-tenant radix tree src/tree.rs), written out here: the project routes with vllm-router itself
and has no router of its own. Two differences, both stated in the exercise: the tree holds token ids
instead of characters, and a tie among the workers holding the longest match goes to the least loaded
one (the Rust tree returns whichever worker it last cached at that node)."""

from __future__ import annotations


class Node:
    def __init__(self, key=()):
        self.key = tuple(key)
        self.children = {}
        self.workers = set()


def _common(a, b) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


class RadixTree:
    def __init__(self):
        self.root = Node()

    def insert(self, tokens, worker) -> None:
        node, rest = self.root, tuple(tokens)
        while rest:
            child = node.children.get(rest[0])
            if child is None:  # nothing spells the rest yet: one new leaf holds all of it
                leaf = Node(rest)
                leaf.workers.add(worker)
                node.children[rest[0]] = leaf
                return
            shared = _common(rest, child.key)
            if shared < len(child.key):  # the prompt leaves this edge midway: split it there
                head = Node(child.key[:shared])
                head.workers = set(child.workers)
                child.key = child.key[shared:]
                head.children[child.key[0]] = child
                node.children[rest[0]] = head
                child = head
            child.workers.add(worker)
            node, rest = child, rest[shared:]

    def match(self, tokens):
        node, rest, matched = self.root, tuple(tokens), 0
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            shared = _common(rest, child.key)
            if shared < len(child.key):  # ends inside this edge: its workers still cover what matched
                matched, node = matched + shared, child
                break
            matched, node, rest = matched + shared, child, rest[shared:]
        return (matched, set(node.workers)) if matched else (0, set())

    def nodes(self) -> int:
        stack, count = list(self.root.children.values()), 0
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count


def imbalanced(loads, abs_threshold, rel_threshold) -> bool:
    most, least = max(loads.values()), min(loads.values())
    return most - least > abs_threshold and most > least * rel_threshold


def _least_loaded(loads, among) -> str:
    return min((w for w in loads if w in among), key=lambda w: loads[w])  # min keeps the first of a tie


def route(tree, tokens, loads, cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5):
    if imbalanced(loads, balance_abs_threshold, balance_rel_threshold):
        worker, why = _least_loaded(loads, loads), "load_balance"
    else:
        matched, holders = tree.match(tokens)
        live = [w for w in loads if w in holders]
        if tokens and matched / len(tokens) > cache_threshold and live:
            worker, why = _least_loaded(loads, live), "cache_hit"
        else:
            worker, why = _least_loaded(loads, loads), "low_match"
    tree.insert(tokens, worker)
    return worker, why


__all__ = ["Node", "RadixTree", "imbalanced", "route"]
