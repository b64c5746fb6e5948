"""Wrong answers to ex13_cache_aware_router (docs/13's "break it" experiments and the slips a learner is
likely to make), each a whole answer with ONE mistake that its grader must reject."""

from __future__ import annotations

import types

from . import ex13_cache_aware_router as right


def _answer(**overrides):
    module = types.SimpleNamespace(**{name: getattr(right, name) for name in right.__all__})
    for name, value in overrides.items():
        setattr(module, name, value)
    return module


def _either_threshold(loads, abs_threshold, rel_threshold):
    """Balances as soon as ONE threshold is crossed: a few requests of difference already break affinity."""
    most, least = max(loads.values()), min(loads.values())
    return most - least > abs_threshold or most > least * rel_threshold


def _routes_with(imbalanced=right.imbalanced, at_threshold=False, learn_balanced=True, holders_only=True):
    def route(tree, tokens, loads, cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5):
        least = min(loads, key=lambda w: loads[w])
        if imbalanced(loads, balance_abs_threshold, balance_rel_threshold):
            if learn_balanced:
                tree.insert(tokens, least)
            return least, "load_balance"
        matched, holders = tree.match(tokens)
        share = matched / len(tokens) if tokens else 0.0
        live = [w for w in loads if w in holders] if holders_only else list(loads)
        if live and (share >= cache_threshold if at_threshold else share > cache_threshold) and tokens:
            worker, why = min(live, key=lambda w: loads[w]), "cache_hit"
        else:
            worker, why = least, "low_match"
        tree.insert(tokens, worker)
        return worker, why

    return route


class _WholeEdgeTree(right.RadixTree):
    """Counts a match only up to the last whole edge: (1 2 3 9) against the edge (1 2 3 4) matches nothing."""

    def match(self, tokens):
        node, rest, matched = self.root, tuple(tokens), 0
        while rest and (child := node.children.get(rest[0])) and rest[:len(child.key)] == child.key:
            matched, node, rest = matched + len(child.key), child, rest[len(child.key):]
        return (matched, set(node.workers)) if matched else (0, set())


BROKEN_CLUSTER = {
    "ex13_cache_aware_router": {
        "either threshold imbalances": _answer(imbalanced=_either_threshold,
                                               route=_routes_with(imbalanced=_either_threshold)),
        "a match at the threshold is a hit": _answer(route=_routes_with(at_threshold=True)),
        "matches end at whole edges": _answer(RadixTree=_WholeEdgeTree),
        "load-balanced requests not learned": _answer(route=_routes_with(learn_balanced=False)),
        "a hit goes to the idlest worker": _answer(route=_routes_with(holders_only=False)),
    },
}
