"""The tokenizer over HTTP, in vLLM's shapes, so clients need no tokenizer of their own:

    POST /tokenize        {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
    GET  /tokenizer_info  the tokenizer's class, size, special tokens and chat template

lm-eval's `local-completions` probes /tokenizer_info and /tokenize and, when both answer, counts and
cuts its contexts with them (its "remote" tokenizer backend): no tokenizer download, offline.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from .limits import check_prompt_bytes
from .protocol import ChatMessage, Count, ErrorResponse
from .schema import describe


class _TokenizerRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    add_special_tokens: bool = True  # accepted for vLLM's clients; our tokenizers add no special tokens
    return_token_strs: bool = False


class TokenizeText(_TokenizerRequest):
    prompt: str


class TokenizeChat(_TokenizerRequest):
    """The messages are rendered through the chat template first."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    add_generation_prompt: bool = True


class DetokenizeRequest(_TokenizerRequest):
    tokens: Annotated[list[Count], Field(fail_fast=True)]


TOKENIZE_BODY = TypeAdapter(TokenizeText | TokenizeChat)
DETOKENIZE_BODY = TypeAdapter(DetokenizeRequest)


def add_tokenizer_routes(app: FastAPI, ctx, require_key) -> None:
    codec = ctx.codec

    def check_model(model: str | None) -> None:
        if model is not None and model != ctx.model_name:
            raise ErrorResponse(404, f"model {model!r} does not exist; this server serves {ctx.model_name!r}",
                                param="model", code="model_not_found")

    def encode(body: TokenizeText | TokenizeChat) -> list[int]:
        if isinstance(body, TokenizeChat):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            check_prompt_bytes(ctx.limits, "".join(m["content"] or "" for m in messages), "messages")
            text, param = codec.render_chat(messages, body.add_generation_prompt), "messages"
        else:
            check_prompt_bytes(ctx.limits, body.prompt, "prompt")
            text, param = body.prompt, "prompt"
        try:
            return codec.tokenizer.encode(text)
        except ValueError as err:
            raise ErrorResponse(400, f"{param}: {err}", param=param) from None

    @app.post("/tokenize", dependencies=[Depends(require_key)], **describe("tokenize", (TokenizeText, TokenizeChat)))
    async def tokenize(request: Request):
        body = await ctx.workers.parse(TOKENIZE_BODY, request)  # parsed on a worker, as every body (limits.py)
        check_model(body.model)
        ids = await ctx.workers.run(encode, body)  # a long text must not stall the event loop
        strs = [codec.token_text(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", dependencies=[Depends(require_key)], **describe("detokenize", (DetokenizeRequest,)))
    async def detokenize(request: Request):
        body = await ctx.workers.parse(DETOKENIZE_BODY, request)
        check_model(body.model)
        bad = [t for t in body.tokens if t >= ctx.vocab_size]
        if bad:
            raise ErrorResponse(400, f"tokens {bad[:5]} are outside the vocabulary [0, {ctx.vocab_size})",
                                param="tokens")
        return {"prompt": codec.decode(body.tokens)}

    @app.get("/tokenizer_info", dependencies=[Depends(require_key)], **describe("tokenizer_info"))
    async def tokenizer_info():
        eos = codec.eos_token or (None if codec.eos_token_id is None else codec.token_text(codec.eos_token_id))
        # eos_token ends a text (a character vocabulary's newline, where its generation does not stop)
        return {"tokenizer_class": "PreTrainedTokenizerFast", "vocab_size": ctx.vocab_size,
                "model_max_length": ctx.max_model_len, "eos_token": eos,
                "bos_token": codec.bos_token or None, "pad_token": None,
                "chat_template": codec.chat_template_source, "tokenizer_kind": codec.tokenizer.kind}
