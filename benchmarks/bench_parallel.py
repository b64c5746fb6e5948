"""What do tensor parallelism, FSDP and activation checkpointing buy, and what do they cost?

    python benchmarks/bench_parallel.py                  # GPT-2 small: TP=2 vs 1, FSDP vs DDP, checkpointing
    python benchmarks/bench_parallel.py --quick --plot   # a small model, PNG in out/

Three tables, each with its reference measured in the same run:
  1. Tensor parallel inference, 2 gloo ranks vs one process: per-rank weight bytes (counted from the
     tensors each rank holds), the bytes handed to collectives per token (counted by the model's
     CollectiveCounter) against the formula ((2L + 1) C + ceil(V / W)) * bytes, and decode speed.
  2. Training memory per rank, FSDP2 vs DDP on 2 ranks (and one process): parameters, gradients and
     AdamW state counted from the tensors after one step (a DTensor counts its local shard), plus the
     process's peak resident memory (which also holds activations, DDP's buckets, the allocator's slack).
  3. Activation checkpointing on vs off, one process: extra peak memory of a training step with the
     gradients already allocated (so the peak is activations and temporaries), and the step time; for
     GPT-2 small, whose logits and loss (B*T*V floats, several copies) checkpointing does not touch, and
     for a char-vocabulary model where the blocks' activations are nearly all of it.
     Each mode runs in a fresh subprocess (peak RSS via /proc/self/clear_refs, as bench_attention.py;
     torch.cuda.max_memory_allocated on CUDA).
  4. Expert parallel MoE inference, 2 gloo ranks (each runs half the batch) vs one process: per-rank
     weight bytes (experts, and everything), and the bytes each rank sends by all_to_all per token
     against the uniform-routing formula L * 2 k (W-1)/W * C * bytes. The model is the preset's shape
     with every FFN an MoE layer of 8 experts of width d_model, top-2.
  5. Prefill/decode disaggregation, rank 0 prefills and rank 1 decodes: K/V bytes moved per request
     against 2 * n_layer * P * Hkv * D * bytes, and the completions checked against one LLMEngine.
  6. --pp: pipeline parallel training on 2 ranks (bench_pipeline.py): GPipe, 1F1B and interleaved 1F1B at
     M = 1, 2, 4, 8 microbatches; the measured bubble against (p-1)/(vM+p-1), and peak activation memory
     per rank against GPipe's; --plot adds out/pp_timeline.png, each schedule's timeline per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import bench_pipeline
import torch
from _common import add_common_args, apply_common_args, table, time_call, time_calls
from bench_attention import _peak_rss_bytes, _reset_peak_rss, _rss_bytes  # a sibling: `python benchmarks/...`

from mini_transformer import TransformerConfig, TransformerLM, generate
from mini_transformer.parallel import run_processes, shard_expert_parallel, shard_tensor_parallel
from mini_transformer.parallel.fsdp import local_bytes, shard_for_training, training_memory
from mini_transformer.training.config import TrainConfig
from mini_transformer.training.optim import make_optimizer

MB = 1e6  # decimal megabytes, as the docs write every size (KB = 1e3 below)


def model_config(args) -> TransformerConfig:
    return TransformerConfig.from_preset(args.preset, attn_backend="sdpa")


# ------------------------------------------------------------------------------ 1. tensor parallel
def tp_worker(rank: int, world_size: int, args, shard: bool) -> dict:
    apply_common_args(args)
    torch.manual_seed(0)
    model = TransformerLM(model_config(args)).eval()
    if shard:
        shard_tensor_parallel(model)
    weights = local_bytes(model.parameters())  # a tied matrix counts once
    idx = torch.randint(model.config.vocab_size, (1, args.prompt))
    if shard:
        torch.distributed.barrier()  # start the clocks together: a rank that built its model first would wait
    new, seconds = time_call(lambda: generate(model, idx, args.new_tokens))  # 1 prefill + new_tokens - 1 steps
    tokens = args.prompt + args.new_tokens - 1  # tokens that went through the model
    per_token = model.collectives.nbytes / tokens if shard else 0.0
    return dict(weights=weights, bytes_per_token=per_token, tok_s=args.new_tokens / seconds, ids=new)


def bench_tp(args) -> list[dict]:
    cfg = model_config(args)
    one = run_processes(tp_worker, 1, args=(args, False), timeout=args.timeout)[0]
    two = run_processes(tp_worker, 2, args=(args, True), timeout=args.timeout)
    assert all(torch.equal(r["ids"], one["ids"]) for r in two), "TP=2 greedy tokens differ from one process"
    formula = ((2 * cfg.n_layer + 1) * cfg.d_model + -(-cfg.vocab_size // 2)) * 4  # fp32 bytes per token
    rows = [dict(setup="1 process", weights_mb=one["weights"] / MB, ratio=1.0, kb_token="-", formula_kb="-",
                 tok_s=one["tok_s"])]
    for rank, r in enumerate(two):
        rows.append(dict(setup=f"TP=2 rank {rank}", weights_mb=r["weights"] / MB, ratio=r["weights"] / one["weights"],
                         kb_token=f"{r['bytes_per_token'] / 1e3:.1f}", formula_kb=f"{formula / 1e3:.1f}",
                         tok_s=r["tok_s"]))
    return rows


# ------------------------------------------------------------------------------ 4. expert parallel
def moe_config(args) -> TransformerConfig:
    cfg = model_config(args)
    return cfg.replace(ffn="moe", n_experts=8, n_experts_per_tok=2, moe_expert_ffn="gelu_tanh", d_ff=cfg.d_model)


def ep_worker(rank: int, world_size: int, args, shard: bool) -> dict:
    apply_common_args(args)
    torch.manual_seed(0)
    model = TransformerLM(moe_config(args)).eval()
    if shard:
        shard_expert_parallel(model)
    idx = torch.randint(model.config.vocab_size, (4, args.prompt), generator=torch.Generator().manual_seed(1))
    rows = idx.chunk(world_size)[rank]  # each rank runs its own part of the batch
    with torch.no_grad():
        logits = model(rows)[0]
    experts = [p for name, p in model.named_parameters() if ".experts." in name]
    return dict(logits=logits, experts=local_bytes(experts), weights=local_bytes(model.parameters()),
                bytes_per_token=model.collectives.nbytes / rows.numel() if shard else 0.0)


def bench_ep(args) -> list[dict]:
    cfg = moe_config(args)
    one = run_processes(ep_worker, 1, args=(args, False), timeout=args.timeout)[0]
    two = run_processes(ep_worker, 2, args=(args, True), timeout=args.timeout)
    torch.testing.assert_close(torch.cat([r["logits"] for r in two]), one["logits"])  # EP == one process
    formula = cfg.n_layer * 2 * cfg.n_experts_per_tok * (2 - 1) / 2 * cfg.d_model * 4  # bytes per token
    rows = [dict(setup="1 process", experts_mb=one["experts"] / MB, experts_ratio=1.0, weights_mb=one["weights"] / MB,
                 weights_ratio=1.0, kb_token="-", formula_kb="-")]
    for rank, r in enumerate(two):
        rows.append(dict(setup=f"EP=2 rank {rank}", experts_mb=r["experts"] / MB,
                         experts_ratio=r["experts"] / one["experts"], weights_mb=r["weights"] / MB,
                         weights_ratio=r["weights"] / one["weights"], kb_token=f"{r['bytes_per_token'] / 1e3:.1f}",
                         formula_kb=f"{formula / 1e3:.1f}"))
    return rows


# --------------------------------------------------------------------- 5. prefill/decode disaggregation
PD_PROMPTS = (32, 128, 512)


def pd_worker(rank: int, world_size: int, args) -> dict:
    from mini_transformer import SamplingParams
    from mini_transformer.parallel.pd import run_disaggregated

    apply_common_args(args)
    torch.manual_seed(0)
    model = TransformerLM(model_config(args)).eval()
    lengths = [min(n, model.config.max_seq_len - 8) for n in PD_PROMPTS]
    prompts = [torch.randint(model.config.vocab_size, (n,)).tolist() for n in lengths]
    result = run_disaggregated(model, prompts, SamplingParams(max_tokens=8))  # block_size 16
    return dict(lengths=lengths, kv_bytes=result.kv_bytes, completions=result.completions, prompts=prompts)


def bench_pd(args) -> list[dict]:
    from mini_transformer import SamplingParams
    from mini_transformer.engine import EngineConfig, LLMEngine
    from mini_transformer.parallel.pd import kv_bytes_formula

    prefill, decode = run_processes(pd_worker, 2, args=(args,), timeout=args.timeout)
    torch.manual_seed(0)
    model = TransformerLM(model_config(args)).eval()
    engine = LLMEngine(model, EngineConfig(max_num_seqs=len(PD_PROMPTS)))  # the pool run_disaggregated sizes
    one = engine.generate(decode["prompts"], SamplingParams(max_tokens=8), use_tqdm=False)
    assert one == decode["completions"], "disaggregated completions differ from one engine"
    return [dict(prompt=n, kv_mb=b / MB, formula_mb=kv_bytes_formula(model, n) / MB, per_token_kb=b / n / 1e3)
            for n, b in zip(prefill["lengths"], prefill["kv_bytes"], strict=True)]


# --------------------------------------------------------------------------------- 2. FSDP vs DDP
def train_worker(rank: int, world_size: int, args, mode: str) -> dict:
    reset = _reset_peak_rss()  # a spawned process starts with its parent's high-water mark: forget it
    apply_common_args(args)
    torch.manual_seed(0)
    model = TransformerLM(model_config(args))
    if mode == "fsdp":
        shard_for_training(model)
    optimizer = make_optimizer(model, TrainConfig())
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    x = torch.randint(model_config(args).vocab_size, (args.batch, args.seq))

    def step():
        model(x, x)[1].backward()
        optimizer.step()

    timing = time_calls(step, repeats=1, warmup=1, grad="grad")  # the first step allocates the state
    memory = training_memory(model, optimizer)  # gradients kept (not zeroed) so they are counted
    return {**memory, "peak_rss": _peak_rss_bytes(reset), "step_s": timing.median}


def bench_train_memory(args) -> list[dict]:
    one = run_processes(train_worker, 1, args=(args, "single"), timeout=args.timeout)[0]
    rows = []
    for label, mode, world in (("1 process", "single", 1), ("DDP, 2 ranks", "ddp", 2), ("FSDP2, 2 ranks", "fsdp", 2)):
        r = one if mode == "single" else run_processes(train_worker, world, args=(args, mode), timeout=args.timeout)[0]
        total = r["params"] + r["grads"] + r["optimizer"]
        ref = one["params"] + one["grads"] + one["optimizer"]
        rows.append(dict(setup=label, params_mb=r["params"] / MB, grads_mb=r["grads"] / MB,
                         optim_mb=r["optimizer"] / MB, total_mb=total / MB, params_ratio=r["params"] / one["params"],
                         total_ratio=total / ref, rss_mb=r["peak_rss"] / MB, step_s=r["step_s"]))
    return rows


# -------------------------------------------------------------------- 3. activation checkpointing
def ac_case(args, preset: str, batch: int, seq: int, checkpointing: bool) -> dict:
    """One mode in this (fresh) process: extra peak memory of a step with gradients allocated, and its time."""
    apply_common_args(args)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = TransformerConfig.from_preset(preset, attn_backend="sdpa", activation_checkpointing=checkpointing)
    model = TransformerLM(cfg).to(device).train()
    x = torch.randint(cfg.vocab_size, (batch, min(seq, cfg.max_seq_len)), device=device)

    def step():
        model(x, x)[1].backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed_step():
        model.zero_grad(set_to_none=False)
        step()

    step()  # allocates the gradients (kept: zero_ does not free them) and loads the kernels
    model.zero_grad(set_to_none=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before, reset = _rss_bytes(), _reset_peak_rss()
        step()
        peak = _peak_rss_bytes(reset) - before
    timing = time_calls(timed_step, repeats=args.repeats, warmup=0, device=device, grad="grad")
    return dict(peak_mb=peak / MB, step_s=timing.median)


def bench_checkpointing(args) -> list[dict]:
    rows = []
    for case in args.ac_presets.split(","):  # preset:BxT
        preset, shape = case.split(":")
        results = {}
        for on in (False, True):
            cmd = [sys.executable, __file__, "--ac-worker", f"{preset}:{shape}:{int(on)}", *sys.argv[1:]]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"activation checkpointing case {preset} {on} failed:\n{done.stderr[-2000:]}")
            results[on] = json.loads(done.stdout.strip().splitlines()[-1])
        off = results[False]
        rows += [dict(setup=f"{preset} {shape}, {'on' if on else 'off'}", peak_mb=r["peak_mb"],
                      mem_ratio=r["peak_mb"] / off["peak_mb"], step_s=r["step_s"],
                      time_ratio=r["step_s"] / off["step_s"])
                 for on, r in results.items()]
    return rows


# ------------------------------------------------------------------------------------------ output
def plot(tp_rows, train_rows, ac_rows, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    axes[0].bar([r["setup"] for r in tp_rows], [r["weights_mb"] for r in tp_rows], color="tab:blue")
    axes[0].set_title("inference weights per rank (MB)")
    bottom = [0.0] * len(train_rows)
    for key, colour in (("params_mb", "tab:blue"), ("grads_mb", "tab:orange"), ("optim_mb", "tab:green")):
        values = [r[key] for r in train_rows]
        axes[1].bar([r["setup"] for r in train_rows], values, bottom=bottom, color=colour, label=key[:-3])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[1].set_title("training state per rank (MB)")
    axes[1].legend()
    axes[2].bar([r["setup"] for r in ac_rows], [r["peak_mb"] for r in ac_rows], color="tab:purple")
    axes[2].set_title("checkpointing: extra peak memory of a step (MB)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--quick", action="store_true", help="the shakespeare-char model: seconds, not minutes")
    p.add_argument("--prompt", type=int, default=32, help="TP: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16, help="TP: generated tokens")
    p.add_argument("--batch", type=int, default=2, help="training: sequences per rank")
    p.add_argument("--seq", type=int, default=128, help="training: tokens per sequence")
    p.add_argument("--repeats", type=int, default=7, help="checkpointing: timed steps (median)")
    add_common_args(p, threads=1, plot=None)  # --device: the checkpointing table only; --plot: a flag here
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--plot", action="store_true", help="write out/parallel.png")
    p.add_argument("--ac-presets", default="gpt2-small:2x128,llama-style:8x256",
                   help="checkpointing: PRESET:BATCHxSEQ, comma-separated (big enough to rise above allocator noise)")
    p.add_argument("--only", default="tp,ep,pd,train,ac", help="which tables: tp, ep, pd, train, ac (comma-separated)")
    p.add_argument("--ac-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pp", action="store_true", help="only table 6: pipeline parallelism (bench_pipeline.py)")
    bench_pipeline.add_arguments(p)
    args = p.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # tables appear as they are measured, even into a file
    if args.quick:
        args.preset = "shakespeare-char"
        args.seq = min(args.seq, 64)
        args.ac_presets = "shakespeare-char:8x64"
    if args.ac_worker is not None:
        preset, shape, on = args.ac_worker.split(":")
        batch, seq = map(int, shape.split("x"))
        print(json.dumps(ac_case(args, preset, batch, seq, on == "1")))
        return
    if args.pp:
        bench_pipeline.run(args)
        return
    print(f"load before: {os.getloadavg()}; preset {args.preset}, {args.threads} thread(s) per process")
    only = set(args.only.split(","))
    tp_rows, train_rows, ac_rows = [], [], []
    if "tp" in only:
        tp_rows = bench_tp(args)
        print("\n" + table(tp_rows, dict(setup="setup", weights_mb="weights MB", ratio="x one process",
                                       kb_token="collective KB/token", formula_kb="formula KB/token",
                                       tok_s="decode tok/s")))
    if "ep" in only:
        print("\n" + table(bench_ep(args), dict(setup="setup", experts_mb="expert weights MB", experts_ratio="x one",
                                                weights_mb="all weights MB", weights_ratio="x one",
                                                kb_token="all_to_all KB/token", formula_kb="uniform formula KB/token")))
    if "pd" in only:
        print("\n" + table(bench_pd(args), dict(prompt="prompt tokens", kv_mb="K/V sent MB", formula_mb="formula MB",
                                                per_token_kb="KB per prompt token")))
    if "train" in only:
        train_rows = bench_train_memory(args)
        print("\n" + table(train_rows, dict(setup="setup", params_mb="params MB", grads_mb="grads MB",
                                          optim_mb="AdamW MB", total_mb="total MB", params_ratio="params x one",
                                          total_ratio="total x one", rss_mb="peak RSS MB", step_s="step s")))
    if "ac" in only:
        ac_rows = bench_checkpointing(args)
        print("\n" + table(ac_rows, dict(setup="checkpointing", peak_mb="extra peak MB", mem_ratio="x off",
                                       step_s="step s", time_ratio="time x off")))
    print(f"\nload after: {os.getloadavg()}")
    if args.plot and tp_rows and train_rows and ac_rows:
        plot(tp_rows, train_rows, ac_rows, Path("out") / "parallel.png")


if __name__ == "__main__":
    main()
