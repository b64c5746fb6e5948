"""Text in and out of the server: the chat template rendered as `transformers` renders it, and the
streaming detokenizer's stop strings (pieces joined == the whole text cut at the first stop string)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer.server.protocol import ErrorResponse
from mini_transformer.server.text import IncrementalText, TextCodec
from mini_transformer.tokenizer import BPETokenizer, CharTokenizer

CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hello there!"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And again?"}]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-tok")
    BPETokenizer.train("you are brief. hello there! hi. and again? " * 20, vocab_size=300).save(path)
    eos = {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "normalized": False,
           "rstrip": False, "single_word": False, "special": True}  # the dict form transformers writes
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
              "bos_token": "<|endoftext|>", "eos_token": eos}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(hf_tokenizer_dir, add_generation_prompt):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(str(hf_tokenizer_dir))
    expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    codec = TextCodec(hf_tokenizer_dir)
    assert codec.render_chat(MESSAGES, add_generation_prompt) == expected
    assert codec.eos_token_id == reference.eos_token_id


def test_template_errors_are_400(hf_tokenizer_dir):
    with pytest.raises(ErrorResponse) as err:
        TextCodec(hf_tokenizer_dir).render_chat([{"role": "tool", "content": "x"}])
    assert err.value.status == 400 and "no tools here" in err.value.message


def test_plain_template_without_a_chat_template(tmp_path):
    CharTokenizer.train("abc").save(tmp_path)
    codec = TextCodec(tmp_path)
    rendered = codec.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert rendered == "System: S\nUser: U\nAssistant:"


def test_a_character_checkpoint_without_bos_and_eos_in_its_files_still_gives_them(tmp_path):
    CharTokenizer.train("ab\nc").save(tmp_path)
    (tmp_path / "generation_config.json").unlink()  # as saved before the files named BOS and EOS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    codec = TextCodec(tmp_path)
    assert codec.bos_token == codec.eos_token == "\n" and codec.eos_token_id is None


class CharCodec:
    """decode = the characters themselves (one id per character)."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="abc", min_size=1, max_size=30),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
       cuts=st.lists(st.integers(1, 4), min_size=1, max_size=30),
       include_stop=st.booleans(), min_tokens=st.integers(0, 6))
def test_stream_pieces_join_to_the_text_cut_at_the_first_completed_stop(text, stops, cuts, include_stop, min_tokens):
    """Reference (one character per token): generation stops after the first token, at or past the
    min_tokens-th, whose text ends a stop string; the text is cut before it (after it: include_stop)."""
    ids = [ord(c) for c in text]
    expected, hits = text, []
    for end in range(max(1, min_tokens), len(text) + 1):
        hits = sorted((end - len(s), end) for s in stops if text[:end].endswith(s))
        if hits:
            expected = text[:hits[0][1] if include_stop else hits[0][0]]
            break
    stream = IncrementalText(CharCodec(), stops, include_stop, min_tokens)
    pieces, start = [], 0
    for n in cuts * len(ids):  # feed the ids in chunks of the drawn sizes
        if start >= len(ids) or stream.stopped:
            break
        chunk = ids[start:start + n]
        start += n
        pieces.append(stream.add(chunk, final=start >= len(ids)))
    assert "".join(pieces) == expected == stream.out
    assert stream.stopped == bool(hits)
    assert stream.tokens_used == (hits[0][1] if hits else len(ids))  # the ids after the stop are not in it


def test_an_unfinished_character_waits_for_its_next_byte():
    class Bytes:
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    stream = IncrementalText(Bytes(), [])
    snowman = list("☃".encode())  # three bytes
    assert stream.add(snowman[:1], final=False) == ""
    assert stream.add(snowman[1:2], final=False) == ""
    assert stream.add(snowman[2:], final=False) == "☃"
