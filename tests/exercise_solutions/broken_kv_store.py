"""Wrong answers to ex11_kv_store_lookup (docs/11's "break it" experiments), each of which its grader must reject."""

from __future__ import annotations

import types

from . import ex11_kv_store_lookup as right


def _variant(**overrides):
    module = types.SimpleNamespace(**{name: getattr(right, name) for name in right.__all__})
    for name, fn in overrides.items():
        setattr(module, name, fn)
    return module


def _no_token_guard(entry, fingerprint, token_ids):
    """Trusts the key: a collision serves another prefix's K/V."""
    return entry.fingerprint == fingerprint and right.checksum(entry.kv) == entry.checksum


def _keys_with_the_last_token(tokens, block_size, fingerprint):
    """Looks up the block that holds the last token: a fully stored prompt has no logits to sample from."""
    return right.chain_keys(tokens + [0], block_size, fingerprint)


def _unchained_keys(tokens, block_size, fingerprint):
    """Each block hashed alone: the same 4 tokens after another prefix get the same key."""
    n = (len(tokens) - 1) // block_size
    return [fingerprint + right.chain_digest(b"", tokens[i * block_size:(i + 1) * block_size]) for i in range(n)]


def _lookup_jumping_gaps(tokens, block_size, fingerprint, tiers):
    """Keeps every block found, past a missing one."""
    run = []
    for i, key in enumerate(right.chain_keys(tokens, block_size, fingerprint)):
        block = tuple(tokens[i * block_size:(i + 1) * block_size])
        for t, tier in enumerate(tiers):
            if key in tier and right.entry_ok(tier[key], fingerprint, block):
                run.append((t, tier[key]))
                break
    return run, 0


BROKEN_KV_STORE = {
    "ex11_kv_store_lookup": {
        "no token-id guard": _variant(entry_ok=_no_token_guard),
        "the last token's block looked up": _variant(chain_keys=_keys_with_the_last_token),
        "keys not chained": _variant(chain_keys=_unchained_keys),
        "the run jumps gaps": _variant(lookup=_lookup_jumping_gaps),
    },
}
