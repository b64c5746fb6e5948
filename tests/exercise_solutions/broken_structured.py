"""Wrong answers for exercise ex12_choice_mask (docs/12: the token mask of a `choice` constraint), each a whole answer
with ONE mistake a learner is likely to make; docs/12's "break it" list names the same mistakes."""

from __future__ import annotations

import types


def _ex17(*, eos="whole", spanning=True, empty=False, bit_order="low", signed=True):
    def choice_mask(vocab, choices, generated, eos_id):
        out = []
        for t, token in enumerate(vocab):
            if t == eos_id:
                whole = generated in choices
                out.append({"whole": whole, "always": True, "never": False,
                            "prefix": any(c.startswith(generated) for c in choices)}[eos])
                continue
            piece = token if spanning else token[:1]  # spanning=False: only the token's first character
            ok = any(c.startswith(generated + piece) for c in choices)
            out.append(ok and (empty or token != ""))
        return out

    def pack_bitmask(allowed):
        words = [0] * (-(-len(allowed) // 32))
        for t, ok in enumerate(allowed):
            if ok:
                words[t // 32] |= 1 << (t % 32 if bit_order == "low" else 31 - t % 32)
        return [w - 2**32 if signed and w >= 2**31 else w for w in words]

    return types.SimpleNamespace(choice_mask=choice_mask, pack_bitmask=pack_bitmask)


BROKEN_STRUCTURED = {
    "ex12_choice_mask": {
        "EOS always allowed": _ex17(eos="always"),
        "EOS never allowed": _ex17(eos="never"),
        "EOS allowed whenever the text is a prefix (not a whole choice)": _ex17(eos="prefix"),
        "only a token's first character checked (tokens that span past a choice let through)": _ex17(spanning=False),
        "the empty token allowed": _ex17(empty=True),
        "bits numbered from the top of the word": _ex17(bit_order="high"),
        "words left unsigned (bit 31 gives a value >= 2**31)": _ex17(signed=False),
    },
}
