"""`mini-transformer sample`: continue prompts with a checkpoint, streamed (one prompt) or through the
serving engine (several)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from .options import add_model_options, load_model


def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="continue prompts with a trained checkpoint (one streams; several run "
                                      "through the serving engine)")
    p.add_argument("--checkpoint", required=True, help="our checkpoint dir or a Hugging Face GPT-2/Llama dir")
    p.add_argument("--prompt", action="append", default=[],
                   help="text to continue; repeat it for several prompts (they run as one engine batch)")
    p.add_argument("--prompts-file", help="a text file with one prompt per line (empty lines skipped)")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to generate; past the model's context the window slides")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="re-run the whole sequence every step (slow; to compare)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true",
                   help="decode from a static cache with a step compiled once (the first call compiles)")
    add_model_options(p)
    p.add_argument("--draft-checkpoint", help="a small model sharing the tokenizer: speculative decoding")
    p.add_argument("--prompt-lookup", action="store_true", help="speculative decoding with n-gram drafts from the text")
    p.add_argument("--speculative-tokens", type=int, default=4, help="tokens drafted per target pass")
    p.add_argument("--tensor-parallel", action="store_true",
                   help="under torchrun: split heads, FFN and vocabulary over the ranks (rank 0 prints)")
    p.add_argument("--pipeline-parallel", type=int, metavar="N",
                   help="under torchrun with N ranks: each keeps 1/N of the layers and their KV cache (rank 0 prints)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="structured output: the text must match this JSON schema")
    shape.add_argument("--regex", help="structured output: the text must match this regular expression")
    shape.add_argument("--choice", help="structured output: one of these comma-separated strings (a,b,c)")
    p.set_defaults(func=_run_sample)


class _TextStream:
    """Print each step's new text as soon as it is known (the tokenizer's IncrementalDecoder: a trailing
    window decoded per step, an unfinished character waits for the next token)."""

    def __init__(self, tokenizer, out, prompt: str):
        from ..tokenizer import IncrementalDecoder

        self.decoder = IncrementalDecoder(tokenizer)
        self.out, self.prompt = out, prompt

    def __call__(self, step_ids) -> None:
        if not self.decoder.ids:  # the prompt is echoed once generation has really started (no error came first)
            self.out.write(self.prompt)
        self.out.write(self.decoder.add([int(step_ids[0])]))
        self.out.flush()

    def flush(self, final: bool = True) -> None:
        self.out.write(self.decoder.add([], final=final))
        self.out.flush()


def _run_sample(args) -> None:
    import torch

    from ..checkpoint import resolve_checkpoint_dir
    from ..inference.generate import generate_long
    from ..inference.sampling import SamplingParams
    from ..model.transformer import TransformerLM
    from ..tokenizer import check_vocab_size, load_tokenizer
    from ..training.runtime import resolve_device

    prompts = _read_prompts(args)
    if args.max_new_tokens < 1:  # the one flag whose name is not its SamplingParams field's (max_tokens)
        raise ValueError(f"--max-new-tokens: max_new_tokens={args.max_new_tokens} must be a positive integer")
    params = SamplingParams(  # the door of every other sampling flag
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
        structured=_structured_output(args),
    )
    device = resolve_device(args.device)
    checkpoint = resolve_checkpoint_dir(args.checkpoint)  # `best` is found even mid-save
    model = _load_sample_model(args, checkpoint, device)  # verifies the manifest first
    tokenizer = load_tokenizer(checkpoint)
    check_vocab_size(tokenizer, model.config.vocab_size, checkpoint)
    parallel, out = _shard_if_parallel(args, model, device, prompts)
    if len(prompts) > 1 or params.structured is not None:  # the grammar mask lives in the engine's sampler
        if params.structured is not None and (args.compile or args.draft_checkpoint or args.prompt_lookup
                                              or args.no_cache or parallel):
            raise ValueError("--json-schema/--regex/--choice run through the serving engine: leave out --compile, "
                             "--draft-checkpoint, --prompt-lookup (speculative decoding is refused with a "
                             "constraint), --no-cache, --tensor-parallel and --pipeline-parallel")
        _sample_with_engine(model, tokenizer, prompts, params)
        return
    prompt_ids = tokenizer.encode(prompts[0])
    if not prompt_ids:
        raise ValueError("--prompt is empty; give at least one character of text to continue")
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    if args.compile:  # inductor imports cpp_extension at the first compiled step, which on a machine without
        # CUDA logs "No CUDA runtime is found" to stderr; imported now, that line comes before the text, not inside it
        import torch.utils.cpp_extension  # noqa: F401
    stream = _TextStream(tokenizer, out, prompts[0])
    # past max_seq_len generate_long slides the context window (re-prefilling its second half)
    draft = "prompt_lookup" if args.prompt_lookup else None
    if args.draft_checkpoint:
        draft = TransformerLM.from_pretrained(args.draft_checkpoint, device=device)
    generate_long(model, idx, params, eos_token_id=tokenizer.eos_token_id, use_cache=not args.no_cache,
                  stream=stream, compile=args.compile, draft_model=draft,
                  num_speculative_tokens=args.speculative_tokens)
    stream.flush()
    out.write("\n")


def _shard_if_parallel(args, model, device, prompts):
    """-> (the parallel flag given, if any, as a list; where to print). Under --tensor-parallel or
    --pipeline-parallel every rank runs the same loop on its shard or stage, and only rank 0 prints."""
    parallel = [flag for flag, on in (("--tensor-parallel", args.tensor_parallel),
                                      ("--pipeline-parallel", args.pipeline_parallel is not None)) if on]
    if not parallel:
        return parallel, sys.stdout
    if len(parallel) > 1:
        raise ValueError("--tensor-parallel and --pipeline-parallel do not combine here; choose one")
    if len(prompts) > 1:
        raise ValueError(f"{parallel[0]} continues one --prompt (several go through the engine, one process)")
    if args.quantize or args.compile or args.draft_checkpoint or args.prompt_lookup:
        raise ValueError(f"{parallel[0]} runs the plain model: leave out --quantize, --compile, "
                         "--draft-checkpoint and --prompt-lookup")
    if args.tensor_parallel:
        from ..parallel.tp import shard_for_command_line

        return parallel, shard_for_command_line(model, device)
    from ..parallel.pp_inference import shard_for_command_line

    return parallel, shard_for_command_line(model, device, args.pipeline_parallel)


def _load_sample_model(args, checkpoint, device):
    """The checkpoint in the precision --dtype / --quantize ask for."""
    if args.draft_checkpoint and args.prompt_lookup:
        raise ValueError("--draft-checkpoint and --prompt-lookup are two drafters; choose one")
    return load_model(checkpoint, device, args)


def _structured_output(args):
    """--json-schema FILE, --regex R or --choice a,b,c as a StructuredOutput (None without any)."""
    import json

    from ..inference.structured import StructuredOutput

    try:
        if args.json_schema:
            try:
                text = Path(args.json_schema).read_text(encoding="utf-8")
            except OSError as err:
                raise ValueError(f"--json-schema {args.json_schema!r} cannot be read: {err.strerror}") from None
            try:
                return StructuredOutput(json_schema=json.loads(text))
            except json.JSONDecodeError as err:
                raise ValueError(f"--json-schema {args.json_schema!r} is not valid JSON ({err})") from None
        if args.regex is not None:
            return StructuredOutput(regex=args.regex)
        if args.choice is not None:
            return StructuredOutput(choice=args.choice.split(","))
    except TypeError as err:
        raise ValueError(f"--json-schema/--regex/--choice: {err}") from None
    return None


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"--prompts-file {args.prompts_file!r} cannot be read: {err.strerror}") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give a prompt: --prompt TEXT (repeat it for several) or --prompts-file FILE")
    return prompts


def _sample_with_engine(model, tokenizer, prompts: list[str], params) -> None:
    """Several prompts as one batch of requests in the serving engine; each prompt gets its own seed
    (seed + i), so a completion does not depend on the others. The completions print in prompt order."""
    from ..engine import EngineConfig, LLMEngine

    context = model.config.max_seq_len
    ids, per_prompt = [], []
    for i, prompt in enumerate(prompts):
        prompt_ids = tokenizer.encode(prompt)
        if not prompt_ids or len(prompt_ids) >= context:
            raise ValueError(f"prompt {i + 1} ({prompt[:40]!r}) encodes to {len(prompt_ids)} tokens; the engine "
                             f"needs 1 to {context - 1} (the model's max_seq_len is {context})")
        room = min(params.max_tokens, context - len(prompt_ids))  # the engine does not slide past the context
        seed = None if params.seed is None else params.seed + i
        ids.append(prompt_ids)
        per_prompt.append(dataclasses.replace(params, max_tokens=room, seed=seed))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max(1, len(prompts))), eos_token_id=tokenizer.eos_token_id,
                       tokenizer=tokenizer)
    for prompt, completion in zip(prompts, engine.generate(ids, per_prompt, use_tqdm=len(prompts) > 1), strict=True):
        if params.structured is not None and completion and completion[-1] == tokenizer.eos_token_id:
            completion = completion[:-1]  # where the grammar ended, not a part of the text
        sys.stdout.write(prompt + tokenizer.decode(completion) + "\n\n")
    sys.stdout.flush()
