"""Helpers several test files share (tests/ is on sys.path under pytest, as for server_support.py)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.tokenizer import CharTokenizer

TEXT = "the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs!"


def small_lm(vocab_size: int, max_seq_len: int, pos_emb="learned", n_kv_heads=None, backend="naive") -> TransformerLM:
    """A 2-layer, d_model 32 model in eval mode: GPT-2 style, or Llama style (RMSNorm, SwiGLU) with RoPE.
    init_std 0.2, larger than usual: logits that differ visibly from token to token."""
    cfg = TransformerConfig(
        vocab_size=vocab_size, d_model=32, n_heads=4, n_kv_heads=n_kv_heads, n_layer=2, d_ff=64,
        max_seq_len=max_seq_len, pos_emb=pos_emb, attn_backend=backend, init_std=0.2,
        norm="rmsnorm" if pos_emb == "rope" else "layernorm", ffn="swiglu" if pos_emb == "rope" else "gelu",
    )
    return TransformerLM(cfg).eval()


def save_char_checkpoint(path, max_seq_len: int, *, text: str = TEXT, seed: int = 0, preset: str = "tiny"):
    """A seeded model over `text`'s characters (large init, so greedy text varies), saved with its tokenizer:
    (path, model in eval, tokenizer)."""
    tokenizer = CharTokenizer.train(text)
    cfg = TransformerConfig.from_preset(preset, vocab_size=tokenizer.vocab_size, max_seq_len=max_seq_len, init_std=0.3)
    torch.manual_seed(seed)
    model = TransformerLM(cfg)
    model.save_pretrained(path)
    tokenizer.save(path)
    return path, model.eval(), tokenizer


def edit_files(path, hf_model, *, config=None, state=None):
    """Save `hf_model` to `path`, then let `config(dict)` / `state(dict)` edit what was written."""
    hf_model.save_pretrained(path)
    if config is not None:
        raw = json.loads((path / "config.json").read_text())
        config(raw)
        (path / "config.json").write_text(json.dumps(raw))
    if state is not None:
        tensors = load_file(str(path / "model.safetensors"))
        state(tensors)
        save_file(tensors, str(path / "model.safetensors"))


def comparable_weights(model, reference):
    """(name, model's tensor, reference's tensor) for every weight, leaving out the key bias: softmax
    ignores a shift shared by a whole row of scores, so its true gradient is exactly zero and it receives
    only rounding noise, which Adam (dividing by sqrt(v)) turns into lr-sized steps that depend on the
    summation order."""
    cfg = reference.config
    q_rows, k_rows = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    got = model.state_dict()
    for name, tensor in reference.state_dict().items():
        other = got[name]
        if name.endswith("W_qkv.bias"):
            keep = torch.ones(len(tensor), dtype=torch.bool)
            keep[q_rows : q_rows + k_rows] = False
            tensor, other = tensor[keep], other[keep]
        yield name, other, tensor


def assert_same_weights(model, reference) -> None:
    """Equal within fp32 tolerance, the key bias left out (comparable_weights says why)."""
    for name, other, tensor in comparable_weights(model, reference):
        torch.testing.assert_close(other, tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# ---- the Hugging Face import tests (test_checkpoint.py, test_hf_families.py) ----------------------------
HF_VOCAB = 61  # the vocabulary of the tiny transformers models those tests build


def perturbed(hf_model):
    """Move every parameter off its init (norm weights off 1, biases off 0) so each one matters."""
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf_model.eval()


def left_padded_batch(T=12):
    """Three rows of HF_VOCAB ids: one unpadded, one with 4 pads, one with only two real tokens."""
    ids = torch.randint(0, HF_VOCAB, (3, T))
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :T - 2] = 0
    return ids, mask


def max_logit_diff(hf_model, ours, ids, mask=None) -> float:
    """Max |ours - HF| over real positions. HF gets explicit position ids (real tokens count from 0, as
    its generate() does); ours derives them from the mask itself."""
    hf_kwargs = {}
    if mask is not None:
        hf_kwargs = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        expected = hf_model(ids, **hf_kwargs).logits
        got, _ = ours(ids, attention_mask=mask)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    return (got - expected)[real].abs().max().item()


def padded_prompts(pad_lengths: list[int], prompt_len: int, vocab: int,
                   pad_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (B, prompt_len) and a mask (1 = real) with pad_lengths[b] leading zeros in row b.
    With `pad_id`, padded slots hold pad_id and real slots never do (as a tokenizer's padding would)."""
    if pad_id is None:
        idx = torch.randint(0, vocab, (len(pad_lengths), prompt_len))
    else:  # vocab - 1 ids, shifted past pad_id
        idx = torch.randint(0, vocab - 1, (len(pad_lengths), prompt_len))
        idx += idx >= pad_id
    mask = torch.ones(len(pad_lengths), prompt_len, dtype=torch.long)
    for row, n_pad in enumerate(pad_lengths):
        mask[row, :n_pad] = 0
    if pad_id is not None:
        idx = idx.masked_fill(mask == 0, pad_id)
    return idx, mask


def write_word_corpus(directory):
    """A few thousand characters of word-like text, the same in every run: the corpus of the multi-process
    training tests (test_parallel_train.py, test_parallel_pp.py)."""
    gen = torch.Generator().manual_seed(0)
    words = ["the", "king", "shall", "speak", "and", "we", "hear", "him", "now", "good", "lord", "my"]
    text = " ".join(words[i] for i in torch.randint(len(words), (1500,), generator=gen).tolist())
    path = directory / "corpus.txt"
    path.write_text(text)
    return path



def on_threads(count: int, fn, *args):
    """fn(*args) at `count` torch threads, the count restored after: the C++ kernels must give the same bits
    whatever the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)
