"""`mini-transformer sample`: our char checkpoint and a Hugging Face GPT-2 directory with tokenizer.json."""

import io
import json
import re

import pytest
import torch
from support import TEXT, save_char_checkpoint

from mini_transformer import generate
from mini_transformer.cli import _TextStream, main
from mini_transformer.inference.generate import generate_long
from mini_transformer.tokenizer import BPETokenizer


@pytest.fixture(scope="module")
def char_checkpoint(tmp_path_factory):
    return save_char_checkpoint(tmp_path_factory.mktemp("char"), max_seq_len=48)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("hf-gpt2")
    tokenizer = BPETokenizer.train(TEXT * 4, vocab_size=300)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                     bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=0.3)
    hf = GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(path)
    tokenizer.save(path)  # tokenizer.json next to the HF weights
    return path, hf, tokenizer


def test_greedy_sample_prints_prompt_and_generate_output(char_checkpoint, capsys):
    path, model, tokenizer = char_checkpoint
    prompt = "the fox"
    code = main(["sample", "--checkpoint", str(path), "--prompt", prompt, "--max-new-tokens", "20",
                 "--temperature", "0"])
    assert code == 0
    ids = generate(model, torch.tensor([tokenizer.encode(prompt)]), 20)
    assert capsys.readouterr().out == prompt + tokenizer.decode(ids[0]) + "\n"


def test_no_cache_prints_the_same_text(char_checkpoint, capsys):
    path = str(char_checkpoint[0])
    args = ["sample", "--checkpoint", path, "--prompt", "box", "--max-new-tokens", "15", "--top-k", "5",
            "--top-p", "0.9", "--min-p", "0.05", "--seed", "3"]
    assert main(args) == 0
    cached = capsys.readouterr().out
    assert main([*args, "--no-cache"]) == 0
    assert capsys.readouterr().out == cached
    assert main([*args[:-1], "4"]) == 0  # another seed, another text
    assert capsys.readouterr().out != cached


def test_default_length_is_200_tokens_past_the_context(char_checkpoint, capsys):
    path = str(char_checkpoint[0])
    assert main(["sample", "--checkpoint", path, "--prompt", "dog", "--temperature", "0"]) == 0
    assert len(capsys.readouterr().out) == len("dog") + 200 + 1  # prompt, 200 new characters, newline


def test_hugging_face_directory_with_tokenizer_json(hf_checkpoint, capsys):
    path, hf, tokenizer = hf_checkpoint
    prompt = "the lazy dog"
    assert main(["sample", "--checkpoint", str(path), "--prompt", prompt, "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    idx = torch.tensor([tokenizer.encode(prompt)])
    expected = hf.generate(idx, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.eos_token_id)
    assert capsys.readouterr().out == prompt + tokenizer.decode(expected[0, idx.shape[1]:].tolist()) + "\n"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-new-tokens", "0"], "max_new_tokens=0"),
        (["--temperature", "-1"], "temperature=-1.0"),
        (["--top-p", "0"], "top_p=0.0"),
    ],
)
def test_bad_arguments_print_an_error_and_no_text(char_checkpoint, capsys, extra, message):
    assert main(["sample", "--checkpoint", str(char_checkpoint[0]), "--prompt", "fox", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_unknown_characters_and_missing_tokenizer(char_checkpoint, tmp_path, capsys):
    assert main(["sample", "--checkpoint", str(char_checkpoint[0]), "--prompt", "Ω"]) == 2
    assert "not in the vocabulary" in capsys.readouterr().err
    char_checkpoint[1].save_pretrained(tmp_path)  # weights without a tokenizer file
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "fox"]) == 2
    assert "no tokenizer found" in capsys.readouterr().err


def test_text_stream_waits_for_a_whole_character():
    class Bytes:  # decodes ids as UTF-8 bytes, like a byte-level BPE does
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    out = io.StringIO()
    stream = _TextStream(Bytes(), out, "> ")
    writes = []
    for byte in "aé".encode():
        stream(torch.tensor([byte]))
        writes.append(out.getvalue())
    stream.flush()
    assert writes == ["> a", "> a", "> aé"]  # the first byte of é alone prints nothing


def test_sampling_past_the_context_slides_the_window(char_checkpoint, capsys):
    path, model, tokenizer = char_checkpoint
    assert model.config.max_seq_len == 48
    assert main(["sample", "--checkpoint", str(path), "--prompt", "fox", "--max-new-tokens", "100",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert len(out) == len("fox") + 100 + 1
    expected = generate_long(model, torch.tensor([tokenizer.encode("fox")]), 100)
    assert out == "fox" + tokenizer.decode(expected[0].tolist()) + "\n"


def constrained_reference(checkpoint, prompt: str, structured, max_tokens: int) -> str:
    """The engine given the same tokenizer, greedy: the text the CLI must print after the prompt."""
    from mini_transformer import SamplingParams, TransformerLM
    from mini_transformer.engine import LLMEngine

    path, _, tokenizer = checkpoint
    engine = LLMEngine(TransformerLM.from_pretrained(path), eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer)
    [ids] = engine.generate([tokenizer.encode(prompt)], SamplingParams(max_tokens=max_tokens, structured=structured),
                            use_tqdm=False)
    return tokenizer.decode(ids[:-1] if ids[-1] == tokenizer.eos_token_id else ids)


@pytest.mark.parametrize("option, structured, check", [
    (["--choice", "yes,no,maybe"], dict(choice=("yes", "no", "maybe")), lambda text: text in ("yes", "no", "maybe")),
    (["--regex", r"[a-c]{2,4}-\d{2}"], dict(regex=r"[a-c]{2,4}-\d{2}"),
     lambda text: re.fullmatch(r"[a-c]{2,4}-\d{2}", text) is not None),
    (["--json-schema", "SCHEMA"], dict(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                    "required": ["ok"]}),
     lambda text: isinstance(json.loads(text)["ok"], bool)),
])
def test_structured_output_options(hf_checkpoint, tmp_path, capsys, option, structured, check):
    from mini_transformer.inference.structured import StructuredOutput

    if option[1] == "SCHEMA":
        (tmp_path / "schema.json").write_text(json.dumps(structured["json_schema"]))
        option = [option[0], str(tmp_path / "schema.json")]
    prompt = "the fox"
    code = main(["sample", "--checkpoint", str(hf_checkpoint[0]), "--prompt", prompt, "--max-new-tokens", "40",
                 "--temperature", "0", *option])
    assert code == 0
    text = constrained_reference(hf_checkpoint, prompt, StructuredOutput(**structured), 40)
    assert capsys.readouterr().out == prompt + text + "\n\n"
    assert check(text)


@pytest.mark.parametrize("extra, message", [
    (["--regex", "(ab"], "regex"),
    (["--choice", "a,,b"], "choice"),
    (["--json-schema", "/no/such/file.json"], "--json-schema"),
    (["--choice", "a,b", "--prompt-lookup"], "speculative decoding is refused"),
])
def test_structured_output_options_refused(hf_checkpoint, capsys, extra, message):
    assert main(["sample", "--checkpoint", str(hf_checkpoint[0]), "--prompt", "fox", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err
