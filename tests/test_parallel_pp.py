"""Pipeline parallelism (parallel/pp.py, pp_inference.py) on 2 gloo ranks against one process.

ONE 2-rank launch (each start costs seconds) runs, per rank: `train --pipeline-parallel 2` for 5 steps
with each schedule on a GPT-2-style (tied head) and a Llama-style (untied) model, a run stopped at
step 3 and resumed to 5, pipelined greedy decoding on a left-padded batch, and `sample
--pipeline-parallel 2`. The tests below compare what it left against one process."""

import contextlib
import io
import multiprocessing
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from support import comparable_weights, save_char_checkpoint, write_word_corpus

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.cli import main
from mini_transformer.parallel import RankFailed, run_processes
from mini_transformer.parallel.pp import PipelineTrainer, check_pipeline, split_layers, stages_of_rank
from mini_transformer.training.io import load_train_state

STYLES = {"gpt2": ["--preset", "tiny"], "llama": ["--preset", "llama-tiny"]}  # tied head / untied head
SCHEDULES = {"gpipe": 4, "1f1b": 2, "interleaved-1f1b": 4}  # schedule -> microbatches (batch 4)
GPT2_STYLE = dict(vocab_size=101, d_model=32, n_heads=4, d_ff=64, n_layer=3, max_seq_len=32, init_std=0.3)
LLAMA_STYLE = dict(vocab_size=99, d_model=32, n_heads=4, n_kv_heads=2, n_layer=3, max_seq_len=32, pos_emb="rope",
                   norm="rmsnorm", ffn="swiglu", d_ff=64, bias=False, tie_weights=False, init_std=0.3)
SAMPLE = ["--prompt", "the fox", "--max-new-tokens", "20", "--temperature", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"))


def train_args(corpus, style: str, steps: int = 5) -> list[str]:
    """4 layers (interleaved: 2 ranks x 2 stages of one layer), batch 4, fp32, no dropout in these presets."""
    return ["train", *STYLES[style], "--data", str(corpus), "--set", "n_layer=4", "--set", "max_seq_len=16",
            "--set", "num_samples=0", "--set", "eval_batches=2", "--set", "progress=false",
            "--set", "lr_decay_steps=20", "--warmup-steps", "2", "--eval-interval", "10", "--device", "cpu",
            "--batch-size", "4", "--max-steps", str(steps), "--lr", "3e-4"]


def build(values: dict) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(**values)).eval()


def padded_inputs(vocab_size: int):
    idx = torch.randint(vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row: the mask and position path, not only the easy one
    return idx, mask


def pipeline_checks(rank: int, world_size: int, corpus, out: str, checkpoint) -> dict:
    """Everything the tests look at, from one launch; the group is the launcher's (train keeps it)."""
    from mini_transformer.parallel.pp_inference import shard_pipeline_parallel

    codes = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for style in STYLES:
            for schedule, microbatches in SCHEDULES.items():
                pipeline = ["--pipeline-parallel", "2", "--microbatches", str(microbatches), "--schedule", schedule]
                run_dir = f"{out}/{style}-{schedule}"
                codes[style, schedule] = main([*train_args(corpus, style), *pipeline, "--out", run_dir])
        codes["stopped"] = main([*train_args(corpus, "gpt2", steps=3), "--pipeline-parallel", "2", "--microbatches",
                                 "4", "--schedule", "interleaved-1f1b", "--out", f"{out}/resumed"])
        codes["resumed"] = main(["train", "--resume", f"{out}/resumed", "--max-steps", "5"])
    decoded = []
    for values in (GPT2_STYLE, LLAMA_STYLE):
        model = shard_pipeline_parallel(build(values))
        idx, mask = padded_inputs(values["vocab_size"])
        decoded.append({"tokens": generate(model, idx, 12, attention_mask=mask), "n_layer": model.config.n_layer,
                        "layers": model.pipeline_parallel.layers})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        codes["sample"] = main(["sample", "--checkpoint", str(checkpoint), *SAMPLE, "--pipeline-parallel", "2"])
    return {"codes": codes, "decoded": decoded, "sample_text": printed.getvalue(), "order": run_order("1f1b", 4)}


def run_order(schedule: str, microbatches: int) -> list[str]:
    """The order in which this rank's stage really runs forwards and backwards in one step."""
    trainer = PipelineTrainer(build({**GPT2_STYLE, "n_layer": 2}).train(), schedule, microbatches)
    stage, order = trainer.stages[0], []
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        method = getattr(stage, name)
        setattr(stage, name,
                lambda chunk, *a, _m=method, _k=kind, **k: order.append(f"{_k}{chunk}") or _m(chunk, *a, **k))
    idx = torch.randint(101, (4, 8), generator=torch.Generator().manual_seed(2))
    trainer.step(idx, idx)
    return order


@pytest.fixture(scope="module")
def char_checkpoint(tmp_path_factory):
    path, _, _ = save_char_checkpoint(tmp_path_factory.mktemp("pp-checkpoint"), 64, preset="llama-tiny")
    return path


@pytest.fixture(scope="module")
def two_ranks(corpus, char_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("pp-runs")
    # ~40 s on 2 busy cores; the timeout bounds a far busier machine
    results = run_processes(pipeline_checks, 2, args=(corpus, str(out), char_checkpoint), timeout=400)
    return out, results


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """The reference: one process, the whole batch of 4, 5 steps, per model style."""
    out = tmp_path_factory.mktemp("one-process")
    with contextlib.redirect_stdout(io.StringIO()):
        for style in STYLES:
            assert main([*train_args(corpus, style), "--out", str(out / style)]) == 0
    return out


def max_weight_gap(path, reference) -> float:
    """Largest |difference| over all weights, leaving out the key bias: softmax ignores a shift shared by a
    row of scores, so its true gradient is 0 and it gets only rounding noise, which Adam turns into
    lr-sized steps that depend on the order of summation (see support.comparable_weights)."""
    got, want = TransformerLM.from_pretrained(path), TransformerLM.from_pretrained(reference)
    return max((other - tensor).abs().max().item() for _, other, tensor in comparable_weights(got, want))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("style", list(STYLES))
def test_five_pipeline_steps_equal_one_process(two_ranks, one_process, style, schedule):
    out, results = two_ranks
    assert [r["codes"][style, schedule] for r in results] == [0, 0]
    run, reference = out / f"{style}-{schedule}" / "last", one_process / style / "last"
    state, want = load_train_state(run), load_train_state(reference)
    assert state["step"] == 5 and state["train_config"]["pipeline_parallel"] == 2
    assert max(abs(a - b) for a, b in zip(state["losses"], want["losses"], strict=True)) <= 1e-6
    assert max_weight_gap(run, reference) <= 1e-6  # the checkpoint: our format, read by one process
    # the optimizer state was gathered into the one-process layout: same indices, same moments
    for index, values in want["optimizer"]["state"].items():
        torch.testing.assert_close(state["optimizer"]["state"][index]["exp_avg"], values["exp_avg"],
                                   rtol=1e-4, atol=1e-7)


def test_a_resumed_pipeline_run_equals_an_uninterrupted_one(two_ranks, one_process):
    out, results = two_ranks
    assert [(r["codes"]["stopped"], r["codes"]["resumed"]) for r in results] == [(0, 0), (0, 0)]
    state, want = load_train_state(out / "resumed" / "last"), load_train_state(one_process / "gpt2" / "last")
    assert state["step"] == 5
    assert max(abs(a - b) for a, b in zip(state["losses"], want["losses"], strict=True)) <= 1e-6
    assert max_weight_gap(out / "resumed" / "last", one_process / "gpt2" / "last") <= 1e-6


@pytest.mark.parametrize("which", [0, 1], ids=["gpt2", "llama-gqa"])
def test_pipeline_greedy_decoding_equals_one_process(two_ranks, which):
    values = [GPT2_STYLE, LLAMA_STYLE][which]
    idx, mask = padded_inputs(values["vocab_size"])
    want = generate(build(values), idx, 12, attention_mask=mask)
    for rank, result in enumerate(two_ranks[1]):
        got = result["decoded"][which]
        assert torch.equal(got["tokens"], want)
        assert got["layers"] == split_layers(3, 2)[rank]  # rank 0: layers 0-1, rank 1: layer 2
        assert got["n_layer"] == len(got["layers"])  # its KV cache holds its own layers only


def test_cli_sample_pipeline_parallel_prints_what_one_process_prints(two_ranks, char_checkpoint, capsys):
    assert main(["sample", "--checkpoint", str(char_checkpoint), *SAMPLE]) == 0
    results = two_ranks[1]
    assert [r["codes"]["sample"] for r in results] == [0, 0]
    assert results[0]["sample_text"] == capsys.readouterr().out
    assert results[1]["sample_text"] == ""  # only rank 0 prints


def test_1f1b_runs_warm_up_then_one_forward_one_backward(two_ranks):
    """What Schedule1F1B really runs (ex10_pipeline_schedule, docs/10 draw it): rank 0 warms up with p - 1 = 1
    extra forward, rank 1 (the last) alternates from the start; at most p - rank microbatches in flight."""
    rank_0, rank_1 = (r["order"] for r in two_ranks[1])
    assert rank_0 == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert rank_1 == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


# ------------------------------------------------------------------------- bad input, before any wait
@pytest.mark.parametrize(("extra", "world", "message"), [
    (["--set", "n_layer=2", "--schedule", "interleaved-1f1b"], "2", "4 pipeline stages .* need at least 4 layers"),
    (["--microbatches", "1", "--schedule", "1f1b"], "2", "needs microbatches >= the 2 stages"),
    ([], "3", "needs exactly 2 processes, but torchrun started WORLD_SIZE=3"),
    (["--microbatches", "3"], "2", "batch_size=4 must be divisible by microbatches=3"),
    (["--grad-accum-steps", "2"], "2", "does not go with grad_accum_steps > 1"),
])
def test_cli_train_refuses_bad_pipelines_before_joining_a_group(corpus, tmp_path, monkeypatch, capsys, extra, world,
                                                                message):
    monkeypatch.setenv("WORLD_SIZE", world)  # what each torchrun rank sees: every one stops here, none waits
    args = [*train_args(corpus, "gpt2"), "--set", "n_layer=2", "--pipeline-parallel", "2", "--microbatches", "2",
            *extra, "--out", str(tmp_path)]
    started = time.monotonic()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not dist.is_initialized() and time.monotonic() - started < 30


@pytest.mark.parametrize(("args", "world", "message"), [
    (["--pipeline-parallel", "2"], None, "runs under torchrun"),
    (["--pipeline-parallel", "2"], "3", "needs exactly 2 processes"),
    (["--pipeline-parallel", "3"], "3", "3 stages need at least 3 layers, the model has n_layer=2"),
    (["--pipeline-parallel", "2", "--tensor-parallel"], "2", "choose one"),
])
def test_cli_sample_refuses_bad_pipelines_before_joining_a_group(char_checkpoint, monkeypatch, capsys, args, world,
                                                                 message):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert main(["sample", "--checkpoint", str(char_checkpoint), "--prompt", "the", *args]) == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()


def test_check_pipeline_names_each_setting():
    cfg = TransformerConfig(**GPT2_STYLE)
    with pytest.raises(ValueError, match="schedule='zero-bubble'"):
        check_pipeline(cfg, 2, "zero-bubble", 4)
    with pytest.raises(ValueError, match="pipeline_parallel=1"):
        check_pipeline(cfg, 1, "gpipe", 4)
    check_pipeline(cfg, 2, "gpipe", 1)  # GPipe and the interleaved schedule run with a single microbatch
    check_pipeline(cfg, 3, "1f1b", 3, batch_size=6, world_size=3)


def test_layers_split_evenly_and_stages_loop_over_the_ranks():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stages_of_rank(1, 2, "interleaved-1f1b") == [1, 3] and stages_of_rank(1, 2, "gpipe") == [1]


# ----------------------------------------------------------------------------------- a dying rank
def die_on_rank_1_while_rank_0_sends(rank: int, world_size: int) -> None:
    model = build({**GPT2_STYLE, "n_layer": 2})
    trainer = PipelineTrainer(model, "gpipe", 2)
    if rank == 1:
        os._exit(3)  # dies as a killed process does: no exception, no report, no goodbye to the group
    idx = torch.randint(101, (2, 8))
    trainer.step(idx, idx)  # waits for rank 1's activations' gradients, which never come


def test_a_dying_rank_is_named_and_nobody_hangs():
    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_processes(die_on_rank_1_while_rank_0_sends, 2, timeout=300)
    assert "exited with code 3" in info.value.errors[1]
    assert time.monotonic() - started < 120  # the launcher's grace period, not the 300 s timeout
    assert not multiprocessing.active_children()
