"""OpenAI's request and response shapes: what comes in (pydantic models, checked at the door) and the
JSON that goes out (plain dicts built by small functions), field for field as OpenAI's API reference
gives them, so the official client and every OpenAI-speaking tool read our answers unchanged."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from ..inference.sampling import MAX_SAMPLING_FACTOR, SamplingParams


class ErrorResponse(Exception):
    """An OpenAI error object on its way out: {"error": {"message", "type", "param", "code"}} + status
    (+ headers: Retry-After on a 429, Allow on a 405)."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


MAX_N = 128  # choices per prompt (vLLM accepts this many too)
MAX_STOP_STRINGS = 64  # a sane cap: each is searched for after every token
MAX_STOP_LENGTH = 256  # characters; the longest one is held back from a stream until it cannot be a stop
# messages per chat request: pydantic builds each one holding the GIL, and a body of tens of thousands
# would hold the event loop; validation stops at the first one past the cap
MAX_CHAT_MESSAGES = 4096
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs; OpenAI's chat allows 20)
# seeds: torch's int64 range (choice j draws with seed + j), its top cut to 2**63 - 1024, the largest
# integer below 2**63 that a double holds exactly (schema tools compare bounds as doubles)
SEED_RANGE = (-(2**63), 2**63 - 1024)
# Known OpenAI / vLLM parameters this server cannot honour yet: sending one is a 400 naming it, never a
# 200 that quietly ignored it. Other unknown fields are ignored unread (vLLM's default).
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "structured_outputs",
               "audio", "modalities", "prediction", "suffix", "use_beam_search", "prompt_embeds")
CHAT_UNSUPPORTED = ("echo", "prompt_logprobs")  # /v1/completions has them
REFUSED = {**{name: f"{name} is not supported by this server" for name in UNSUPPORTED},
           **{name: f"{name} is not supported on chat completions (/v1/completions has it)"
              for name in CHAT_UNSUPPORTED}}
# Such a field is declared with this type, hidden from the schema: null or absent passes, any other value
# is a validation error (errors.py words it from REFUSED), checked without building the value in Python.
Refused = SkipJsonSchema[None]



def _whole_number(value):
    """JSON Schema counts 3.0 as an integer; the strict models below would not: let a whole float through."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# The request models are strict (JSON types as the schema says: "1" is no integer, "yes" no boolean),
# except that a whole float is an integer, as in JSON Schema.
def Int(**bounds):  # noqa: N802 (a type)
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


Count = Int(ge=0)
Text = Annotated[str, Field(min_length=1)]  # a prompt: every non-empty text has at least one token


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)  # JSON types as the schema says: "1" is not an int, "yes" no bool

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share. A field in UNSUPPORTED is refused (400); other unknown ones are
    ignored, as vLLM does, and never turned into Python objects (a body may carry megabytes of them)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"additionalProperties": True})

    model: str
    max_tokens: Count | None = None  # 0 only with echo (completions): score the prompt, generate nothing
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Int(ge=-1, le=2**31 - 1) | None = None  # -1 or 0: off (vLLM's convention)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(ge=1 / MAX_SAMPLING_FACTOR, le=MAX_SAMPLING_FACTOR)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # OpenAI's keys are token ids written as strings; values in [-100, 100]
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: Count = 0
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)] | None = None
    stop_token_ids: Annotated[list[Count], Field(fail_fast=True)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: Int(ge=SEED_RANGE[0], le=SEED_RANGE[1]) | None = None
    n: Int(ge=1, le=MAX_N) = 1
    # vLLM's prefill/decode hand-over, passed on by the router (server/kv_transfer.py checks its shape)
    kv_transfer_params: Any = None
    best_of: Int(ge=1, le=MAX_N) | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured output (server/structured.py): OpenAI's response_format, vLLM's guided_* fields
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(fail_fast=True)] | None = None
    guided_grammar: str | None = None
    # UNSUPPORTED, each refused unless null
    tools: Refused = None
    tool_choice: Refused = None
    functions: Refused = None
    function_call: Refused = None
    parallel_tool_calls: Refused = None
    structured_outputs: Refused = None
    audio: Refused = None
    modalities: Refused = None
    prediction: Refused = None
    suffix: Refused = None
    use_beam_search: Refused = None
    prompt_embeds: Refused = None

    def check_supported(self) -> None:
        """400 for a parameter we know and cannot honour (rather than a 200 that ignored it); the fields of
        UNSUPPORTED were refused by validation already."""
        if self.best_of is not None and self.best_of != self.n:
            raise ErrorResponse(400, f"best_of={self.best_of} is not supported: it must be absent or equal "
                                     f"n={self.n} (this server returns every choice it generates)", param="best_of")

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise ErrorResponse(400, "stop strings must not be empty", param="stop")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ErrorResponse(400, f"stop strings must be at most {MAX_STOP_LENGTH} characters long", param="stop")
        return stops

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """logit_bias with int keys, each a token id in [0, vocab_size) (400 naming logit_bias if not)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
                raise ErrorResponse(400, f"logit_bias key {key!r} must be a token id in [0, {vocab_size})",
                                    param="logit_bias")
            bias[int(key)] = value
        return bias

    def sampling_params(self, max_tokens: int, choice: int, vocab_size: int, *, logprobs: int | None = None,
                        prompt_logprobs: int | None = None, structured=None) -> SamplingParams:
        """One choice's SamplingParams: choice j of a seeded request draws with seed + j, so the n
        choices differ from each other and each is reproducible. EOS is not among the stop ids here:
        the engine was given the tokenizer's EOS and adds it (unless ignore_eos)."""
        top_k = self.top_k if self.top_k not in (None, -1, 0) else None
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature, top_k=top_k,
                top_p=self.top_p, min_p=self.min_p or None, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                logit_bias=self.token_bias(vocab_size), min_tokens=self.min_tokens, max_tokens=max_tokens,
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                seed=None if self.seed is None else self.seed + choice,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured,
            )
        except (TypeError, ValueError) as err:  # a rule across fields (min_tokens <= max_tokens): name the field
            param = next((f for f in self.model_fields_set | {"max_tokens"} if str(err).startswith(f + "=")), None)
            raise ErrorResponse(400, str(err), param=param) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# fail_fast: a list stops at its first wrong item; otherwise every prompt form of the union below would
# record one error per item of a prompt of another form (millions, for a large body) before one matches
TokenIds = Annotated[list[Count], Field(min_length=1, fail_fast=True)]
Texts = Annotated[list[Text], Field(min_length=1, fail_fast=True)]
TokenIdLists = Annotated[list[TokenIds], Field(min_length=1, fail_fast=True)]


class CompletionRequest(_SamplingFields):
    # text, several texts, token ids, or several lists of token ids
    prompt: Text | Texts | TokenIds | TokenIdLists
    echo: bool = False  # the prompt comes back in front of the text (and its logprobs with logprobs=N)
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None  # vLLM's: each prompt token's, by token id

    def check_supported(self) -> None:
        super().check_supported()
        if self.prompt_logprobs is not None and self.stream:
            raise ErrorResponse(400, "prompt_logprobs is not supported with stream=true", param="prompt_logprobs")


class TextPart(BaseModel):
    """OpenAI's content part; only text is understood here (an image or audio part is a 400)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES, fail_fast=True)]
    max_completion_tokens: Int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    add_generation_prompt: bool = True
    # CHAT_UNSUPPORTED: fields of vLLM's chat request this server does not honour on chat, refused unless
    # null (or false: echo=false asks for nothing)
    echo: SkipJsonSchema[Literal[False] | None] = None
    prompt_logprobs: Refused = None


# ------------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


MAX_REQUEST_ID_CHARS = 128


def client_request_id(header: str | None) -> str | None:
    """The X-Request-Id a client or router sent, if it is a sane one (printable ASCII, no spaces, not too
    long); the response's id is built from it, as vLLM does. Anything else is ignored, not refused."""
    if header and len(header) <= MAX_REQUEST_ID_CHARS and header.isascii() and header.isprintable() \
            and " " not in header:
        return header
    return None


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, choices: list[tuple[str, str]], logprobs: list, use: dict,
                        prompt_logprobs: list | None = None) -> dict:
    """choices: (text, finish_reason) in choice order; logprobs: each choice's logprobs object or None;
    prompt_logprobs: each choice's vLLM prompt_logprobs list, when the request asked for them."""
    out = {"id": rid, "object": "text_completion", "created": now(), "model": model,
           "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
                       for i, ((text, finish), lp) in enumerate(zip(choices, logprobs, strict=True))],
           "usage": use}
    for choice, prompt in zip(out["choices"], prompt_logprobs or (), strict=False):
        choice["prompt_logprobs"] = prompt
    return out


def completion_chunk(rid: str, model: str, created: int, index: int, text: str, logprobs: dict | None,
                     finish_reason: str | None, with_usage: bool) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _stream_chunk(rid, "text_completion", model, created, choice, with_usage)


def chat_response(rid: str, model: str, choices: list[tuple[str, str]], logprobs: list, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                         "finish_reason": finish}
                        for i, ((text, finish), lp) in enumerate(zip(choices, logprobs, strict=True))],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict, logprobs: dict | None,
               finish_reason: str | None, with_usage: bool) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _stream_chunk(rid, "chat.completion.chunk", model, created, choice, with_usage)


def _stream_chunk(rid: str, obj: str, model: str, created: int, choice: dict, with_usage: bool) -> dict:
    """One streamed chunk of either endpoint: the envelope around the one choice it carries."""
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if with_usage:  # OpenAI sends "usage": null on every chunk but the last when include_usage is on
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, obj: str, model: str, created: int, use: dict) -> dict:
    """The last chunk of a stream with include_usage: no choices, the whole request's usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def model_card(model: str, max_model_len: int) -> dict:
    return {"id": model, "object": "model", "created": now(), "owned_by": "mini-transformer",
            "max_model_len": max_model_len}


def models_response(model: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [model_card(model, max_model_len)]}
