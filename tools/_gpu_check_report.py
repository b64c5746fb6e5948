"""Reading the stages' outputs and assembling benchmarks/results/gpu-<date>.md for gpu_check.py.

Plain functions on text and dicts (no torch, no GPU), so that tests can feed them made-up outputs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

TRITON_TARGET = 0.8  # Triton forward >= 0.8x SDPA-flash TFLOP/s at bf16, D=64, T=4096 (docs/04)
ENV_ROWS = (("device", "device"), ("driver", "driver"), ("CUDA (torch's build)", "cuda_version"),
            ("torch", "torch"), ("triton", "triton"), ("python", "python"), ("run with", "how"),
            ("load (uptime)", "load"), ("commit", "commit"), ("nvidia-smi", "smi"))


@dataclass
class Stage:
    name: str
    status: str  # PASS | FAIL | TIMEOUT | SKIP
    seconds: float = 0.0
    summary: str = ""  # one line: the figure, or why
    output: str = ""  # everything the command printed
    report: str = ""  # markdown for the results file ("" = the end of the output)
    rc: int | None = None  # the command's exit status (None: it ran out of time, or no command ran)


def status_of(rc: int | None, ok: bool) -> str:
    return "TIMEOUT" if rc is None else "PASS" if ok else "FAIL"


def summary_line(stage: Stage) -> str:
    return f"{stage.status:<7} {stage.name:<22} {stage.seconds:6.0f} s  {stage.summary}"


# ------------------------------------------------------------------------------------- outputs
def last_json(output: str) -> dict | list | None:
    """The last line of an output that is a JSON object (the workers end with one)."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _screen_lines(output: str) -> list[str]:
    """Lines as a terminal would show them: a progress bar's \\r redraws keep only their last state."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in output.splitlines()]


def tail(output: str, lines: int = 30) -> str:
    """The end of an output as the screen would show it (a progress bar in its last state)."""
    kept = [line for line in _screen_lines(output) if line.strip()]
    return "\n".join(kept[-lines:])


def section_from(output: str, prefix: str, fallback_lines: int = 30) -> str:
    """The output from the last line that starts with `prefix` on (a script's final table)."""
    lines = _screen_lines(output)
    starts = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    return "\n".join(lines[starts[-1]:]).strip() if starts else tail(output, fallback_lines)


def last_table_row(output: str) -> str:
    """The last line that looks like a row of a benchmark's text table ('  256 |  281.1 | ...'), squeezed."""
    rows = [line for line in _screen_lines(output) if re.match(r"\s*\d+\s*\|", line)]
    return " ".join((rows[-1] if rows else tail(output, 1)).split())


def markdown_lines(output: str) -> str:
    """The markdown table rows a worker printed."""
    return "\n".join(line for line in _screen_lines(output) if line.startswith("|"))


def pytest_counts(output: str) -> dict[str, int]:
    """{'passed': 3, 'skipped': 1, ...} from pytest's last summary line."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    return {word: int(n) for n, word in re.findall(r"(\d+) ([a-z]+)", lines[-1])} if lines else {}


# ------------------------------------------------------------------------------ bench_attention
def attention_summary(rows: list[dict], T: int = 4096) -> tuple[bool, str]:
    """(every case ran or was skipped for memory, 'triton fwd T=4096: ... x sdpa-flash; ...')."""
    errors = [f"{r['backend']} {r['mode']} T={r['T']}" for r in rows if "error" in r]
    tflops = {(r["backend"], r["mode"], r["T"]): r["tflops"] for r in rows if "tflops" in r}
    parts = []
    for mode in ("fwd", "fwd+bwd"):
        triton, sdpa = tflops.get(("triton", mode, T)), tflops.get(("sdpa", mode, T))
        if triton is not None and sdpa is not None:
            parts.append(f"triton {mode} T={T}: {triton:.0f} TFLOP/s = {triton / sdpa:.2f}x sdpa-flash")
            if mode == "fwd":
                met = triton / sdpa >= TRITON_TARGET
                parts.append(f"target >= {TRITON_TARGET}x {'met' if met else 'NOT met'}")
    if errors:
        parts.insert(0, "errors: " + ", ".join(errors))
    return not errors and bool(rows), "; ".join(parts) or f"no triton and sdpa timings at T={T}"


def _attention_cell(row: dict) -> str:
    if "ms" in row:
        return f"{row['ms']:.3g} ({row['tflops']:.1f})" if "tflops" in row else f"{row['ms']:.3g}"
    return "skipped" if "skipped" in row else "error" if "error" in row else "-"


def attention_markdown(rows: list[dict]) -> str:
    """One line per (mode, T): each backend's ms (TFLOP/s), and triton / sdpa in TFLOP/s."""
    backends = [b for b in ("naive", "sdpa", "tiled", "triton") if any(r["backend"] == b for r in rows)]
    by_key = {(r["mode"], r["T"], r["backend"]): r for r in rows}
    if not rows:
        return ""
    lines = ["| mode | T | " + " | ".join(f"{b} ms (TFLOP/s)" for b in backends) + " | triton / sdpa |",
             "|---|---:|" + "---:|" * (len(backends) + 1)]
    for mode, T in dict.fromkeys((r["mode"], r["T"]) for r in rows):
        cells = [_attention_cell(by_key.get((mode, T, b), {})) for b in backends]
        triton, sdpa = by_key.get((mode, T, "triton"), {}), by_key.get((mode, T, "sdpa"), {})
        ratio = f"{triton['tflops'] / sdpa['tflops']:.2f}" if "tflops" in triton and "tflops" in sdpa else "-"
        lines.append(f"| {mode} | {T} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the report
def assemble_report(info: dict, stages: list[Stage], seconds: float, budget: float) -> str:
    """The results file: environment, one summary line per stage, then each stage's table or output."""
    lines = [f"# GPU check, {info.get('date', '?')}", "",
             f"`tools/gpu_check.py` ran {len(stages)} stages in {seconds:.0f} s (budget {budget:.0f} s). "
             "Exit codes, limits and how to rerun: the script's docstring and docs/04.", "",
             "| | |", "|---|---|"]
    lines += [f"| {label} | {info[key]} |" for label, key in ENV_ROWS if info.get(key)]
    lines += ["", "## Summary", "", "| stage | result | seconds | figure |", "|---|---|---:|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.summary.replace('|', '/')} |" for s in stages]
    for s in stages:
        lines += ["", f"## {s.name}: {s.status}", ""]
        body = s.report or code_block(tail(s.output)) or s.summary
        lines.append(body)
    return "\n".join(lines) + "\n"


def code_block(text: str) -> str:
    return f"```\n{text}\n```" if text.strip() else ""
