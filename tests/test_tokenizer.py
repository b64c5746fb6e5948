import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer.tokenizer import BPETokenizer, CharTokenizer, build_tokenizer, load_tokenizer

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
    with pytest.raises(ValueError, match=r"\[3\]"):
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
