"""docs/worked-problems.md says what docs/worked_problems.py prints: every generated block of the page is
regenerated and compared, and a few values are checked against sums done by hand."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "worked-problems.md"
SCRIPT = ROOT / "docs" / "worked_problems.py"
BLOCK = re.compile(r"<!-- worked_problems: (\w+) -->\n(.*?)\n<!-- /worked_problems -->", re.S)


def load_script():
    spec = importlib.util.spec_from_file_location("worked_problems", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


wp = load_script()


def test_the_page_holds_every_block_the_script_prints():
    assert sorted(name for name, _ in BLOCK.findall(PAGE.read_text())) == sorted(wp.TABLES)


@pytest.mark.parametrize("name", sorted(wp.TABLES))
def test_each_block_on_the_page_is_what_the_script_prints(name):
    blocks = dict(BLOCK.findall(PAGE.read_text()))
    assert blocks[name] == wp.render(name), (
        f"docs/worked-problems.md's {name!r} block is stale: paste the output of "
        "`uv run python docs/worked_problems.py` into the page")


NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")
SUM = re.compile(r"(?:\d+(?:\.\d+)?\s*[·×+−]\s*)+\d+(?:\.\d+)?\s*=\s*\d+(?:,\d{3})*(?:\.\d+)?")
# Numbers that are not results: a paper's year, vLLM's default memory fraction, an exercise's context length.
NOT_RESULTS = {"2022", "0.90", "32768"}


def numbers(text: str) -> set[str]:
    return set(NUMBER.findall(text))


def test_every_number_in_the_prose_comes_from_the_script():
    """Outside the generated blocks, a number is a constant of the script (its source), one of its
    prose_numbers(), a worked sum (test_docs.py recomputes those), or a small count (section, GPUs)."""
    prose = BLOCK.sub("", PAGE.read_text())
    sums = SUM.findall(prose)
    allowed = (numbers("\n".join(wp.render(n) for n in wp.TABLES)) | numbers(SCRIPT.read_text())
               | set(wp.prose_numbers().values()) | numbers(" ".join(sums)) | NOT_RESULTS)
    small_count = re.compile(r"0?\d|1[0-6]")  # a section, a problem, a page (08), a GPU count
    stray = sorted({n for n in numbers(SUM.sub(" ", prose)) if n not in allowed and not small_count.fullmatch(n)})
    assert not stray, f"docs/worked-problems.md quotes numbers the script does not produce: {stray}"


def test_a_changed_constant_shows_on_the_page():
    """The comparison can fail: a page written for another HBM size no longer matches."""
    saved = wp.H100_HBM_BYTES
    try:
        wp.H100_HBM_BYTES = 94e9  # H100 NVL
        assert dict(BLOCK.findall(PAGE.read_text()))["serving"] != wp.render("serving")
    finally:
        wp.H100_HBM_BYTES = saved


def test_values_checked_by_hand():
    # KV per token: 2 (K and V) · layers · KV heads · d_head · 2 bytes
    assert wp.kv_bytes_per_token(wp.LLAMA3_8B) == 2 * 32 * 8 * 128 * 2 == 131072
    assert wp.kv_bytes_per_token(wp.LLAMA3_70B) == 2 * 80 * 8 * 128 * 2 == 327680
    assert wp.kv_bytes_per_sequence(wp.LLAMA3_8B, 8192) == 2**30  # exactly 1 GiB
    # parameter counts as published: "8B" and "70B"
    assert 8.0e9 < wp.params(wp.LLAMA3_8B) < 8.1e9
    assert 70.5e9 < wp.params(wp.LLAMA3_70B) < 70.6e9
    # 70B in bf16 (141 GB) does not fit one 80 GB H100, fits eight
    assert not wp.fits(wp.LLAMA3_70B, 1) and wp.fits(wp.LLAMA3_70B, 8)
    # one H100, 8B: (80e9 - 16.06e9) / 2**30 = 59.5 sequences of 8k
    assert wp.max_batch(wp.LLAMA3_8B, 1) == 59
    # ridge point: 989e12 / 3.35e12 = 295.2 FLOPs per byte
    assert round(wp.ridge_batch()) == 295
    # TP all-reduce: 2 per layer of a d_model bf16 vector; the ring sends 2·7/8 of it
    assert wp.tp_allreduce_bytes_per_token(wp.LLAMA3_8B) == 32 * 2 * 4096 * 2 == 524288
    assert wp.ring_send_bytes(8, 8) == 14
    # PD: 1 GiB over 400 Gb/s = 2**30 / 5e10 s
    assert wp.pd_transfer_s(wp.LLAMA3_8B) == pytest.approx(0.021474836)
    # EP: there and back, top-2, d_model 4096, bf16
    assert wp.ep_bytes_per_token_layer() == 2 * 2 * 4096 * 2 == 32768
