"""What a docs page cites, and whether it holds: files, `file::name`, `file:line`, a backticked name right
after a cited file (`engine/scheduler.py` 的 `Scheduler.schedule`), `module.name` of the project's modules
(`parallel.pd.run_disaggregated`), test names, `Class.member` of the project's classes, keyword arguments
of the project's functions, links.
Used by test_docs.py (this module holds no tests)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "exercises").glob("*.md")])
CODE_DIRS = ("src", "tests", "benchmarks", "tools", "exercises", "docs")
# Files a page names that live in other projects, and where.
FOREIGN_FILES = {
    "prepare.py": "nanoGPT's data/shakespeare_char/prepare.py",
    "model.py": "nanoGPT's model file",
    "bench.py": "nano-vllm's benchmark script",
    "convert_hf_to_gguf.py": "llama.cpp's converter (in the llama-cpp-python sdist, vendor/llama.cpp/)",
}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
OUTPUT_OF = re.compile(r"<!--\s*output-of:\s*(.+?)\s*-->\s*\n```[^\n]*\n(.*?)^```", re.S | re.M)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def repo_files() -> tuple[str, ...]:
    return tuple(rel(p) for d in CODE_DIRS for p in (ROOT / d).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts)


def resolve(path: str) -> list[str]:
    """Repository files whose path is `path` or ends with `/path`."""
    return [f for f in repo_files() if f == path or f.endswith("/" + path)]


@functools.cache
def defined_names(path: str) -> frozenset[str]:
    """Every def/class (also as Class.member), module-level assignment, import and class field in a file."""
    tree = ast.parse((ROOT / path).read_text())
    names: set[str] = set()

    def visit(body, prefix=""):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.update({node.name, prefix + node.name})
                if isinstance(node, ast.ClassDef):
                    visit(node.body, node.name + ".")
                    names.update(node.name + "." + attr for attr in self_attributes(node))
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and not prefix:
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(prefix + t.id for t in targets if isinstance(t, ast.Name))
        return names

    return frozenset(visit(tree.body))


def self_attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class's methods assign as self.<name> (instance attributes such as a module's layers)."""
    return {t.attr for node in ast.walk(cls) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


@functools.cache
def project_index() -> dict[str, frozenset[str]]:
    """file -> names, for every Python file of the project."""
    return {f: defined_names(f) for f in repo_files() if f.endswith(".py")}


def defined_anywhere(name: str, prefixes=("src/", "tests/", "benchmarks/", "tools/", "exercises/", "docs/")) -> bool:
    return any(name in names for f, names in project_index().items() if f.startswith(prefixes))


@functools.cache
def project_classes() -> frozenset[str]:
    return frozenset(n for f, names in project_index().items() if f.startswith("src/")
                     for n in names if "." not in n and n[:1].isupper())


@functools.cache
def function_params() -> dict[str, set[str] | None]:
    """Project function name -> its parameter names (None when it takes **kwargs or the name is ambiguous)."""
    params: dict[str, set[str] | None] = {}
    for f in repo_files():
        if not f.startswith("src/") or not f.endswith(".py"):
            continue
        for node in ast.walk(ast.parse((ROOT / f).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
                params[node.name] = None if (a.kwarg or node.name in params) else names
    return params


def prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def inline_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


PATH = r"((?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+\.(?:py|md|png))"
COMMAND_START = ("uv run ", "mini-transformer ", "python ", "torchrun ")


OUR_COLUMN = ("本项目", "我们", "这里", "ours")


def drop_foreign_columns(text: str) -> str:
    """In a name-map table (a header column for this project, OUR_COLUMN, beside other projects'
    columns), keep only our column: the other columns cite vLLM's or nanoGPT's names."""
    out, keep = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            keep = None
            out.append(line)
            continue
        cells = line.strip().strip("|").split("|")
        if keep is None:  # the header row
            ours = [i for i, c in enumerate(cells) if c.strip() in OUR_COLUMN]
            keep = ours[0] if ours else -1
        out.append(line if keep < 0 or keep >= len(cells) else "| " + cells[keep] + " |")
    return "\n".join(out)


# A name right after a cited file: "`engine/scheduler.py` 的 `Scheduler.schedule`", "`inference/kv_cache.py`：
# `KVCache.begin`", "`model/layers.py` 里的 `RMSNorm`、`SwiGLU`". Only these joining words: "`x.py` 用 `torch`"
# (uses) or "`x.py` 与 `y.py`" name something else.
AFTER_FILE = re.compile(r"`" + PATH + r"`\s*(?:的|里的|中的|中|里|开头的|：)\s*"
                        r"((?:`[A-Za-z_][\w.]*(?:\(\))?`(?:\s*、\s*)?)+)")
# `parallel.pd.run_disaggregated`, `mini_transformer._native.build`, `vs_llama_cpp.write_model()`
MODULE_NAME = re.compile(r"^(?:mini_transformer\.)?[a-z_]\w*(?:\.[a-z_]\w*)*\.[A-Za-z_]\w*(?:\(\))?$")
MODULE_ROOTS = ("src/mini_transformer/", "benchmarks/", "tools/")
# Module names the pages also use for an object of theirs (`model.blocks` is the model's layers,
# `tokenizer.eos_token_id` a Hugging Face tokenizer's): `model.x` alone is not read as the package `model`.
OBJECT_NAMES = ("model", "tokenizer", "config", "engine", "server")
FILE_SUFFIXES = ("py", "md", "json", "jsonl", "txt", "yaml", "pt", "bin", "safetensors", "png", "lock", "h", "cpp")


def is_file_name(name: str) -> bool:
    return "." in name and name.rsplit(".", 1)[1] in FILE_SUFFIXES


def module_file(dotted: str) -> str | None:
    """The project file a dotted module name (`parallel.pd`, `_native`, `vs_llama_cpp`) is, or None."""
    path = dotted.replace(".", "/")
    for root in MODULE_ROOTS:
        for candidate in (f"{root}{path}.py", f"{root}{path}/__init__.py"):
            if candidate in repo_files():
                return candidate
    return None


def references(page: Path) -> list[tuple[str, str]]:
    """(kind, reference) pairs cited in the page's prose (inline commands are checked as commands)."""
    text = drop_foreign_columns(re.sub(r"<!--.*?-->", "", prose(page.read_text()), flags=re.S))
    refs = [("link", f"{rel(page.parent)}/{m.group(1)}") for m in re.finditer(r"\]\(([^)#\s]+)\)", text)
            if "://" not in m.group(1)]
    text = re.sub(r"\]\([^)]*\)", "]", text)
    spans = [s for s in inline_spans(text) if not s.startswith(COMMAND_START)]
    plain = re.sub(r"`[^`\n]+`", " ", text)
    for chunk in [*spans, plain]:
        for m in re.finditer(PATH + r"(?:(::)([\w.]+(?:\s*,\s*[\w.]+)*)|:(\d+))?", chunk):
            path, sep, names, line = m.groups()
            refs.append(("file", path))
            if sep:
                refs += [("name", f"{path}::{n.strip()}") for n in names.split(",")]
            if line:
                refs.append(("line", f"{path}:{line}"))
    for m in AFTER_FILE.finditer(text):
        path, names = m.group(1), re.findall(r"`([^`]+)`", m.group(2))
        refs += [("named", f"{path}::{n.removesuffix('()')}") for n in names if not is_file_name(n)]
    for span in spans:
        if MODULE_NAME.match(span) and not is_file_name(span):
            refs.append(("module", span.removesuffix("()").removeprefix("mini_transformer.")))
        for m in re.finditer(r"(?<![\w/.:])(test_\w+)\b(?!\.py)", span):
            refs.append(("test", m.group(1)))
        for m in re.finditer(r"(?<![\w.])([A-Z]\w+)\.([A-Za-z_]\w*)", span):
            refs.append(("member", f"{m.group(1)}.{m.group(2)}"))
        for m in re.finditer(r"(?<![\w.])([a-z_]\w*)\(([^()]*)\)", span):
            refs.append(("call", f"{m.group(1)}({m.group(2)})"))
    return refs


def check_reference(kind: str, ref: str) -> str | None:
    """None when the reference holds, else what is wrong."""
    if kind == "link":
        target = ref.removeprefix("./").removeprefix("./")
        return None if (ROOT / target).exists() else f"the link target {target!r} does not exist"
    if kind == "file":
        base = ref.split("/")[-1]
        ours = "/" not in ref or ref.split("/")[0] in (*CODE_DIRS, "attention", "engine", "server", "parallel",
                                                       "mini_transformer", "img")
        if not ours or base in FOREIGN_FILES or ("/" not in ref and ref.endswith(".png")):
            return None  # another project's file, or a picture a command writes (loss.png in a run directory)
        return None if resolve(ref) else f"no file {ref!r} in the repository"
    if kind in ("name", "line"):
        path, _, rest = ref.partition("::") if kind == "name" else ref.rpartition(":")
        if check_reference("file", path) is None and not resolve(path):
            return None  # another project's file (vLLM's, nanoGPT's): not ours to check
        files = [f for f in resolve(path) if f.endswith(".py")]
        if len(files) != 1:
            return f"{path!r} matches {len(files)} files"
        if kind == "line":
            n_lines = len((ROOT / files[0]).read_text().splitlines())
            return None if 1 <= int(rest) <= n_lines else f"{files[0]} has {n_lines} lines, not {rest}"
        return None if rest in defined_names(files[0]) else f"{files[0]} defines no {rest!r}"
    if kind == "named":  # a name right after a file: defined in it (any file the path matches)
        path, _, name = ref.partition("::")
        files = [f for f in resolve(path) if f.endswith(".py")]
        if not files:
            return None  # another project's file, or one check "file" reports
        if name.startswith("self."):
            name = name.removeprefix("self.")
            found = any(n.endswith("." + name) for f in files for n in defined_names(f))
        else:
            found = any(name in defined_names(f) for f in files)
        return None if found else f"{' / '.join(files)} defines no {name!r}"
    if kind == "module":
        parts = ref.split(".")
        for k in range(len(parts) - 1, 0, -1):
            if k == 1 and parts[0] in OBJECT_NAMES:
                return None
            if (module := module_file(".".join(parts[:k]))) is not None:
                name = parts[k] if not parts[k][:1].isupper() or len(parts) == k + 1 else ".".join(parts[k:k + 2])
                return None if name in defined_names(module) else f"{module} defines no {name!r}"
        return None  # torch.compile, json.loads, ...: not ours
    if kind == "test":
        return None if defined_anywhere(ref, ("tests/", "exercises/")) else f"no test named {ref!r}"
    if kind == "member":
        cls, member = ref.split(".")
        if cls not in project_classes():
            return None  # torch.Tensor, HF classes, ...: not ours
        return None if defined_anywhere(ref, ("src/",)) else f"class {cls} has no member {member!r}"
    if kind == "call":
        name, args = ref[:-1].split("(", 1)
        params = function_params().get(name)
        if not params:
            return None
        words = {w for w in re.findall(r"(\w+)\s*=(?!=)", args)}
        missing = sorted(words - params)
        return f"{name}() takes no argument named {missing}" if missing else None
    raise AssertionError(kind)
