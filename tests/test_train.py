import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import assert_same_weights

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.checkpoint import write_manifest
from mini_transformer.cli import main
from mini_transformer.tokenizer import CharTokenizer, load_tokenizer
from mini_transformer.training import TrainConfig, train
from mini_transformer.training import loop as train_module
from mini_transformer.training.io import (
    TRAIN_STATE_FILE,
    TrainingDiverged,
    find_checkpoint,
    load_train_state,
    save_checkpoint,
)
from mini_transformer.training.optim import lr_at, make_optimizer

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = dict(d_model=32, n_heads=2, n_layer=2, max_seq_len=16, attn_backend="sdpa")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few thousand characters of word-like text, the same in every run."""
    gen = torch.Generator().manual_seed(0)
    words = ["the", "king", "shall", "speak", "and", "we", "hear", "him", "now", "good", "lord", "my"]
    picks = torch.randint(len(words), (1500,), generator=gen).tolist()
    text = " ".join(words[i] + (".\n" if i % 5 == 0 else "") for i in picks)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text)
    return path


def tiny_run(corpus, out, **changes) -> TrainConfig:
    values = dict(data=str(corpus), batch_size=4, max_steps=20, warmup_steps=3, eval_interval=10, eval_batches=2,
                  out_dir=str(out), progress=False, num_samples=0, sample_tokens=8)
    return TrainConfig(**{**values, **changes})


def model_config(**changes) -> TransformerConfig:
    return TransformerConfig(**{"vocab_size": 1, **TINY, **changes})  # train() takes vocab_size from the tokenizer


def weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------ schedule, optimizer
def test_lr_schedule_warmup_then_cosine_to_min_lr():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    lrs = [lr_at(s, cfg) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11], strict=True))  # warmup rises
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half way: the mean of lr and min_lr
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:111], strict=True))  # cosine falls
    assert lrs[110] == lrs[119] == 1e-4
    later = TrainConfig(warmup_steps=10, max_steps=50, lr_decay_steps=110)
    assert [lr_at(s, later) for s in range(50)] == lrs[:50]  # the schedule follows lr_decay_steps
    assert TrainConfig(max_steps=2000).warmup == 100 and TrainConfig(max_steps=30).warmup == 3  # default
    assert lr_at(0, TrainConfig(warmup_steps=0, max_steps=10)) == pytest.approx(1e-3)


def test_weight_decay_only_on_matrices_and_embeddings():
    model = TransformerLM(model_config(vocab_size=20))
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert any(p is model.tok_emb.weight for p in decay["params"])
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))  # tied: once


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(batch_size=0), "batch_size=0"),
        (dict(lr=-1.0), "lr=-1.0"),
        (dict(lr=1e-4, min_lr=1e-3), "min_lr"),
        (dict(beta2=1.0), "beta2=1.0"),
        (dict(warmup_steps=100, max_steps=100), "warmup_steps=100"),
        (dict(warmup_steps=-1), "warmup_steps=-1"),
        (dict(tokenizer="words"), "tokenizer='words'"),
        (dict(precision="fp8"), "precision='fp8'"),
        (dict(compile="yes"), "compile='yes'"),
    ],
)
def test_train_config_rejects_bad_values(changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        TrainConfig(**changes)


# ------------------------------------------------------------------------------------- a full run
def test_run_learns_and_writes_complete_checkpoints(corpus, tmp_path):
    result = train(tiny_run(corpus, tmp_path, max_steps=30, num_samples=1), model_config())
    assert result.step == 30 and len(result.losses) == 30
    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 0.3
    assert [e[0] for e in result.evals] == [10, 20, 30]
    assert result.best_val_loss == min(e[2] for e in result.evals)
    for name in ("best", "last"):
        ckpt = tmp_path / name
        for file in ("model.safetensors", "config.json", "vocab.json", TRAIN_STATE_FILE, "train_config.json"):
            assert (ckpt / file).is_file(), file
    state = torch.load(tmp_path / "last" / TRAIN_STATE_FILE, weights_only=True)
    assert state["step"] == 30 and set(state["optimizer"]) == {"state", "param_groups"}
    assert isinstance(state["batch_rng"], torch.Tensor) and isinstance(state["torch_rng"], torch.Tensor)
    reloaded = TransformerLM.from_pretrained(tmp_path / "last")
    for name, tensor in result.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert load_tokenizer(tmp_path / "last").chars == result.tokenizer.chars
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert len((tmp_path / "samples.txt").read_text()) > 8


def test_text_too_short_for_the_block_is_a_clear_error(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 10)  # 100 characters: val gets 10 < block_size + 1
    with pytest.raises(ValueError, match=r"block_size \+ 1 = 17"):
        train(tiny_run(short, tmp_path / "out"), model_config())


def test_gradient_accumulation_equals_the_bigger_batch(corpus, tmp_path):
    a = train(tiny_run(corpus, tmp_path / "a", max_steps=6, batch_size=2, grad_accum_steps=2), model_config())
    b = train(tiny_run(corpus, tmp_path / "b", max_steps=6, batch_size=4), model_config())
    assert_same_weights(a.model, b.model)
    assert a.losses == pytest.approx(b.losses, rel=1e-5)


# ------------------------------------------------------------------------------------------ resume
def test_resume_continues_exactly(corpus, tmp_path):
    """50 steps, stop, resume for 50 more == 100 steps straight: same losses, same weights (dropout on)."""
    cfg = model_config(resid_pdrop=0.1)
    straight = train(tiny_run(corpus, tmp_path / "straight", max_steps=100, eval_interval=25), cfg)
    first = train(tiny_run(corpus, tmp_path / "split", max_steps=50, lr_decay_steps=100, eval_interval=25), cfg)
    assert first.losses == straight.losses[:50]
    resumed = train(tiny_run(corpus, tmp_path / "split", max_steps=100, eval_interval=25), resume=tmp_path / "split")
    assert resumed.step == 100 and len(resumed.step_times) == 50
    assert resumed.losses == straight.losses  # exact, not approximately
    assert resumed.evals == straight.evals
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_resume_needs_steps_left_and_a_checkpoint(corpus, tmp_path):
    train(tiny_run(corpus, tmp_path, max_steps=10), model_config())
    with pytest.raises(ValueError, match="step 10"):
        train(tiny_run(corpus, tmp_path, max_steps=10), resume=tmp_path)
    with pytest.raises(ValueError, match="no training checkpoint"):
        train(tiny_run(corpus, tmp_path, max_steps=20), resume=tmp_path / "nothing")


# ---------------------------------------------------------------------------- NaN, atomic saves
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    class PoisonedLM(TransformerLM):
        calls = 0

        def forward(self, idx, targets=None, **kwargs):
            logits, loss = super().forward(idx, targets, **kwargs)
            if self.training:
                PoisonedLM.calls += 1
                if PoisonedLM.calls == 15:
                    loss = loss * float("nan")
            return logits, loss

    monkeypatch.setattr(train_module, "TransformerLM", PoisonedLM)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 15.*last"):
        train(tiny_run(corpus, tmp_path, eval_interval=5), model_config())
    assert load_train_state(tmp_path / "last")["step"] == 10
    model = TransformerLM.from_pretrained(tmp_path / "last")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model = TransformerLM(model_config(vocab_size=3))
    tok = CharTokenizer(["a", "b", "c"])
    save_checkpoint(tmp_path / "last", model, tok, {"step": 1})

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "last", model, tok, {"step": 2})
    monkeypatch.undo()
    assert load_train_state(tmp_path / "last")["step"] == 1
    # A kill between the two renames leaves only `.last.old`: it is still found.
    os.replace(tmp_path / "last", tmp_path / ".last.old")
    assert find_checkpoint(tmp_path) == tmp_path / ".last.old"


def test_compiled_and_ddp_prefixed_weights_load(tmp_path):
    model = TransformerLM(model_config(vocab_size=5))
    compiled = torch.compile(model)  # compiling is lazy: nothing is compiled until it is called
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    save_checkpoint(tmp_path / "c", compiled, CharTokenizer(list("abcde")), {"step": 0})
    assert not any("_orig_mod" in k for k in load_file(str(tmp_path / "c" / "model.safetensors")))
    loaded = TransformerLM.from_pretrained(tmp_path / "c")
    # A state dict saved by hand from DDP(torch.compile(model)) carries both prefixes.
    prefixed = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(prefixed, str(tmp_path / "c" / "model.safetensors"))
    write_manifest(tmp_path / "c")  # a file replaced by hand needs its sha256 recorded again
    loaded_prefixed = TransformerLM.from_pretrained(tmp_path / "c")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
        assert torch.equal(loaded_prefixed.state_dict()[name], tensor), name


# --------------------------------------------------------------------------------------------- CLI
def test_cli_trains_resumes_and_routes_set(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--preset", "tiny", "--set", "max_seq_len=16", "--set", "eval_batches=2",
            "--set", "progress=false", "--set", "num_samples=0", "--max-steps", "6", "--eval-interval", "3",
            "--warmup-steps", "2", "--batch-size", "2", "--out", str(out)]
    assert main(args) == 0
    assert "sample --checkpoint" in capsys.readouterr().out
    saved = json.loads((out / "last" / "train_config.json").read_text())
    assert saved["eval_batches"] == 2 and saved["max_steps"] == 6
    assert json.loads((out / "last" / "config.json").read_text())["max_seq_len"] == 16
    assert main(["train", "--resume", str(out), "--max-steps", "9"]) == 0
    assert load_train_state(out / "last")["step"] == 9
    assert load_train_state(out / "last")["train_config"]["eval_batches"] == 2  # kept from the first run
    assert main(args[:5] + ["--set", "colour=blue"]) == 2
    assert "colour" in capsys.readouterr().err
    assert main(args[:5] + ["--set", "vocab_size=7"]) == 2
    assert "tokenizer" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- DDP
def test_ddp_two_processes_equal_one_process_on_the_combined_batch(corpus, tmp_path):
    """torchrun with 2 gloo ranks of batch 2 == one process with batch 4 (the same global batches)."""
    common = ["--data", str(corpus), "--preset", "tiny", "--set", "max_seq_len=16", "--set", "num_samples=0",
              "--set", "eval_batches=2", "--set", "progress=false", "--max-steps", "4", "--warmup-steps", "1",
              "--eval-interval", "4", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "mini_transformer.cli", "train", *common, "--batch-size", "2", "--out", str(tmp_path / "ddp")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)  # ~17 s at load 4.5
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["train", *common, "--batch-size", "4", "--out", str(tmp_path / "one")]) == 0
    ddp, one = load_train_state(tmp_path / "ddp" / "last"), load_train_state(tmp_path / "one" / "last")
    assert ddp["world_size"] == 2 and one["world_size"] == 1
    assert ddp["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert not math.isnan(ddp["best_val_loss"])
    ddp_model = TransformerLM.from_pretrained(tmp_path / "ddp" / "last")
    assert_same_weights(ddp_model, TransformerLM.from_pretrained(tmp_path / "one" / "last"))


def test_bpe_run_saves_tokenizer_json_and_matches_vocab(corpus, tmp_path):
    out = tmp_path / "bpe"
    args = ["train", "--data", str(corpus), "--preset", "tiny", "--set", "max_seq_len=16", "--set", "eval_batches=1",
            "--set", "progress=false", "--set", "num_samples=1", "--set", "sample_tokens=4", "--max-steps", "2",
            "--eval-interval", "2", "--tokenizer", "bpe", "--vocab-size", "300", "--out", str(out)]
    assert main(args) == 0
    tokenizer = load_tokenizer(out / "best")
    assert (out / "best" / "tokenizer.json").is_file() and tokenizer.kind == "bpe"
    assert TransformerLM.from_pretrained(out / "best").config.vocab_size == tokenizer.vocab_size <= 300
