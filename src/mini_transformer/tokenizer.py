"""Tokenizers: characters (the default, vocabulary from the training text) and byte-level BPE
trained with the Hugging Face `tokenizers` library. Both save to and load from a checkpoint directory.

Every directory a tokenizer is saved to also gets a Hugging Face `tokenizer.json` and
`tokenizer_config.json`, so `transformers.AutoTokenizer.from_pretrained(dir)` (and with it lm-eval,
guidellm, any HF-speaking tool, offline) gives the same ids as ours. For the character vocabulary that
file is a word-level model over the characters, each character its own piece, joined back without
spaces on decoding; ours keeps reading `vocab.json` (it is found first). `tokenizer_config.json` also
names the BOS/EOS tokens, the context length (`model_max_length`) and the chat template the server renders
(`CHAT_TEMPLATE`), so `apply_chat_template` and lm-eval's rolling loglikelihood (which starts each window
after the BOS token, or the EOS token when BOS has id 0) work on our checkpoints.

EOS is two things, as in Hugging Face: the token that ends a text (the tokenizer's `eos_token`, in
tokenizer_config.json) and the id generation stops at (`eos_token_id`, in generation_config.json). For
BPE they are one token, <|endoftext|>. A character vocabulary has no special token (one would change the
vocabulary, so the model): its texts are lines, so the newline both starts a text (BOS) and ends one
(EOS), GPT-2's one-token convention; but generation does not stop at it, or every answer would end at
its first line, so its generation_config.json says `"eos_token_id": null`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ._checks import integer, token_ids

CHAR_VOCAB_FILE = "vocab.json"
BPE_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"  # a Hugging Face directory names its EOS token here
HF_GENERATION_CONFIG = "generation_config.json"  # ...and the id generation stops at here
# The chat template of a checkpoint that names none (the server's, and the one our tokenizers save): one line
# per message, `Role: content`, and a final `Assistant:` that the model continues.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _checked_ids(ids, vocab_size: int) -> list[int]:
    """ids as Python ints, every one in [0, vocab_size) (ValueError naming the first that is not)."""
    return token_ids("ids", [int(i) for i in ids], vocab_size, empty=True)


class CharTokenizer:
    """One id per distinct character of the training text, ids in sorted character order."""

    kind = "char"

    def __init__(self, chars: list[str]):
        if not chars:
            raise ValueError("chars is empty; a character vocabulary needs at least one character")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"chars must be single characters, got {bad[:5]!r}")
        repeated = sorted(c for c, n in Counter(chars).items() if n > 1)
        if repeated:
            raise ValueError(f"chars must be distinct, got repeats of {repeated!r}")
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        # BOS, the context before a text's first character, is the newline: text starts after one, and a
        # special token would change the vocabulary, so the model, of every character checkpoint
        self.bos_token_id = self.stoi.get("\n")
        self.eos_token = "\n" if self.bos_token_id is not None else None  # a text ends where the next starts
        self.eos_token_id = None  # generation stops at no character: a newline would cut every answer short

    def token_to_id(self, token: str) -> int | None:
        return self.stoi.get(token)

    @classmethod
    def train(cls, text: str) -> CharTokenizer:
        if not text:
            raise ValueError("text is empty; a character vocabulary needs at least one character")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.stoi})
        if unknown:
            raise ValueError(
                f"text contains characters not in the vocabulary: {unknown!r} "
                f"(the vocabulary holds the {self.vocab_size} characters of the training text)"
            )
        return [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in _checked_ids(ids, self.vocab_size))

    def save(self, path: str | Path, model_max_length: int | None = None) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / CHAR_VOCAB_FILE).write_text(json.dumps({"kind": "char", "chars": self.chars}))
        self.hf_tokenizer().save(str(Path(path) / BPE_FILE))
        _write_hf_config(Path(path), self, model_max_length)

    def hf_tokenizer(self):
        """The same vocabulary as a `tokenizers.Tokenizer`: every character (newlines too) is one piece,
        looked up in a word-level vocabulary (an unknown character is an error, as in `encode`), and
        decoding fuses the pieces with nothing between them."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel(vocab=dict(self.stoi), unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one per character
        tok.decoder = decoders.Fuse()
        return tok


class BPETokenizer:
    """Byte-level BPE (GPT-2's scheme) backed by `tokenizers.Tokenizer`: any text encodes, nothing is unknown."""

    kind = "bpe"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        ids = (tokenizer.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>"))
        self.eos_token_id = next((i for i in ids if i is not None), None)
        self.bos_token_id = self.eos_token_id  # GPT-2's way: one token ends a text and starts the next
        self.eos_token = None if self.eos_token_id is None else tokenizer.id_to_token(self.eos_token_id)

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        integer("vocab_size", vocab_size, low=257, expected="at least 257 (256 bytes + 1 special token)")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([text], trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(_checked_ids(ids, self.vocab_size), skip_special_tokens=False)

    def save(self, path: str | Path, model_max_length: int | None = None) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(Path(path) / BPE_FILE))
        _write_hf_config(Path(path), self, model_max_length)


def _write_hf_config(path: Path, tokenizer, model_max_length: int | None) -> None:
    """tokenizer_config.json for AutoTokenizer: the fast tokenizer class, no clean-up of spaces on
    decoding (it would change the text: "a ." -> "a."), the BOS and EOS tokens when there are, the chat
    template the server renders, and the model's context length when given; generation_config.json with
    the id generation stops at (null: none). Keys an existing file already has (another chat template,
    say) are kept."""
    config = _existing_config(path / HF_TOKENIZER_CONFIG)
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("clean_up_tokenization_spaces", False)
    if tokenizer.bos_token_id is not None:
        config.setdefault("bos_token", tokenizer.decode([tokenizer.bos_token_id]))
    if tokenizer.eos_token is not None:
        config.setdefault("eos_token", tokenizer.eos_token)
    config.setdefault("chat_template", CHAT_TEMPLATE)
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    (path / HF_TOKENIZER_CONFIG).write_text(json.dumps(config, ensure_ascii=False, indent=2))
    generation = _existing_config(path / HF_GENERATION_CONFIG)
    generation.setdefault("eos_token_id", tokenizer.eos_token_id)  # null: generation stops at no token
    (path / HF_GENERATION_CONFIG).write_text(json.dumps(generation, indent=2))


def _existing_config(file: Path) -> dict:
    config = _read_json(file) if file.is_file() else {}
    return config if isinstance(config, dict) else {}


def check_vocab_size(tokenizer, vocab_size: int, where) -> None:
    """A model and its tokenizer must agree on the vocabulary, or the first id past the smaller one fails
    mid-generation (or a prompt id indexes past the embedding). Checked when a checkpoint is loaded."""
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{vocab_size}; they must be equal (was the tokenizer saved with another model?)")


def load_tokenizer(path: str | Path) -> CharTokenizer | BPETokenizer:
    """Read the tokenizer saved in a checkpoint directory (ours, or a Hugging Face tokenizer.json).
    Its `eos_token` is the one tokenizer_config.json names when the directory has one, and its
    `eos_token_id`, the id generation stops at (the one place where every caller — CLI, server — learns
    it), is that token's id, unless generation_config.json says `"eos_token_id": null` (a character
    checkpoint's: no stop). An id there is not read: a Hugging Face directory's may be a list, or the id
    of a larger vocabulary than a test's. A damaged file is a ValueError naming it."""
    path = Path(path)
    tokenizer = _read_tokenizer(path)
    eos = _configured_eos_token(path)
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise ValueError(f"{path / HF_TOKENIZER_CONFIG} names eos_token={eos!r}, which the tokenizer does not know")
        tokenizer.eos_token, tokenizer.eos_token_id = eos, eos_id  # may be 0: compare with None, never truthiness
    generation = _existing_config(path / HF_GENERATION_CONFIG)
    if "eos_token_id" in generation and generation["eos_token_id"] is None:  # generation stops at no token
        tokenizer.eos_token_id = None
    return tokenizer


def _read_json(file: Path):
    """The JSON value in `file` (UTF-8); ValueError naming the file when it does not parse."""
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON ({err})") from None


def _configured_eos_token(path: Path) -> str | None:
    """tokenizer_config.json's eos_token (written as a string or as {"content": ...}), or None."""
    file = path / HF_TOKENIZER_CONFIG
    if not file.is_file():
        return None
    config = _read_json(file)
    value = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_tokenizer(path: Path) -> CharTokenizer | BPETokenizer:
    if (path / CHAR_VOCAB_FILE).is_file():
        file = path / CHAR_VOCAB_FILE
        data = _read_json(file)
        if not isinstance(data, dict) or data.get("kind") != "char" or not isinstance(data.get("chars"), list):
            raise ValueError(f"{file} is not a character vocabulary: expected {{\"kind\": \"char\", \"chars\": [...]}}")
        try:
            return CharTokenizer(data["chars"])
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from None
    if (path / BPE_FILE).is_file():
        from tokenizers import Tokenizer

        try:
            return BPETokenizer(Tokenizer.from_file(str(path / BPE_FILE)))
        except Exception as err:  # the Rust library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path / BPE_FILE} cannot be read as a tokenizer ({err})") from None
    raise ValueError(f"no tokenizer found in {str(path)!r}: expected {CHAR_VOCAB_FILE} or {BPE_FILE}")


def build_tokenizer(kind: str, text: str, vocab_size: int | None = None) -> CharTokenizer | BPETokenizer:
    if kind == "char":
        return CharTokenizer.train(text)
    if kind == "bpe":
        if vocab_size is None:
            raise ValueError("tokenizer='bpe' needs vocab_size")
        return BPETokenizer.train(text, vocab_size)
    raise ValueError(f"tokenizer={kind!r} is not known; expected 'char' or 'bpe'")


class IncrementalDecoder:
    """Token ids in, new text out, for streaming: the CLI's printed continuation and the server's pieces.

    Decoding each token alone is wrong (BPE pieces merge across tokens, one character may span several
    byte tokens) and decoding the whole output every step costs O(L) per token, O(L^2) in all. So only a
    trailing window is decoded, as vLLM does: `prefix` marks where the text of the tokens before the
    last emitted piece starts, `read` where the ids not yet turned into text start. The text of
    ids[prefix:read] is decoded beside that of ids[prefix:] so the same context shapes both (a decoder
    that drops a leading space, for one), and the difference is the new text. Text ending in an
    unfinished character (U+FFFD) waits for the next token, unless `final`.

    `tokenizer` is anything with decode(ids) -> str: a CharTokenizer, a BPETokenizer, a stand-in."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # everything handed out so far
        self.prefix = 0  # the window starts here: one emitted piece of context before `read`
        self.read = 0  # ids[:read] are in `text`

    def add(self, new_ids, final: bool = False) -> str:
        """Take the new ids; return the text they complete ('' while a character is unfinished)."""
        self.ids.extend(int(i) for i in new_ids)
        if self.read == len(self.ids):
            return ""
        known = self.tokenizer.decode(self.ids[self.prefix:self.read])
        window = self.tokenizer.decode(self.ids[self.prefix:])
        if not final and (len(window) <= len(known) or window.endswith("\ufffd")):
            return ""  # nothing new yet, or a character still missing bytes
        piece = window[len(known):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += piece
        return piece
