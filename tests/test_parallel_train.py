"""Training-side parallelism: FSDP2 on 2 gloo ranks against one process on the combined batch, and
activation checkpointing against the plain backward pass."""

import os
import time
from pathlib import Path

import pytest
import torch
from support import assert_same_weights, write_word_corpus

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.cli import main
from mini_transformer.model.transformer import TransformerBlock
from mini_transformer.parallel import run_processes
from mini_transformer.parallel.launch import free_port
from mini_transformer.training import TrainConfig, train
from mini_transformer.training.io import load_train_state


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"))


def common_args(corpus) -> list[str]:
    return ["--data", str(corpus), "--preset", "tiny", "--set", "max_seq_len=16", "--set", "num_samples=0",
            "--set", "eval_batches=2", "--set", "progress=false", "--set", "lr_decay_steps=20",
            "--warmup-steps", "2", "--eval-interval", "10", "--device", "cpu"]


def agree_on_a_fresh_port(rank: int, path: Path, timeout: float = 120.0) -> int:
    """Rank 0 picks a free port now and writes it to `path`; the others read it. Picked just before the
    second rendezvous (not when the test starts, 30 s earlier), so nothing else has time to take it."""
    if rank == 0:
        partial = path.with_suffix(".partial")
        partial.write_text(str(free_port()))
        partial.rename(path)  # atomic: a reader never sees half a number
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"rank {rank}: no port in {path} after {timeout} s"
        time.sleep(0.05)
    return int(path.read_text())


def fsdp_ten_steps_then_resume_to_twenty(rank: int, world_size: int, corpus, out: str) -> None:
    """Run on each rank with torchrun's environment: `train --fsdp` for 10 steps, then --resume to 20."""
    code = main(["train", *common_args(corpus), "--fsdp", "--batch-size", "2", "--max-steps", "10", "--out", out])
    assert code == 0, f"first run exited with {code}"
    port = agree_on_a_fresh_port(rank, Path(out + ".resume-port"))
    os.environ["MASTER_PORT"] = str(port)  # a fresh rendezvous for the second process group
    assert main(["train", "--resume", out, "--fsdp", "--max-steps", "20"]) == 0


def test_fsdp_two_ranks_equal_one_process_and_resume_exactly(corpus, tmp_path):
    """2 ranks x batch 2 with FSDP (10 steps, saved, resumed to 20) == 1 process x batch 4, 20 steps."""
    out = str(tmp_path / "fsdp")
    # ~29 s at load 4.5 on 2 cores; the timeout is a bound for a far busier machine
    run_processes(fsdp_ten_steps_then_resume_to_twenty, 2, args=(corpus, out), timeout=300,
                  backend=None)
    assert main(["train", *common_args(corpus), "--batch-size", "4", "--max-steps", "20",
                 "--out", str(tmp_path / "one")]) == 0
    fsdp, one = load_train_state(tmp_path / "fsdp" / "last"), load_train_state(tmp_path / "one" / "last")
    assert fsdp["world_size"] == 2 and fsdp["step"] == 20 and fsdp["train_config"]["fsdp"]
    assert fsdp["losses"] == pytest.approx(one["losses"], rel=1e-5)
    load = TransformerLM.from_pretrained
    assert_same_weights(load(tmp_path / "fsdp" / "last"), load(tmp_path / "one" / "last"))
    # the gathered optimizer state has the single-process format: same indices, same moments
    for index, values in one["optimizer"]["state"].items():
        torch.testing.assert_close(fsdp["optimizer"]["state"][index]["exp_avg"], values["exp_avg"],
                                   rtol=1e-4, atol=1e-6)


def test_fsdp_needs_torchrun(corpus, tmp_path):
    with pytest.raises(ValueError, match="at least 2 processes"):
        train(TrainConfig(data=str(corpus), fsdp=True, out_dir=str(tmp_path), progress=False))


# ------------------------------------------------------------------------------ activation checkpointing
GPT2_STYLE = dict(vocab_size=50, d_model=32, n_heads=4, n_layer=3, max_seq_len=16, attn_pdrop=0.1,
                  resid_pdrop=0.1, embd_pdrop=0.1)
LLAMA_STYLE = dict(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, n_layer=3, max_seq_len=16, pos_emb="rope",
                   norm="rmsnorm", ffn="swiglu", d_ff=64, bias=False, tie_weights=False, resid_pdrop=0.1)


def gradients(values: dict, checkpointing: bool, calls: list) -> tuple[torch.Tensor, dict]:
    """(loss, gradients) of one training step with dropout on; the same seeds every time."""
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(**values, activation_checkpointing=checkpointing)).train()
    idx = torch.randint(values["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout masks
    _, loss = model(idx, idx.roll(-1, dims=1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("values", [GPT2_STYLE, LLAMA_STYLE], ids=["gpt2", "llama"])
def test_activation_checkpointing_gives_identical_gradients(values, monkeypatch):
    calls = []  # block forwards (module hooks do not fire when checkpoint recomputes, so count here)
    forward = TransformerBlock.forward
    monkeypatch.setattr(TransformerBlock, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    loss, grads = gradients(values, False, calls)
    assert len(calls) == values["n_layer"]
    loss_ckpt, grads_ckpt = gradients(values, True, calls)
    assert len(calls) == 3 * values["n_layer"]  # with checkpointing each block ran again in backward
    assert torch.equal(loss_ckpt, loss)
    for name, grad in grads.items():  # the recompute replays the same ops and dropout masks: bit for bit
        assert torch.equal(grads_ckpt[name], grad), name


def test_activation_checkpointing_from_the_command_line(corpus, tmp_path):
    args = [*common_args(corpus), "--batch-size", "2", "--max-steps", "3", "--eval-interval", "3"]
    assert main(["train", *args, "--out", str(tmp_path / "plain")]) == 0
    assert main(["train", *args, "--set", "activation_checkpointing=true", "--out", str(tmp_path / "ckpt")]) == 0
    plain, ckpt = load_train_state(tmp_path / "plain" / "last"), load_train_state(tmp_path / "ckpt" / "last")
    assert ckpt["losses"] == plain["losses"]
    assert TransformerLM.from_pretrained(tmp_path / "ckpt" / "last").config.activation_checkpointing
