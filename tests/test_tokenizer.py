import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    IncrementalDecoder,
    build_tokenizer,
    load_tokenizer,
)

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20


def test_char_vocab_is_the_sorted_characters_of_the_text():
    tok = CharTokenizer.train("hello world")
    assert tok.chars == sorted(set("hello world"))
    assert tok.vocab_size == 8
    assert tok.encode("hello") == [tok.chars.index(c) for c in "hello"]


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet="abcdefg \n:!é—", min_size=1, max_size=60))
def test_char_round_trip(text):
    tok = CharTokenizer.train(text)
    assert tok.decode(tok.encode(text)) == text


def test_char_unknown_characters_are_named():
    tok = CharTokenizer.train("abc")
    with pytest.raises(ValueError, match=r"\['x', 'é'\]"):
        tok.encode("abxéx")


def test_char_decode_rejects_out_of_range_ids():
    tok = CharTokenizer.train("abc")
    with pytest.raises(ValueError, match=r"ids contains 3, expected token ids in \[0, vocab_size=3\)"):
        tok.decode([0, 3])


@pytest.mark.parametrize("chars", [[], ["a", "a"], ["ab"]])
def test_char_rejects_bad_vocabularies(chars):
    with pytest.raises(ValueError, match="chars"):
        CharTokenizer(chars)


def test_char_save_load(tmp_path):
    tok = CharTokenizer.train(TEXT)
    tok.save(tmp_path)
    assert json.loads((tmp_path / "vocab.json").read_text())["kind"] == "char"
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, CharTokenizer) and loaded.chars == tok.chars
    with pytest.raises(ValueError, match="'Z'"):
        loaded.encode("Zebra")  # unknown at sampling time: named in the error


def test_bpe_trains_saves_and_round_trips(tmp_path):
    tok = build_tokenizer("bpe", TEXT, vocab_size=300)
    assert tok.vocab_size <= 300
    ids = tok.encode(TEXT[:80])
    assert len(ids) < 80  # merges make tokens longer than one byte
    assert tok.decode(ids) == TEXT[:80]
    assert tok.decode(tok.encode("naïve ünïcode ✓")) == "naïve ünïcode ✓"  # byte level: nothing is unknown
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, BPETokenizer)
    assert loaded.encode(TEXT[:80]) == ids and loaded.eos_token_id == tok.eos_token_id is not None


def test_bpe_and_build_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100"):
        BPETokenizer.train(TEXT, 100)
    with pytest.raises(TypeError, match="vocab_size"):
        BPETokenizer.train(TEXT, 300.0)
    with pytest.raises(ValueError, match="needs vocab_size"):
        build_tokenizer("bpe", TEXT)
    with pytest.raises(ValueError, match="'words'"):
        build_tokenizer("words", TEXT)
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"kind": "char", "chars": ["a", "a"]}'])
def test_a_damaged_vocab_json_is_named(tmp_path, content):
    (tmp_path / "vocab.json").write_bytes(content)
    with pytest.raises(ValueError, match="vocab.json"):
        load_tokenizer(tmp_path)


def test_a_damaged_tokenizer_json_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match="tokenizer.json cannot be read"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("eos", ["\n", {"content": "\n"}])
def test_load_tokenizer_takes_the_eos_of_tokenizer_config_even_when_its_id_is_0(tmp_path, eos):
    CharTokenizer.train(TEXT).save(tmp_path)
    assert load_tokenizer(tmp_path).eos_token_id is None
    (tmp_path / "generation_config.json").unlink()  # a directory that does not say where generation stops
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    assert load_tokenizer(tmp_path).eos_token_id == 0  # "\n" sorts first


def test_generation_config_null_says_generation_stops_at_no_token(tmp_path):
    CharTokenizer.train(TEXT).save(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": None}
    assert load_tokenizer(tmp_path).eos_token_id is None  # though tokenizer_config.json names "\n" as EOS
    # an id (or a list) there is not read: tokenizer_config.json's EOS is the stop, the newline, id 0
    for stop in (3, [1, 2]):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
        assert load_tokenizer(tmp_path).eos_token_id == 0


def test_a_character_checkpoint_saved_without_bos_and_eos_still_loads_and_has_them(tmp_path):
    """Files written before tokenizer_config.json named BOS/EOS: the vocabulary alone gives them."""
    tokenizer = CharTokenizer.train(TEXT)
    tokenizer.save(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode(TEXT) == tokenizer.encode(TEXT)
    assert loaded.decode([loaded.bos_token_id]) == loaded.eos_token == "\n" and loaded.eos_token_id is None
    assert CharTokenizer.train("abc").eos_token is None  # no newline in the text: no BOS, no EOS


def test_load_tokenizer_eos_from_config_for_bpe_and_unknown_names(tmp_path):
    from tokenizers import Tokenizer, models

    # a word-level vocabulary whose EOS sits at id 0, as in many Hugging Face directories
    vocab = {"</s>": 0, "a": 1, "[UNK]": 2}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_tokenizer(tmp_path).eos_token_id == 0
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token='<nope>'"):
        load_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def bpe_multibyte():
    """A byte-level BPE that has seen little non-ASCII text, so é, 雪 and 🙂 split into several byte tokens."""
    return BPETokenizer.train(TEXT, vocab_size=300)


class WindowSpy:
    """Decodes with `tokenizer` and remembers how many ids each call was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids)


@settings(max_examples=20, deadline=None)
@given(st.text(alphabet="ab :\né雪🙂", min_size=1, max_size=40))
def test_incremental_decoder_pieces_join_to_the_whole_decode(bpe_multibyte, text):
    """Reference: decoding all ids at once. Each step's text so far is a prefix of that, and never ends
    in a character still missing bytes."""
    ids = bpe_multibyte.encode(text)
    decoder = IncrementalDecoder(bpe_multibyte)
    pieces = []
    for n, token in enumerate(ids, 1):
        pieces.append(decoder.add([token]))
        assert "".join(pieces) == decoder.text and bpe_multibyte.decode(ids[:n]).startswith(decoder.text)
        assert not decoder.text.endswith("\ufffd")
    pieces.append(decoder.add([], final=True))
    assert "".join(pieces) == bpe_multibyte.decode(ids) == text


def test_incremental_decoder_decodes_a_short_window_not_the_whole_output(bpe_multibyte):
    spy = WindowSpy(bpe_multibyte)
    ids = bpe_multibyte.encode(TEXT[:400] + "é雪🙂" * 5)
    decoder = IncrementalDecoder(spy)
    for token in ids:
        decoder.add([token])
    decoder.add([], final=True)
    assert decoder.text == bpe_multibyte.decode(ids) and len(ids) > 100
    assert max(spy.sizes) <= 8  # a 4-byte character's tokens plus one piece of context, not O(L)


def test_incremental_decoder_flushes_an_unfinished_character_only_at_the_end():
    class Bytes:
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    decoder = IncrementalDecoder(Bytes())
    snowman = list("☃".encode())
    assert decoder.add(snowman[:2]) == "" and decoder.add([], final=True) == "\ufffd"


# ------------------------------------------------------------------------ the Hugging Face files
# every character class a char vocabulary meets: spaces of several kinds, newlines, CR, tab, punctuation
# that HF's decode clean-up would touch (" ."), accents, CJK, an astral emoji
HF_ALPHABET = "ab \n\r\t.,'!?éÉ你好😀"


@pytest.fixture(scope="module")
def auto_char(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("char")
    ours = CharTokenizer.train(HF_ALPHABET)
    ours.save(path)
    return ours, AutoTokenizer.from_pretrained(str(path))


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=HF_ALPHABET, min_size=0, max_size=40))
def test_autotokenizer_loads_a_char_checkpoint_with_the_same_ids(auto_char, text):
    """Reference: our CharTokenizer. AutoTokenizer.from_pretrained(dir) encodes to the same ids, adds no
    special token, and decodes them back to the same text."""
    ours, theirs = auto_char
    ids = theirs(text)["input_ids"]
    assert ids == ours.encode(text)
    assert theirs.decode(ids) == text
    assert len(theirs) == ours.vocab_size


def test_autotokenizer_loads_a_bpe_checkpoint_with_the_same_ids_and_eos(tmp_path):
    from transformers import AutoTokenizer

    ours = BPETokenizer.train(TEXT, vocab_size=300)
    ours.save(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("Speak, speak.", "First Citizen:\n All: x", "héllo"):
        assert theirs(text)["input_ids"] == ours.encode(text)
        assert theirs.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ours.eos_token_id
    assert load_tokenizer(tmp_path).eos_token_id == ours.eos_token_id


def test_saving_keeps_an_existing_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}", "eos_token": "a"}))
    CharTokenizer.train("abc").save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == "{{ x }}" and config["eos_token"] == "a"
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_autotokenizer_knows_bos_eos_the_chat_template_and_the_context(tmp_path):
    """What lm-eval and apply_chat_template read: a BOS (the newline of a character vocabulary, GPT-2's
    <|endoftext|> for BPE, both inside the model's vocabulary), model_max_length, and the chat template the
    server renders, giving the same text as the server's TextCodec."""
    from transformers import AutoTokenizer

    from mini_transformer.server.text import TextCodec

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    char, bpe = CharTokenizer.train(TEXT + "SytemBbfUsHhAn"), BPETokenizer.train(TEXT, vocab_size=300)
    for name, ours in (("char", char), ("bpe", bpe)):
        path = tmp_path / name
        ours.save(path, model_max_length=64)
        theirs = AutoTokenizer.from_pretrained(str(path))
        assert theirs.bos_token_id is not None and theirs.bos_token_id == ours.bos_token_id < ours.vocab_size
        assert theirs.model_max_length == 64 and len(theirs) == ours.vocab_size
        rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == TextCodec(path).render_chat(messages) == "System: Be brief.\nUser: Hi there\nAssistant:"
        assert theirs(rendered)["input_ids"] == ours.encode(rendered)  # no BOS added on encoding
    # a character vocabulary: the newline starts a text and ends one, in the files as in ours...
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "char"))
    assert theirs.bos_token == theirs.eos_token == "\n" == char.decode([char.bos_token_id]) == char.eos_token
    assert theirs.eos_token_id == theirs.bos_token_id == char.bos_token_id
    # ...but generation stops at no character (generation_config.json says so, as transformers reads it)
    assert char.eos_token_id is None and load_tokenizer(tmp_path / "char").eos_token_id is None
    assert json.loads((tmp_path / "char" / "generation_config.json").read_text()) == {"eos_token_id": None}
    assert bpe.bos_token_id == bpe.eos_token_id == bpe.token_to_id("<|endoftext|>")
    assert load_tokenizer(tmp_path / "bpe").eos_token_id == bpe.eos_token_id
    assert bpe.eos_token == AutoTokenizer.from_pretrained(str(tmp_path / "bpe")).eos_token == "<|endoftext|>"
