"""bench_serving.py --hf-peer: the engine against Hugging Face's continuous batching (`model.generate_batch`,
paged attention) on the same weights, and what both bench_serving workloads share for timing the engine:
ForwardTimer (the model's share of a step) and warm_up (compile the CPU decode attention first).

A random HF Llama (6 layers, d_model 384, GQA, vocab 8192) and ours imported from it; 48 prompts of
min..max tokens, 64 greedy tokens each; runs alternate ours, HF, ours, HF; outputs must be identical.
--profile adds a torch.profiler run of the engine: the share of time outside the weight matmuls.
"""

from __future__ import annotations

import os
import random
import time

import torch

from mini_transformer import SamplingParams, TransformerConfig, TransformerLM
from mini_transformer.engine import EngineConfig, LLMEngine


class ForwardTimer:
    """Seconds spent inside the model's forward pass, from the token embedding to the LM head (hooks on
    those two layers: the engine calls model.logits, which the root module's hooks do not see), to split a
    step into the model's work and the host's (scheduling, inputs, sampling, outputs). One per model."""

    def __init__(self, model):
        self.seconds, self._start = 0.0, 0.0
        model.tok_emb.register_forward_pre_hook(lambda *_: setattr(self, "_start", time.perf_counter()))
        model.lm_head.register_forward_hook(self._stop)

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._start

    @classmethod
    def of(cls, model) -> ForwardTimer:
        if not hasattr(model, "_forward_timer"):
            model._forward_timer = cls(model)
        return model._forward_timer


def warm_up(model, args) -> None:
    """Compile the CPU decode attention for every shape family before anything is timed (as serve does)."""
    from mini_transformer.server.run import warm_up_engine

    warm_up_engine(LLMEngine(model, EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                                 max_num_batched_tokens=args.max_num_batched_tokens)))


# ------------------------------------------------------------- Hugging Face continuous batching
def hf_llama_pair(vocab: int, max_len: int):
    """A random HF Llama shaped like the llama-style preset and ours imported from it: the same weights."""
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = TransformerConfig.from_preset("llama-style", vocab_size=vocab, max_seq_len=max_len)
    hf_cfg = LlamaConfig(vocab_size=vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                         num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=max_len,
                         rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = TransformerLM.from_pretrained(tmp)  # a HF directory: attn_backend "sdpa"
    return ours.eval(), hf


def host_share(model, prompts, params, args) -> tuple[float, list[list[int]], float]:
    """Run the engine; return (seconds, outputs, host share = 1 - forward time / step time)."""
    timer = ForwardTimer.of(model)
    engine = LLMEngine(model, EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens))
    timer.seconds = 0.0
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, outputs, 1 - timer.seconds / seconds


def hf_peer_workload(args, n_prompts=48, new_tokens=64, runs=2):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    ours, hf = hf_llama_pair(8192, 2 * args.max_len)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8192) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(n_prompts)]
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    cb = ContinuousBatchingConfig(
        block_size=args.block_size, num_blocks=4096, max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    times = {"engine": [], "hf": []}
    warm_up(ours, args)
    for _ in range(runs):  # alternating: ours, theirs, ours, theirs
        seconds, ours_out, share = host_share(ours, prompts, params, args)
        times["engine"].append(seconds)
        start = time.perf_counter()
        result = hf.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        times["hf"].append(time.perf_counter() - start)
    hf_out = [list(result[f"req_{i}"].generated_tokens) for i in range(n_prompts)]
    same = sum(a == b for a, b in zip(ours_out, hf_out, strict=True))
    n_tokens = n_prompts * new_tokens
    print(f"\nHF peer: {n_prompts} prompts of {args.min_len}-{args.max_len} tokens, {new_tokens} greedy tokens each, "
          f"Llama 6x384 GQA vocab 8192, same weights; uptime load {os.getloadavg()[0]:.2f}\n")
    print("| way | seconds (each run) | output tok/s (best) | × HF generate_batch |")
    print("|---|---|---:|---:|")
    best_hf = min(times["hf"])
    for name, label in (("hf", "HF model.generate_batch"), ("engine", "engine")):
        runs_text = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"| {label} | {runs_text} | {n_tokens / min(times[name]):.1f} | {best_hf / min(times[name]):.2f}× |")
    print(f"\noutputs identical to HF's: {same} of {n_prompts}; engine host share of a step (last run): {share:.1%}")
    if args.profile:
        profile_matmul_share(ours, prompts, params, args)


def profile_matmul_share(model, prompts, params, args) -> None:
    """torch.profiler over one engine run of the workload: the share of time outside the weight matmuls
    (every Linear of the model, the LM head included: oneDNN's packed linear, or aten::mm unpacked), then
    the top ops by self time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = LLMEngine(model, EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens))
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("engine run"):
        engine.generate(prompts, params, use_tqdm=False)
    events = {e.key: e for e in prof.key_averages()}
    total = events["engine run"].cpu_time_total
    mm = sum(events[k].self_cpu_time_total for k in ("aten::mm", "mkldnn::_linear_pointwise") if k in events)
    print(f"\nprofile of one engine run ({total / 1e6:.2f} s under the profiler; uptime load "
          f"{os.getloadavg()[0]:.2f}): weight matmuls {100 * mm / total:.1f}%, time outside them "
          f"{100 * (1 - mm / total):.1f}%; top ops by self CPU time:\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
