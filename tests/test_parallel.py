"""Tensor-parallel inference on 2 gloo ranks against one process, and the launcher that runs them."""

import contextlib
import io
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.parallel import RankFailed, check_divisible, run_processes, shard_tensor_parallel
from mini_transformer.tokenizer import CharTokenizer

# GPT-2 layout (learned positions, LayerNorm, GELU, biases, tied head) and Llama's (RoPE, RMSNorm,
# SwiGLU, GQA with 2 kv heads, untied head). Odd vocabularies: the last rank's vocab slice is padded.
GPT2_STYLE = dict(vocab_size=101, d_model=32, n_heads=4, d_ff=64, n_layer=2, max_seq_len=32, init_std=0.3)
LLAMA_STYLE = dict(vocab_size=99, d_model=32, n_heads=4, n_kv_heads=2, n_layer=2, max_seq_len=32, pos_emb="rope",
                   norm="rmsnorm", ffn="swiglu", d_ff=64, bias=False, tie_weights=False, init_std=0.3)


def build(values: dict) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(**values)).eval()
    with torch.no_grad():  # biases start at zero; give them values, or a bias added W times would not show
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.3)
    return model


def inputs(vocab_size: int):
    """A left-padded batch of two prompts: the mask and position path, not only the easy one."""
    idx = torch.randint(vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    return idx, mask


def tp_checks(rank: int, world_size: int, configs: list[dict], cli_args: list[str]) -> dict:
    """Everything the tests below look at, from ONE 2-rank run (each start costs seconds): the CLI under
    torchrun's environment (it joins the group itself), then sharded models' logits, greedy tokens
    (KV cache), local shapes and collective counts, and last the error for heads that do not divide."""
    from mini_transformer.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(cli_args)
    out: dict = {"cli_code": code, "cli_text": printed.getvalue(), "models": []}
    for values in configs:
        model = shard_tensor_parallel(build(values))
        idx, mask = inputs(values["vocab_size"])
        with torch.no_grad():
            logits = model(idx, attention_mask=mask)[0]
        tokens = generate(model, idx, 12, attention_mask=mask)
        out["models"].append({"logits": logits, "tokens": tokens, "collectives": model.collectives.calls,
                              "qkv_rows": model.blocks[0].attn.W_qkv.weight.shape[0],
                              "config": model.config.to_dict(), "kv_heads": model.kv_heads})
    try:
        shard_tensor_parallel(build({**GPT2_STYLE, "n_heads": 3, "d_model": 48}))
    except ValueError as err:
        out["error"] = str(err)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-checkpoint")
    text = "the quick brown fox jumps over the lazy dog"
    tokenizer = CharTokenizer.train(text)
    torch.manual_seed(0)
    TransformerLM(TransformerConfig(**{**LLAMA_STYLE, "vocab_size": tokenizer.vocab_size})).save_pretrained(path)
    tokenizer.save(path)
    return path


SAMPLE = ["--prompt", "the fox", "--max-new-tokens", "40", "--temperature", "0"]


@pytest.fixture(scope="module")
def two_ranks(checkpoint):
    cli_args = ["sample", "--checkpoint", str(checkpoint), *SAMPLE, "--tensor-parallel"]
    return run_processes(tp_checks, 2, args=([GPT2_STYLE, LLAMA_STYLE], cli_args), timeout=120, backend=None)


@pytest.mark.parametrize("which", [0, 1], ids=["gpt2", "llama-gqa"])
def test_tensor_parallel_equals_one_process(two_ranks, which):
    values = [GPT2_STYLE, LLAMA_STYLE][which]
    model = build(values)
    idx, mask = inputs(values["vocab_size"])
    with torch.no_grad():
        reference = model(idx, attention_mask=mask)[0]
    tokens = generate(model, idx, 12, attention_mask=mask)
    cfg = model.config
    for rank in two_ranks:
        got = rank["models"][which]
        torch.testing.assert_close(got["logits"], reference, rtol=0, atol=1e-5)
        assert torch.equal(got["tokens"], tokens)
        assert got["qkv_rows"] == (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head // 2  # half the heads
        # the config stays the whole model's (the residual stream is d_model wide on every rank); the
        # KV cache is sized by the heads the shard's layers hold
        assert got["config"] == cfg.to_dict() and got["kv_heads"] == cfg.n_kv_heads // 2
        # per forward: the embedding, two per layer, the head; 1 prefill + 11 decode steps + the logits call
        assert got["collectives"] == (2 * cfg.n_layer + 2) * 13


def test_cli_sample_tensor_parallel_prints_what_one_process_prints(two_ranks, checkpoint, capsys):
    from mini_transformer.cli import main

    assert main(["sample", "--checkpoint", str(checkpoint), *SAMPLE]) == 0
    assert [r["cli_code"] for r in two_ranks] == [0, 0]
    assert two_ranks[0]["cli_text"] == capsys.readouterr().out
    assert two_ranks[1]["cli_text"] == ""  # only rank 0 prints


def test_heads_that_do_not_divide_fail_on_every_rank(two_ranks):
    for rank in two_ranks:  # every rank says why, and none waits for the other in a collective
        assert "world_size=2 needs n_heads=3 divisible by it" in rank["error"]


@pytest.mark.parametrize(("changes", "name"), [(dict(n_heads=6, d_model=48), "n_heads=6"),
                                                (dict(n_heads=4, n_kv_heads=1), "n_kv_heads=1"),
                                                (dict(d_ff=60), "d_ff=60")])
def test_check_divisible_names_the_field(changes, name):
    cfg = TransformerConfig(**{**LLAMA_STYLE, **changes})
    with pytest.raises(ValueError, match=name):
        check_divisible(cfg, 4)


def test_shard_needs_a_process_group():
    with pytest.raises(ValueError, match="torchrun"):
        shard_tensor_parallel(build(GPT2_STYLE))


def test_cli_tensor_parallel_checks_before_joining_a_group(checkpoint, monkeypatch, capsys):
    from mini_transformer.cli import main

    args = ["sample", "--checkpoint", str(checkpoint), "--prompt", "the", "--tensor-parallel"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(args) == 2
    assert "runs under torchrun" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")  # what each of 3 torchrun ranks sees: an error before any collective
    assert main(args) == 2
    assert "world_size=3 needs n_heads=4 divisible by it" in capsys.readouterr().err
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------------- the launcher
def fail_on_rank_0_while_rank_1_waits(rank: int, world_size: int) -> None:
    if rank == 0:
        raise ValueError("rank 0 gives up")
    dist.all_reduce(torch.ones(1))  # never completes: rank 0 is gone


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_launcher_reports_a_failed_rank_and_stops_the_one_left_waiting():
    # RankFailed, not TimeoutError: the call returns after the grace period, not after the 300 s timeout
    with pytest.raises(RankFailed, match="rank 0 gives up") as info:
        run_processes(fail_on_rank_0_while_rank_1_waits, 2, timeout=300)
    assert 0 in info.value.errors
    assert not multiprocessing.active_children()  # rank 1 reported its broken collective or was terminated


def test_launcher_times_out_and_names_the_hung_ranks():
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\]"):
        run_processes(sleep_forever, 2, timeout=4)
    assert not multiprocessing.active_children()


def test_tensor_parallel_refuses_moe_and_points_to_expert_parallelism():
    cfg = TransformerConfig(**{**LLAMA_STYLE, "ffn": "moe", "n_experts": 4})
    with pytest.raises(ValueError, match="shard_expert_parallel"):
        check_divisible(cfg, 2)
