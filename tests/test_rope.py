"""RoPE and the other position schemes: properties of the rotation, the interleaved layout as a
reference, the 2017 sinusoidal formula, and models built with each `pos_emb`."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.model.cache import NoCache
from mini_transformer.model.rope import RotaryEmbedding, apply_rope, rope_tables, rotate_half, sinusoidal_table

FAST = settings(max_examples=15, deadline=None)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x (B, H, T, D) turned to `positions` (B, T) with our rotate-half tables."""
    cos, sin = rope_tables(int(positions.max()) + 1, x.shape[-1], theta)
    return apply_rope(x, cos[positions][:, None].to(x.dtype), sin[positions][:, None].to(x.dtype))


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Reference in the other layout (the RoFormer paper, Meta's original Llama code): neighbours
    (x[2i], x[2i+1]) form a pair, turned by angle t * theta^(-2i/D) as a complex multiplication."""
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angles = positions[:, None, :, None].double() * inv_freq  # (B, 1, T, D/2)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2).contiguous())  # (B, H, T, D/2)
    turned = pairs * torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(turned).reshape(x.shape)


def interleaved_to_half(D: int) -> torch.Tensor:
    """Permutation p with x_half = x_interleaved[..., p]: even dims first, then odd dims."""
    return torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])


shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 9), st.sampled_from([2, 4, 8, 16]))


@FAST
@given(shape=shapes, theta=st.sampled_from([100.0, 10000.0, 500000.0]))
def test_rotation_keeps_every_vector_norm(shape, theta):
    B, H, T, D = shape
    x = torch.randn(B, H, T, D, dtype=torch.float64)
    positions = torch.randint(0, 200, (B, T))
    turned = rotate(x, positions, theta)
    torch.testing.assert_close(turned.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=1e-9)
    moved = (positions > 0)[:, None].expand(B, H, T)  # position 0 is the identity
    if moved.any():
        assert not torch.allclose(turned[moved], x[moved])  # it did turn something


@FAST
@given(D=st.sampled_from([2, 8, 16, 32]), m=st.integers(0, 60), n=st.integers(0, 60), shift=st.integers(1, 60))
def test_score_depends_only_on_relative_offset(D, m, n, shift):
    q, k = torch.randn(2, 1, 1, 1, D, dtype=torch.float64)

    def score(q_pos, k_pos):
        return (rotate(q, torch.tensor([[q_pos]])) * rotate(k, torch.tensor([[k_pos]]))).sum()

    # the tables are float32: at positions up to 120 their angles are off by ~1e-5 rad, which moves a score
    # of unit-normal q, k (D <= 32) by up to ~2e-5 (measured over 300 seeds); 1e-4 leaves room, and a
    # wrong rotation moves it by O(1)
    torch.testing.assert_close(score(m + shift, n + shift), score(m, n), rtol=1e-5, atol=1e-4)


def test_score_does_change_with_the_offset():
    q = k = torch.ones(1, 1, 1, 8, dtype=torch.float64)
    scores = [(rotate(q, torch.tensor([[5]])) * rotate(k, torch.tensor([[5 - d]]))).sum() for d in range(4)]
    assert len({round(float(s), 6) for s in scores}) == 4


def test_offset_equals_slice_of_full_sequence():
    """Turning tokens start.. of a sequence by their own positions gives the slice of the whole turned
    sequence: what a cached decode step relies on."""
    rope = RotaryEmbedding(d_head=16, max_seq_len=32, theta=10000.0)
    q, k = torch.randn(2, 3, 20, 16), torch.randn(2, 1, 20, 16)  # GQA shapes: k has fewer heads

    def turn(x, start):
        cos, sin = rope.cos_sin(torch.arange(start, 20).expand(2, 20 - start), x.dtype)  # (B, 1, T, D)
        return apply_rope(x[:, :, start:], cos, sin)

    for start in (0, 1, 7, 19):
        assert torch.equal(turn(q, start), turn(q, 0)[:, :, start:])
        assert torch.equal(turn(k, start), turn(k, 0)[:, :, start:])


def test_rotate_half_is_a_quarter_turn_of_each_pair():
    x = torch.arange(1.0, 9.0)[None, None, None]  # pairs (1, 5), (2, 6), (3, 7), (4, 8)
    assert rotate_half(x).flatten().tolist() == [-5, -6, -7, -8, 1, 2, 3, 4]


@FAST
@given(shape=shapes)
def test_interleaved_and_rotate_half_agree_after_permutation(shape):
    B, H, T, D = shape
    x = torch.randn(B, H, T, D, dtype=torch.float64)
    positions = torch.randint(0, 100, (B, T))
    perm = interleaved_to_half(D)
    # Permute dims into the rotate-half order, turn, compare with the interleaved result permuted alike.
    torch.testing.assert_close(rotate(x[..., perm], positions), rope_interleaved(x, positions)[..., perm],
                               rtol=1e-5, atol=1e-5)


def test_permuting_qk_weight_rows_converts_between_layouts():
    """A model trained with interleaved RoPE gives the same scores with rotate-half once the rows of
    each head's W_q and W_k are permuted (what HF's Llama conversion script does)."""
    C, D, T = 24, 8, 10
    x = torch.randn(1, T, C, dtype=torch.float64)
    W_q, W_k = torch.randn(D, C, dtype=torch.float64), torch.randn(D, C, dtype=torch.float64)
    positions = torch.arange(T)[None]
    perm = interleaved_to_half(D)

    def scores(q, k):  # (1, T, D) -> (1, 1, T, T)
        return q @ k.transpose(-2, -1)

    q_il, k_il = rope_interleaved((x @ W_q.T)[:, None], positions), rope_interleaved((x @ W_k.T)[:, None], positions)
    q_rh, k_rh = rotate((x @ W_q[perm].T)[:, None], positions), rotate((x @ W_k[perm].T)[:, None], positions)
    torch.testing.assert_close(scores(q_rh, k_rh), scores(q_il, k_il), rtol=1e-5, atol=1e-5)


def test_sinusoidal_table_matches_2017_formula():
    T, C = 50, 16
    table = sinusoidal_table(T, C)
    expected = torch.empty(T, C, dtype=torch.float64)
    for pos in range(T):
        for i in range(C // 2):
            angle = pos / 10000 ** (2 * i / C)
            expected[pos, 2 * i], expected[pos, 2 * i + 1] = math.sin(angle), math.cos(angle)
    assert table.shape == (T, C)
    torch.testing.assert_close(table.double(), expected, rtol=0, atol=2e-5)


# ---- models -----------------------------------------------------------------------------------------


def tiny_model(pos_emb: str, **overrides) -> TransformerLM:
    cfg = TransformerConfig.from_preset("tiny", pos_emb=pos_emb, **overrides)
    return TransformerLM(cfg).eval()


@pytest.mark.parametrize("pos_emb", ["rope", "sinusoidal", "none", "learned"])
def test_models_run_with_each_position_scheme(pos_emb):
    model = tiny_model(pos_emb)
    ids = torch.randint(0, 100, (2, 12))
    logits, loss = model(ids, targets=ids)
    assert logits.shape == (2, 12, 100) and torch.isfinite(logits).all() and torch.isfinite(loss)
    names = set(dict(model.named_parameters())) | set(model.state_dict())
    position_names = {n for n in names if "pos" in n or "rope" in n or "sinusoid" in n}
    if pos_emb == "learned":
        assert position_names == {"pos_emb.weight"}
    else:  # no learned table, and the fixed tables are recomputed, never saved
        assert position_names == set()
        assert model.num_parameters() == tiny_model("none").num_parameters()


def test_rope_model_sees_only_relative_positions():
    """Shifting every position by the same amount leaves a RoPE model's logits unchanged: RoPE turns
    q and k only (v carries content), and their dot product depends on the offset alone."""

    class Shifted(NoCache):  # a cache that only moves every position by `shift`: the cache interface at work
        def __init__(self, shift):
            self.shift = shift

        def begin(self, idx, attention_mask):
            return super().begin(idx, attention_mask) + self.shift

    model = tiny_model("rope")
    ids = torch.randint(0, 100, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids, cache=Shifted(13)), model(ids)[0],
                                   rtol=1e-5, atol=1e-5)
        absolute = tiny_model("sinusoidal")  # the absolute scheme does change
        assert not torch.allclose(absolute.logits(ids, cache=Shifted(13)), absolute(ids)[0])


@pytest.mark.parametrize("pos_emb", ["rope", "sinusoidal"])
def test_left_padding_keeps_positions_of_real_tokens(pos_emb):
    model = tiny_model(pos_emb, n_kv_heads=2)
    ids = torch.randint(0, 100, (1, 7))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 7)], dim=1).long()
    with torch.no_grad():
        torch.testing.assert_close(model(padded, attention_mask=mask)[0][:, 3:], model(ids)[0], rtol=1e-5, atol=1e-5)
