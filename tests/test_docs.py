"""The docs are checked like code: every file, `file::name`, `file:line`, name cited right after a file,
`module.name`, `Class.member` and test name a page cites must exist (docs_refs.py); quoted command output
must match a fresh run; every shell command in a page's code blocks either runs (the quick ones) or at
least parses against the real argument parser;
python blocks parse; worked sums are recomputed; pages use the glossary's words (docs/README.md); every
stage page ends with its exercises and break-it experiments; the roadmap lists nothing that has landed.

Pages: README.md, docs/*.md (new pages are picked up as they land) and exercises/README.md.

What is not run, and why (each such command is still checked for what can be checked cheaply):
- `mini-transformer train | sample`, `torchrun`, `python benchmarks/...`: minutes of work or a
  trained checkpoint; their flags are parsed by the CLI's parser / looked up in the benchmark script.
- `pytest ...`: the suite itself (an exercise grader even fails on purpose until the learner solves
  it); the files it names must exist and each `-k` word must select at least one test.
- anything else (curl against a server, ...): reported as skipped with the reason.
Quick commands (`mini-transformer info | trace`) run in-process: about a second each.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from docs_refs import (
    COMMAND_START,
    FENCE,
    OUTPUT_OF,
    PAGES,
    ROOT,
    check_reference,
    defined_names,
    inline_spans,
    prose,
    references,
    rel,
    repo_files,
)

CASES = [(rel(page), kind, ref) for page in PAGES for kind, ref in dict.fromkeys(references(page))]


@pytest.mark.parametrize(("page", "kind", "ref"), CASES, ids=[f"{p}:{r}" for p, _, r in CASES])
def test_cited_code_exists(page, kind, ref):
    problem = check_reference(kind, ref)
    assert problem is None, f"{page} cites {ref!r}: {problem}"


def test_the_checker_reads_names_where_pages_put_them():
    """A page citing a made-up name in each of the forms the pages use: every one is found and reported."""
    page = ROOT / "docs" / "_made_up.md"
    page.write_text("见 `engine/scheduler.py` 的 `Scheduler.no_such_step`，`model/layers.py` 里的 `RMSNorm`、"
                    "`NoSuchNorm`，以及 `parallel.pd.no_such_function` 和 `attention/mask.py::nope`。\n")
    try:
        refs = references(page)
    finally:
        page.unlink()
    wrong = {ref for kind, ref in refs if check_reference(kind, ref)}
    assert wrong >= {"attention/mask.py::nope", "engine/scheduler.py::Scheduler.no_such_step",
                     "model/layers.py::NoSuchNorm", "parallel.pd.no_such_function"}
    assert "model/layers.py::RMSNorm" not in wrong


def test_the_checker_catches_wrong_references():
    """The checker itself: a wrong file, name, line, test, member and keyword are all reported."""
    assert check_reference("file", "DESIGN.md")
    assert check_reference("file", "src/mini_transformer/nope.py")
    assert check_reference("name", "attention/mask.py::no_such_function")
    assert check_reference("line", "attention/mask.py:100000")
    assert check_reference("test", "test_that_does_not_exist")
    assert check_reference("member", "KVCache.no_such_method")
    assert check_reference("call", "rope_tables(max_seq_len, d_head, base=10000)")
    assert check_reference("named", "inference/kv_cache.py::Cache")  # a name said to be in the wrong file
    assert check_reference("named", "server/text.py::self.no_such_attribute")
    assert check_reference("module", "parallel.pd.no_such_function")
    assert check_reference("module", "_native.no_such_function")
    assert check_reference("name", "attention/mask.py::causal_mask") is None
    assert check_reference("named", "model/cache.py::Cache") is None
    assert check_reference("module", "parallel.shard_expert_parallel") is None  # re-exported by the package
    assert check_reference("module", "model.blocks") is None  # `model` alone is a model object, not the package
    assert check_reference("module", "torch.compile") is None
    assert check_reference("member", "TransformerLM.forward") is None
    assert check_reference("call", "rope_tables(max_seq_len, d_head, theta=10000)") is None


# ------------------------------------------------------------------------------ code blocks
def shell_commands(page: Path) -> list[str]:
    """Each command line of the page's bash/sh/shell blocks, comments and continuation joined."""
    commands = []
    for lang, body in FENCE.findall(page.read_text()):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip().removeprefix("$ ")
            if line and not line.startswith("#"):
                commands.append(line)
    commands += [s for s in inline_spans(page.read_text()) if is_inline_command(s)]
    return commands


def is_inline_command(span: str) -> bool:
    """`uv run ...` or a command with flags; a bare mention (`mini-transformer sample`) or a template
    (`bench_NAME.py [args]`) is prose."""
    return span.startswith(COMMAND_START) and ("--" in span or span.startswith("uv run ")) \
        and not re.search(r"[|\[<]|\.\.\.|…", span)


def cli_argv(words: list[str]) -> list[str] | None:
    """The mini-transformer argv of a command, or None when the command is something else."""
    if words[:3] == ["uv", "run", "mini-transformer"]:
        return words[3:]
    if words[:1] == ["mini-transformer"]:
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1:][:1] == ["mini_transformer.cli"]:
        return words[words.index("-m") + 2:]
    return None


def check_flags_in_script(script: Path, args: list[str]) -> None:
    """Every --flag a doc passes to a benchmark script is one of its options: named in its source, or else
    (the flags benchmarks/_common.py adds for it) listed by its own --help."""
    source = script.read_text()
    missing = [flag for flag in (a.split("=")[0] for a in args if a.startswith("--")) if f'"{flag}"' not in source]
    if missing:
        options = set(re.findall(r"--[\w-]+", script_help(script)))
        for flag in missing:
            assert flag in options, f"{rel(script)} has no option {flag}"


@functools.cache
def script_help(script: Path) -> str:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def check_pytest_command(words: list[str]) -> None:
    args = words[words.index("pytest") + 1:]
    paths = [a.split("::")[0] for a in args if a.endswith(".py") or ".py::" in a]
    for path in paths:
        assert (ROOT / path).is_file(), f"no test file {path}"
    if "-k" in args:
        expr = args[args.index("-k") + 1]
        names = {n for p in (paths or [f for f in repo_files() if "/test_" in f and f.endswith(".py")])
                 for n in defined_names(p) if "test_" in n}
        for word in re.findall(r"\w+", expr):
            if word not in ("and", "or", "not"):
                assert any(word.lower() in n.lower() for n in names), f"-k {word!r} selects no test"


def run_cli(argv: list[str]) -> str:
    return _run_cli(tuple(argv))


@functools.cache
def _run_cli(argv: tuple[str, ...]) -> str:
    """Each quick command runs once per session (pages quote `info --preset gpt2-small` several times)."""
    from mini_transformer.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) in (0, None)
    return out.getvalue()


QUICK_SUBCOMMANDS = ("info", "trace")
COMMANDS = [(rel(page), c) for page in PAGES for c in dict.fromkeys(shell_commands(page))]


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}:{c}" for p, c in COMMANDS])
def test_shell_commands_run_or_parse(page, command):
    words = shlex.split(command)
    argv = cli_argv(words)
    if argv is not None:
        from mini_transformer.cli import build_parser

        args = build_parser().parse_args(argv)  # a wrong flag or choice exits with status 2
        if args.command in QUICK_SUBCOMMANDS:
            run_cli(argv)
    elif "pytest" in words:
        check_pytest_command(words)
    elif (words := words[2:] if words[:2] == ["uv", "run"] else words)[:1] == ["python"] and words[1:2] \
            and words[1].startswith("benchmarks/"):
        script = ROOT / words[1]
        assert script.is_file(), f"no script {words[1]}"
        check_flags_in_script(script, words[2:])
    else:
        pytest.skip(f"{page}: not a command this test knows how to check: {command}")


# ------------------------------------------------------------------------------- glossary
GLOSSARY_PAGE = ROOT / "docs" / "README.md"


def avoided_terms() -> dict[str, str]:
    """From docs/README.md's glossary table: a word never to write -> the project's word for it."""
    text = GLOSSARY_PAGE.read_text()
    section = text[text.index("## 术语表"):]
    avoided = {}
    for row in re.findall(r"^\|(.+)\|\s*$", section, re.M):
        cells = [c.strip() for c in row.split("|")]
        if len(cells) >= 3 and cells[2] and cells[2] not in ("不要写成", "---"):
            avoided.update({word.strip(): cells[0] for word in cells[2].split("、")})
    return avoided


def test_the_glossary_lists_words_to_avoid():
    assert {"补齐", "检查点", "内核", "朴素"} <= set(avoided_terms())


@pytest.mark.parametrize("page", [rel(p) for p in PAGES if p.parent.name == "docs"])
def test_pages_use_the_glossary_terms(page):
    text = re.sub(r"`[^`\n]+`", " ", (ROOT / page).read_text())  # code comments count, identifiers do not
    if page == rel(GLOSSARY_PAGE):
        text = text[:text.index("## 术语表")]
    for word, ours in avoided_terms().items():
        assert word not in text, f"{page} writes {word!r}; the glossary (docs/README.md) says {ours!r}"


# -------------------------------------------------------------------------------- exercises
STAGE_PAGES = [rel(p) for p in PAGES if re.match(r"\d\d[a-z]?-", p.name) and p.parent.name == "docs"]


@pytest.mark.parametrize("page", STAGE_PAGES)
def test_each_stage_page_ends_with_exercises_and_break_it_experiments(page):
    """The learning path (docs/README.md): every stage page ends with its exercise(s), the command that
    grades them, and two or three "break it and watch which test fails" experiments."""
    last = (ROOT / page).read_text().rsplit("\n## ", 1)[-1]
    assert last.split("\n", 1)[0].count("练习"), f"{page}: the last section must be its exercises (练习)"
    assert re.search(r"uv run pytest exercises/test_\w+\.py", last), f"{page}: no grading command"
    assert len(re.findall(r"^\d\. ", last, re.M)) >= 2, f"{page}: fewer than two break-it experiments"


# ------------------------------------------------------------------------------- arithmetic
ARITHMETIC = re.compile(r"(?<![\w.·/^])((?:\d+(?:\.\d+)?\s*[·×+−]\s*)+\d+(?:\.\d+)?)\s*=\s*"
                        r"(\d{1,3}(?:[ ,]\d{3})+|\d+(?:\.\d+)?)(?![\w.^²])")
SUMS = [(rel(page), expr, value) for page in PAGES for expr, value in ARITHMETIC.findall(page.read_text())]


def sum_is_right(expr: str, value: str) -> bool:
    got = eval(expr.replace("·", "*").replace("×", "*").replace("−", "-"), {"__builtins__": {}})
    want = float(value.replace(",", "").replace(" ", ""))
    return abs(got - want) <= 1e-9 * max(1.0, abs(want))


def test_pages_do_some_arithmetic():
    assert len(SUMS) >= 5  # the pages' worked sums are still found
    assert ARITHMETIC.findall("每层 2·12·12·64·2 = 36,864 字节") == [("2·12·12·64·2", "36,864")]
    assert not sum_is_right("2·12·12·64·4", "73 727") and sum_is_right("2·12·12·64·4", "73 728")


@pytest.mark.parametrize(("page", "expr", "value"), SUMS, ids=[f"{p}:{e}" for p, e, _ in SUMS])
def test_worked_arithmetic_is_right(page, expr, value):
    """`2·12·12·64·2 = 36,864`-style sums written in a page (· and × multiply, thousands may be grouped)."""
    assert sum_is_right(expr, value), f"{page}: {expr} is not {value}"


# -------------------------------------------------------------------------------- roadmap
NOT_BUILT_MARK = re.compile(r"^### (.+)\n<!--\s*not-built:\s*(\S+)\s*-->", re.M)
NOT_BUILT = NOT_BUILT_MARK.findall((ROOT / "docs" / "roadmap.md").read_text())


def test_the_roadmap_marks_what_is_not_built():
    """The marker still parses (the roadmap may have no unbuilt stage with a file left: pipeline
    parallelism, the last one, landed in parallel/pp.py)."""
    sample = "### 1. 某个阶段\n<!-- not-built: src/mini_transformer/x.py -->\n"
    assert NOT_BUILT_MARK.findall(sample) == [("1. 某个阶段", "src/mini_transformer/x.py")]


@pytest.mark.parametrize(("entry", "path"), NOT_BUILT, ids=[p for _, p in NOT_BUILT])
def test_the_roadmap_is_still_true(entry, path):
    """When a stage lands, its roadmap entry moves to the built table (with a link to its page)."""
    assert not (ROOT / path).exists(), (
        f"{path} exists now: move docs/roadmap.md's entry {entry!r} to the built table and link its page")


PYTHON_BLOCKS = [(rel(page), i, body) for page in PAGES
                 for i, (lang, body) in enumerate(FENCE.findall(page.read_text())) if lang == "python"]


@pytest.mark.parametrize(("page", "index", "body"), PYTHON_BLOCKS, ids=[f"{p}#{i}" for p, i, _ in PYTHON_BLOCKS])
def test_python_blocks_are_python(page, index, body):
    ast.parse(body)  # a shell line or a typo inside a python block is a SyntaxError here


OUTPUTS = [(rel(page), cmd, body) for page in PAGES for cmd, body in OUTPUT_OF.findall(page.read_text())]


@pytest.mark.parametrize(("page", "command", "quoted"), OUTPUTS, ids=[f"{p}:{c}" for p, c, _ in OUTPUTS])
def test_quoted_output_matches_a_fresh_run(page, command, quoted):
    """A block marked `<!-- output-of: mini-transformer ... -->` must appear line for line in a fresh run."""
    argv = cli_argv(shlex.split(command))
    assert argv is not None and argv[0] in QUICK_SUBCOMMANDS, f"output-of must name a quick command: {command}"
    fresh = [line.rstrip() for line in run_cli(argv).splitlines()]
    for line in (q.rstrip() for q in quoted.splitlines()):
        assert not line or line in fresh, f"{page}: {line!r} is not in the output of {command}"


# --------------------------------------------------------------------- commands run under uv run
PROJECT_COMMANDS = ("mini-transformer", "python", "torchrun", "pytest")


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}:{c}" for p, c in COMMANDS])
def test_commands_run_in_a_fresh_shell(page, command):
    """In a fresh shell the project's tools are not on PATH: a command that runs project code starts with
    `uv run` (curl, git, apt-get and the like are the reader's own tools)."""
    first = shlex.split(command)[0]
    assert first not in PROJECT_COMMANDS, f"{page}: `{command}` fails in a fresh shell; write `uv run {command}`"


# ---------------------------------------------------------------------------- one stage numbering
def stage_of(page: str) -> str:
    """docs/06-serving-engine.md -> "6"; docs/02b-modern-block.md -> "2b"."""
    return re.match(r"docs/0*(\d+[a-z]?)-", page).group(1)


STAGE_NUMBERS = {stage_of(p) for p in STAGE_PAGES}


@pytest.mark.parametrize("page", STAGE_PAGES)
def test_a_page_title_carries_its_pages_stage_number(page):
    title = (ROOT / page).read_text().split("\n", 1)[0]
    match = re.match(r"# 阶段 (\d+[a-z]?)：", title)
    assert match, f"{page}: the title must start with '# 阶段 N：', got {title!r}"
    assert match.group(1) == stage_of(page), f"{page} is stage {stage_of(page)}, its title says {match.group(1)}"


@pytest.mark.parametrize("page", [rel(p) for p in PAGES if p.parent.name == "docs"])
def test_stage_numbers_named_in_prose_exist(page):
    """'阶段 N', '第 N 阶段' and '第 N 页' name a stage page that exists (06 is stage 6, read in page order)."""
    text = re.sub(r"`[^`\n]+`", " ", prose((ROOT / page).read_text()))
    for number in re.findall(r"阶段 (\d+[a-z]?)(?![\d.])|第 (\d+) 阶段|第 (\d+) 页", text):
        n = next(x for x in number if x)
        assert n in STAGE_NUMBERS, f"{page} names stage {n}; the stages are {sorted(STAGE_NUMBERS)}"


def linked_stage_pages(text: str) -> list[str]:
    return [stage_of("docs/" + m) for m in re.findall(r"\]\((?:docs/)?(\d\d[a-z]?-[\w-]+\.md)\)", text)]


def test_docs_readme_reads_the_stages_in_page_order():
    text = GLOSSARY_PAGE.read_text()
    order = linked_stage_pages(text[text.index("## 阅读顺序"):text.index("## 名字对照表")])
    key = [(int(re.match(r"\d+", n).group()), n) for n in order]
    assert order and key == sorted(key), f"docs/README.md reads the stages in the order {order}"
    for row in re.findall(r"^\| \d+ \| \[(\d\d[a-z]?) [^\]]*\]\((\d\d[a-z]?)-", text, re.M):
        assert row[0] == row[1], f"docs/README.md: the link text {row[0]} names another page ({row[1]})"


def test_the_readme_stage_table_uses_the_page_numbers():
    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\d+)\. [^|]+\|.*\|\s*(\[.*)\|\s*$", text[text.index("## The stages"):], re.M)
    assert len(rows) >= 10, "README.md's stage table no longer parses"
    for stage, docs in rows:
        linked = linked_stage_pages(docs)
        assert any(re.match(r"\d+", n).group() == stage for n in linked), \
            f"README.md: stage {stage} links {linked}; its page must carry the same number"


def test_the_roadmap_links_name_their_pages():
    roadmap = (ROOT / "docs" / "roadmap.md").read_text()
    for text_number, target in re.findall(r"\[(\d\d[a-z]?)\]\((\d\d[a-z]?)-", roadmap):
        assert text_number == target, f"docs/roadmap.md: [{text_number}] links page {target}"


# ------------------------------------------------------------------------- spacing, serving terms
@pytest.mark.parametrize("page", [rel(p) for p in PAGES if p.parent.name == "docs"])
def test_a_space_separates_chinese_from_latin_letters(page):
    text = re.sub(r"`[^`\n]+`", " ", re.sub(r"<!--.*?-->", "", prose((ROOT / page).read_text()), flags=re.S))
    text = re.sub(r"\]\([^)]*\)", "]", text)
    glued = re.findall(r".{0,8}(?:[\u4e00-\u9fff][A-Za-z]|[A-Za-z][\u4e00-\u9fff]).{0,8}", text)
    assert not glued, f"{page}: no space between Chinese and Latin text in {glued[:5]}"


SERVING_TERMS = ("块", "块表", "槽", "前缀缓存", "连续批处理", "抢占", "分块 prefill")


def test_the_glossary_defines_the_serving_terms():
    text = GLOSSARY_PAGE.read_text()
    ours = {row.split("|")[1].strip() for row in re.findall(r"^\|.+\|\s*$", text[text.index("## 术语表"):], re.M)}
    assert set(SERVING_TERMS) <= ours, f"docs/README.md's glossary lacks {set(SERVING_TERMS) - ours}"
    assert {"block table", "KV 缓存", "核函数", "KV block"} <= set(avoided_terms())


def test_the_checks_catch_what_they_guard():
    assert stage_of("docs/02b-modern-block.md") == "2b" and stage_of("docs/10-parallelism.md") == "10"
    glued = re.compile(r"[\u4e00-\u9fff][A-Za-z]")
    assert glued.findall("融合的kernel") and not glued.findall("融合的 kernel")
    assert linked_stage_pages("[09 MoE](09-moe.md) [08](08-decode-speed.md)") == ["9", "8"]
