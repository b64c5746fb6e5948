"""bench_decode_speed.py --vs-llama-cpp: our batch-1 decode against llama.cpp on the same random Llama.

The model: a GPT-2-small-sized Llama (768 hidden, 12 layers, 12 query / 4 key-value heads, SwiGLU 2048,
vocab 32000, untied head; 124.7M parameters), random weights, saved as a Hugging Face directory. Ours
loads that directory; llama.cpp gets it through its OWN converter (convert_hf_to_gguf.py, shipped in the
llama-cpp-python sdist) as f32 / f16 / q8_0 GGUF, and Q4_0 from llama.cpp's quantizer. Each precision is
paired with ours: f32 ~ fp32 compiled, f16 ~ bf16 compiled, q8_0 ~ int8, Q4_0 ~ int4 group 64.

llama.cpp runs in a worker process (the Python that has `llama_cpp`: this one, or --llama-python), so
its OpenMP runtime never meets torch's; the two systems take turns, run by run (A B A B), and every run
times the same thing: a 64-token prompt prefilled, then 255 greedy decode steps (only those are timed).
Install llama.cpp's Python binding in a throwaway venv (it builds from source, ~16+ min on 2 cores):

    uv venv "$LLAMA_VENV" && uv pip install --python "$LLAMA_VENV" llama-cpp-python gguf   # LLAMA_VENV: any folder
    LLAMA_PYTHON="$LLAMA_VENV/bin/python"
    python benchmarks/bench_decode_speed.py --vs-llama-cpp --llama-python "$LLAMA_PYTHON"

On a CPU with AMX, a native build's AMX path for q8_0 / Q4_0 weights can crash while loading them (seen with
llama-cpp-python 0.3.36); build it with every AVX-512 path and AMX left out (uv reuses a cached build unless
told not to):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
      -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON" uv pip install --no-cache --python "$LLAMA_VENV" llama-cpp-python
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the llama.cpp worker runs this file in a Python without torch
    import torch

LLAMA = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6)
PAIRS = (("f32", "fp32"), ("f16", "bf16"), ("q8_0", "int8"), ("Q4_0", "int4"))  # llama.cpp file, ours
HERE = Path(__file__).resolve()


def find_converter() -> Path | None:
    """llama.cpp's checkout inside a llama-cpp-python sdist: uv's cache, or $LLAMA_CPP_DIR."""
    roots = [os.environ.get("LLAMA_CPP_DIR", "")]
    roots += glob.glob(str(Path.home() / ".cache/uv/sdists-*/pypi/llama-cpp-python/*/*/src/vendor/llama.cpp"))
    return next((Path(r) for r in roots if r and (Path(r) / "convert_hf_to_gguf.py").is_file()), None)


def llama_python(args) -> str | None:
    """A Python that imports llama_cpp: --llama-python, or this one."""
    for python in (args.llama_python, sys.executable):
        if python and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
            return python
    return None


def write_model(root: Path, config: dict = LLAMA) -> Path:
    """The random Llama (`config`: LlamaConfig's fields) as a Hugging Face directory, with a small byte-level
    BPE tokenizer (the converter wants one; the ids above its size are padded by the converter; timing
    feeds ids, never text)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config, bos_token_id=1, eos_token_id=2)).save_pretrained(root)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [Path(__file__).read_text()] * 4
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "bos_token": "<s>", "eos_token": "</s>"}))
    return root


CONVERT = """import runpy, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']
import conversion.base, conversion.llama
# our tokenizer is a byte-level BPE trained here: go straight to the converter's GPT-2 vocabulary path (the
# Llama default tries sentencepiece first), and declare its pre-tokenizer (no entry in llama.cpp's hash table)
conversion.llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'
sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py'] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def convert(llama_dir: Path, model_dir: Path, out: Path, outtype: str) -> None:
    cmd = [sys.executable, "-c", CONVERT, str(llama_dir), str(model_dir), "--outtype", outtype, "--outfile", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{result.stderr[-3000:]}")


class LlamaWorker:
    """llama.cpp in its own process: one JSON line in, one out."""

    def __init__(self, python: str):
        self.proc = subprocess.Popen([python, str(HERE), "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def call(self, **request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the llama.cpp worker died on {request}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def worker() -> None:
    """The loop bench runs in the llama_cpp Python: load / quantize / run, greedy, flash attention off and
    an f32 KV cache (its f32 default computes attention in f16), logits of the last token only."""
    import llama_cpp
    import numpy as np

    models = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "quantize":
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
            params.nthread = 2
            rc = llama_cpp.llama_model_quantize(req["src"].encode(), req["dst"].encode(), params)
            out = {"rc": rc}
        elif req["cmd"] == "load":
            models[req["key"]] = llama_cpp.Llama(
                req["path"], n_ctx=512, n_batch=512, n_threads=req["threads"], n_threads_batch=req["threads"],
                flash_attn=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
            out = {"ok": True}
        else:  # run: prefill the prompt, then n - 1 timed greedy steps
            llm = models[req["key"]]
            # the last token's logits, read where llama.cpp wrote them (Llama.scores is filled only with
            # logits_all=True, which would copy every prompt row too)
            def last(llm=llm):
                return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))

            llm.reset()
            llm.eval(req["prompt"])
            tokens = [int(np.argmax(last()))]
            start = time.perf_counter()
            for _ in range(req["n"] - 1):
                llm.eval(tokens[-1:])
                tokens.append(int(np.argmax(last())))
            out = {"seconds": time.perf_counter() - start, "tokens": tokens}
        print(json.dumps(out), flush=True)


def our_models(model_dir: Path, group_size: int) -> dict:
    import copy

    import torch

    from mini_transformer import TransformerLM
    from mini_transformer.model.quantize import quantize

    fp32 = TransformerLM.from_pretrained(model_dir, attn_backend="sdpa").eval()
    return {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16),
            "int8": quantize(copy.deepcopy(fp32), "int8"), "int4": quantize(copy.deepcopy(fp32), "int4", group_size)}


def our_run(model, prompt: torch.Tensor, n: int, eager: bool = False) -> tuple[float, list[int]]:
    """(seconds of the n - 1 decode steps, tokens): timed from the first sampled token to the last."""
    from mini_transformer import generate

    stamps = []
    tokens = generate(model, prompt, n, compile=not eager, stream=lambda _: stamps.append(time.perf_counter()))
    return stamps[-1] - stamps[0], tokens[0].tolist()


TARGETS = {"fp32": 1.0, "bf16": 0.9, "int8": 1.0, "int4": 0.7}  # ours / llama.cpp at 1 thread


def how_to_install(missing: str) -> None:
    print(f"--vs-llama-cpp skipped: {missing}. Build llama.cpp's Python binding in a throwaway venv "
          "(~16+ min on 2 cores), then point this script at it:\n"
          '  uv venv "$LLAMA_VENV" && uv pip install --python "$LLAMA_VENV" llama-cpp-python gguf\n'
          '  LLAMA_PYTHON="$LLAMA_VENV/bin/python"   # LLAMA_VENV: any folder you choose\n'
          '  python benchmarks/bench_decode_speed.py --vs-llama-cpp --llama-python "$LLAMA_PYTHON"\n'
          "(the converter is found in uv's sdist cache, or set LLAMA_CPP_DIR to a llama.cpp checkout)")


def run(args) -> None:
    import torch
    from _decode_roofline import kv_bytes_per_slot, measure_bandwidth, weight_bytes

    from mini_transformer.inference.static_cache import static_length

    llama_dir, python = find_converter(), llama_python(args)
    if python is None:
        return how_to_install("no Python here imports llama_cpp")
    if llama_dir is None:
        return how_to_install("llama.cpp's convert_hf_to_gguf.py was not found")
    work = Path(tempfile.mkdtemp(prefix="vs-llama-cpp-"))
    model_dir = write_model(work / "hf")
    paths = {name: work / f"model-{name}.gguf" for name, _ in PAIRS}
    for name in ("f32", "f16", "q8_0"):
        convert(llama_dir, model_dir, paths[name], name)
    peer = LlamaWorker(python)
    assert peer.call(cmd="quantize", src=str(paths["f32"]), dst=str(paths["Q4_0"]))["rc"] == 0
    ours = our_models(model_dir, args.group_size)
    n, T = args.llama_new_tokens, 64
    prompt = torch.randint(3, LLAMA["vocab_size"], (1, T))
    print(f"llama.cpp from {python}; converter {llama_dir}; load average {os.getloadavg()[0]:.2f}")
    rows = []
    for threads in args.llama_threads:
        torch.set_num_threads(threads)
        _, bandwidth = measure_bandwidth("cpu")
        for name, _ in PAIRS:
            peer.call(cmd="load", key=f"{name}/{threads}", path=str(paths[name]), threads=threads)
        runs = {}
        for name, mine in PAIRS:  # warm-up (and our compile) at the timed length
            runs[name] = peer.call(cmd="run", key=f"{name}/{threads}", prompt=prompt[0].tolist(), n=n)
            runs[mine] = dict(zip(("seconds", "tokens"), our_run(ours[mine], prompt, n), strict=True))
        best = {key: float("inf") for key in runs}
        for _ in range(args.repeats):  # the two systems take turns, run by run
            for name, mine in PAIRS:
                best[name] = min(best[name], peer.call(cmd="run", key=f"{name}/{threads}",
                                                       prompt=prompt[0].tolist(), n=n)["seconds"])
                best[mine] = min(best[mine], our_run(ours[mine], prompt, n)[0])
        if args.with_eager:
            best["eager"] = min(our_run(ours["fp32"], prompt, n, eager=True)[0] for _ in range(args.repeats))
        slots = static_length(T + n, ours["fp32"].config.max_seq_len)
        for name, mine in PAIRS:
            read = weight_bytes(ours[mine]) + slots * kv_bytes_per_slot(ours[mine].config,
                                                                         ours[mine].tok_emb.weight.element_size())
            pairs = zip(runs[name]["tokens"], runs[mine]["tokens"], strict=True)
            same = next((i for i, (a, b) in enumerate(pairs) if a != b), n)  # tokens equal before the first difference
            rows.append(dict(threads=threads, peer=name, ours=mine, peer_tok_s=(n - 1) / best[name],
                             tok_s=(n - 1) / best[mine], gbs=(n - 1) / best[mine] * read / 1e9,
                             roof=bandwidth / 1e9, same=same))
        if "eager" in best:
            rows.append(dict(threads=threads, peer="f32", ours="fp32 eager", peer_tok_s=(n - 1) / best["f32"],
                             tok_s=(n - 1) / best["eager"], gbs=float("nan"), roof=bandwidth / 1e9, same=-1))
    peer.close()
    print(f"\nbatch 1, greedy, prompt {T}, {n - 1} timed decode steps, best of {args.repeats} alternating runs; "
          f"load average at the end {os.getloadavg()[0]:.2f}")
    print("| threads | llama.cpp | tok/s | ours | tok/s | ours ÷ llama.cpp | target | ours GB/s (read roof) "
          f"| greedy tokens equal, from the first (of {n}) |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        target = TARGETS.get(r["ours"], float("nan")) if r["threads"] == 1 else float("nan")
        same = "-" if r["same"] < 0 else r["same"]
        print(f"| {r['threads']} | {r['peer']} | {r['peer_tok_s']:.1f} | {r['ours']} | {r['tok_s']:.1f} | "
              f"{r['tok_s'] / r['peer_tok_s']:.2f} | {target:.1f} | {r['gbs']:.1f} ({r['roof']:.1f}) | {same} |")
    missed = [r["ours"] for r in rows if r["tok_s"] / r["peer_tok_s"] < TARGETS.get(r["ours"], 0)]
    for mine in dict.fromkeys(missed):  # where a target is missed: where a step's time goes
        profile_steps(ours[mine], prompt, mine, n)


def profile_steps(model, prompt: torch.Tensor, name: str, steps: int) -> None:
    from torch.profiler import profile

    with profile() as prof:
        our_run(model, prompt, steps)
    print(f"\nprofile of {steps} decode steps (and one prefill), ours {name}: ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__" and "--worker" in sys.argv:
    worker()
