"""The house rules a reader relies on, checked on the source:

- no function over 60 lines in the hot-path subpackages (engine/, inference/, attention/, model/);
- comments and docstrings in src/ say why, never carry a measurement (a figure in GB/s, ms, µs, tok/s or
  an x-ratio): numbers live in docs/, which says how to reproduce them;
- no C++ inside a Python string: the kernels are .cpp/.h files under csrc/.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import mini_transformer

PACKAGE = Path(mini_transformer.__file__).parent
HOT_PATH = ("engine", "inference", "attention", "model")
MAX_FUNCTION_LINES = 60
MEASUREMENT = re.compile(r"\d(?:[\d.,]*\d)?\s*(?:GB/s|MB/s|ms\b|µs|us\b|tok/s|ns\b)|\d(?:\.\d+)?[x×](?!\w)")


def sources(under: Path = PACKAGE):
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def prose(path: Path):
    """(line number, text) of every comment and docstring line of a Python file."""
    text = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                first = node.body[0].lineno
                for i, line in enumerate(doc.splitlines()):
                    yield first + i, line


def measurements(path: Path) -> list[str]:
    return [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}" for n, line in prose(path) if MEASUREMENT.search(line)]


def test_no_long_function_on_the_hot_path():
    found = [f for sub in HOT_PATH for p in sources(PACKAGE / sub) for f in long_functions(p)]
    assert not found, "split these (a function fits a screen):\n" + "\n".join(found)


def test_no_measurement_in_comments():
    found = [m for p in sources() for m in measurements(p)]
    assert not found, "numbers belong to docs/ (a pointer is enough):\n" + "\n".join(found)


def test_cpp_lives_in_csrc():
    found = [str(p.relative_to(PACKAGE)) for p in sources() if "TORCH_LIBRARY" in p.read_text()]
    assert not found, f"C++ inside Python strings: {found}"
    assert list((PACKAGE / "csrc").glob("*.cpp")), "the kernels' sources are .cpp files under csrc/"


def test_the_checks_find_what_they_look_for(tmp_path):
    """The checkers themselves, on made-up source: each rule fires on a breach and not on its neighbour."""
    assert MEASUREMENT.search("# streams at 32 GB/s") and MEASUREMENT.search("# 1.3x faster")
    assert MEASUREMENT.search("took 4.5 ms per step") and MEASUREMENT.search("89 -> 44 µs")
    for fine in ("# (B, H, T, D)", "# x (M, K)", "# the max of x", "# 2 x 2 tiles? no: a (2, 2) tile", "# 16 rows"):
        assert not MEASUREMENT.search(fine.replace("2 x 2", "two by two")), fine
    body = "\n".join(f"    a{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src = tmp_path / "m.py"
    src.write_text(f'"""Measured: 3 ms."""\n\ndef f():\n{body}\n    return 0\n')
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        assert long_functions(src) and measurements(src)
    finally:
        PACKAGE = saved
