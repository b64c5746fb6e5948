"""model/huge_pages.py: weights moved into 2 MB pages keep their values, their Parameter objects and their own
storages; a compiled decode on the moved model gives eager's tokens."""

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_model

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.model import huge_pages

pytestmark = pytest.mark.skipif(not huge_pages.available(), reason="this OS gives no 2 MB pages to a mapping")


def small_model(tie_weights: bool = False) -> TransformerLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=512, d_model=128, n_heads=4, n_kv_heads=2, n_layer=2, d_ff=384,
                            max_seq_len=128, pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False,
                            tie_weights=tie_weights)
    return TransformerLM(cfg).eval()


def test_huge_page_empty_starts_on_a_2mb_boundary_and_is_writable():
    t = huge_pages.huge_page_empty((3, 1000), torch.float32)
    assert t.shape == (3, 1000) and t.is_contiguous() and t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.copy_(torch.arange(3000.0).view(3, 1000))
    assert t[2, 999] == 2999.0


def test_place_weights_keeps_values_parameters_and_separate_storages(tmp_path):
    model = small_model()
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    big = [p for p in params.values() if p.nbytes >= huge_pages.MIN_BYTES]
    moved = huge_pages.place_weights(model)
    assert moved == sum(p.nbytes for p in big) > 0
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p in big:
        assert getattr(p, huge_pages._MARK) == p.data_ptr()  # moved
        assert p.data_ptr() % 4096 == 0 and p.untyped_storage().nbytes() == p.nbytes  # its own storage
    assert len({p.untyped_storage().data_ptr() for p in big}) == len(big)
    assert huge_pages.place_weights(model) == 0  # placed once
    save_model(model, str(tmp_path / "m.safetensors"))  # refuses storages shared between tensors
    assert all(torch.equal(v, before[k]) for k, v in load_file(str(tmp_path / "m.safetensors")).items())


def test_place_weights_leaves_views_small_tensors_and_a_replaced_weight_is_moved_again():
    holder = nn.Module()
    base = torch.randn(256, 256)
    holder.register_buffer("view", base[:128])  # shares its storage with `base`: stays
    holder.register_buffer("small", torch.randn(16))
    holder.weight = nn.Parameter(torch.randn(256, 128))
    view_ptr, small_ptr = holder.view.data_ptr(), holder.small.data_ptr()
    assert huge_pages.place_weights(holder) == holder.weight.nbytes
    assert holder.view.data_ptr() == view_ptr and holder.small.data_ptr() == small_ptr
    holder.weight.data = torch.randn(256, 128)
    assert huge_pages.place_weights(holder) == holder.weight.nbytes


def test_compiled_decode_on_placed_weights_equals_eager():
    model = small_model()
    prompt = torch.randint(0, 512, (1, 9))
    eager = generate(model, prompt, 12)
    assert torch.equal(generate(model, prompt, 12, compile=True), eager)  # CompiledDecoder places the weights
    assert model.blocks[0].ffn.w_up.weight.data_ptr() % 4096 == 0
    assert huge_pages.place_weights(model) == 0


def test_tied_weights_and_a_buffer_in_two_modules_move_once():
    model = small_model(tie_weights=True)
    assert model.lm_head.weight is model.tok_emb.weight
    shared = torch.randn(128, 128)
    model.blocks[0].register_buffer("extra", shared)
    model.blocks[1].register_buffer("extra", shared)
    unique = {id(t): t for t in [*model.parameters(), shared] if t.nbytes >= huge_pages.MIN_BYTES}
    assert huge_pages.place_weights(model) == sum(t.nbytes for t in unique.values())
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.blocks[0].extra is model.blocks[1].extra and torch.equal(model.blocks[0].extra, shared)
    assert model.blocks[0].extra.data_ptr() != shared.data_ptr()


def test_a_model_trains_and_loads_after_a_compiled_decode_moved_its_weights():
    """generate() runs under inference mode; the moved weights must still take gradients and in-place updates."""
    model = small_model()
    generate(model, torch.randint(0, 512, (1, 5)), 3, compile=True)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 512, (2, 9))
    _, loss = model(idx, targets=idx)
    loss.backward()
    optimizer.step()
    model.load_state_dict(small_model().state_dict())
    assert torch.equal(model.blocks[0].ffn.w_up.weight, small_model().blocks[0].ffn.w_up.weight)
