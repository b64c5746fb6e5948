"""Exercise answered by the project's engine/structured.py: xgrammar compiled for the choices over the
toy vocabulary (StructuredOutputManager), the matcher walked along the generated text one character at a
time, its bitmask filled (GrammarMasks' buffer layout) and read back."""

import xgrammar as xgr

from mini_transformer.engine.structured import StructuredOutputManager
from mini_transformer.inference.structured import StructuredOutput


def choice_mask(vocab, choices, generated, eos_id):
    matcher = StructuredOutputManager(list(vocab), len(vocab), eos_id).matcher(StructuredOutput(choice=tuple(choices)))
    for c in generated:
        assert matcher.accept_token(vocab.index(c))
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    matcher.fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return [bool((words[t // 32] >> (t % 32)) & 1) for t in range(len(vocab))]


def pack_bitmask(allowed):
    import torch

    bitmask = xgr.allocate_token_bitmask(1, len(allowed))
    logits = torch.zeros(1, len(allowed))
    bitmask.zero_()
    for t, ok in enumerate(allowed):  # set bit by bit, then let xgrammar's own apply confirm the layout
        if ok:
            word = bitmask[0, t // 32].item() & 0xFFFFFFFF | (1 << (t % 32))
            bitmask[0, t // 32] = word - 2**32 if word >= 2**31 else word
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=len(allowed))
    assert [bool(x) for x in torch.isfinite(logits[0])] == [bool(a) for a in allowed]
    return bitmask[0].tolist()
