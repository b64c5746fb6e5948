"""Tensor-parallel inference on 2 gloo ranks against one process, and the launcher that runs them."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.parallel import RankFailed, check_divisible, run_processes, shard_tensor_parallel
from mini_transformer.tokenizer import CharTokenizer

SRC = str(Path(__file__).resolve().parents[1] / "src")
# GPT-2 layout (learned positions, LayerNorm, GELU, biases, tied head) and Llama's (RoPE, RMSNorm,
# SwiGLU, GQA with 2 kv heads, untied head). Odd vocabularies: the last rank's vocab slice is padded.
GPT2_STYLE = dict(vocab_size=101, d_model=32, n_heads=4, d_ff=64, n_layer=2, max_seq_len=32, init_std=0.3)
LLAMA_STYLE = dict(vocab_size=99, d_model=32, n_heads=4, n_kv_heads=2, n_layer=2, max_seq_len=32, pos_emb="rope",
                   norm="rmsnorm", ffn="swiglu", d_ff=64, bias=False, tie_weights=False, init_std=0.3)


def build(values: dict) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(**values)).eval()


def inputs(vocab_size: int):
    """A left-padded batch of two prompts: the mask and position path, not only the easy one."""
    idx = torch.randint(vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    return idx, mask


def tp_outputs(rank: int, world_size: int, configs: list[dict]) -> list:
    """On each rank: the sharded model's logits, greedy tokens (KV cache) and its local shapes; last,
    the error that sharding a model whose heads do not divide by the world size raises."""
    out: list = []
    for values in configs:
        model = shard_tensor_parallel(build(values))
        idx, mask = inputs(values["vocab_size"])
        with torch.no_grad():
            logits = model(idx, attention_mask=mask)[0]
        tokens = generate(model, idx, 12, attention_mask=mask)
        out.append({"logits": logits, "tokens": tokens, "qkv_rows": model.blocks[0].attn.W_qkv.weight.shape[0],
                    "collectives": model.collectives.calls})
    try:
        shard_tensor_parallel(build({**GPT2_STYLE, "n_heads": 3, "d_model": 48}))
    except ValueError as err:
        out.append(str(err))
    return out


def test_tensor_parallel_equals_one_process_gpt2_and_llama_gqa():
    configs = [GPT2_STYLE, LLAMA_STYLE]
    ranks = run_processes(tp_outputs, 2, args=(configs,), timeout=90)
    for i, values in enumerate(configs):
        model = build(values)
        idx, mask = inputs(values["vocab_size"])
        with torch.no_grad():
            reference = model(idx, attention_mask=mask)[0]
        tokens = generate(model, idx, 12, attention_mask=mask)
        cfg = model.config
        for rank in ranks:
            torch.testing.assert_close(rank[i]["logits"], reference, rtol=0, atol=1e-5)
            assert torch.equal(rank[i]["tokens"], tokens)
            assert rank[i]["qkv_rows"] == (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head // 2  # half the heads
        # per forward: the embedding, two per layer, the head; 1 prefill + 11 decode steps + the logits call
        assert ranks[0][i]["collectives"] == (2 * cfg.n_layer + 2) * 13
    for rank in ranks:  # every rank says why, and none waits for the other in a collective
        assert "world_size=2 needs n_heads=3 divisible by it" in rank[-1]


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


# ------------------------------------------------------------------------------ the command line
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-checkpoint")
    text = "the quick brown fox jumps over the lazy dog"
    tokenizer = CharTokenizer.train(text)
    torch.manual_seed(0)
    TransformerLM(TransformerConfig(**{**LLAMA_STYLE, "vocab_size": tokenizer.vocab_size})).save_pretrained(path)
    tokenizer.save(path)
    return path


def torchrun(args: list[str], nproc: int = 2, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "mini_transformer.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_sample_tensor_parallel_prints_what_one_process_prints(checkpoint, capsys):
    from mini_transformer.cli import main

    args = ["sample", "--checkpoint", str(checkpoint), "--prompt", "the fox", "--max-new-tokens", "40",
            "--temperature", "0"]
    done = torchrun([*args, "--tensor-parallel"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(args) == 0
    assert done.stdout == capsys.readouterr().out  # rank 0 printed it, once


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
    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 0 gives up") as info:
        run_processes(fail_on_rank_0_while_rank_1_waits, 2, timeout=60)
    assert 0 in info.value.errors
    assert time.monotonic() - started < 40  # the grace period, not the 60 s timeout


def test_launcher_times_out_and_names_the_hung_ranks():
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\]"):
        run_processes(sleep_forever, 2, timeout=4)
