"""The exercise graders are honest: each passes on the project's own implementation, fails on the blank
the learner starts from, and rejects the wrong answers of the docs' "break it" experiments."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
from exercise_solutions.broken import BROKEN
from exercise_solutions.broken_cluster import BROKEN_CLUSTER
from exercise_solutions.broken_engine import BROKEN_ENGINE
from exercise_solutions.broken_kv_store import BROKEN_KV_STORE
from exercise_solutions.broken_stages import BROKEN_STAGES
from exercise_solutions.broken_structured import BROKEN_STRUCTURED

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = ROOT / "exercises"
NAMES = sorted(p.stem for p in EXERCISES.glob("ex*_*.py"))


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grader_checks(name: str):
    grader = load(EXERCISES / f"test_{name}.py", f"grader_{name}")
    assert grader.EXERCISE == name
    return {n: f for n, f in vars(grader).items() if n.startswith("test_") and callable(f)}


def blank_source(name: str) -> str:
    """The blank as committed: a learner who solved the file in place still has the blank in git."""
    path = EXERCISES / f"{name}.py"
    text = path.read_text()
    if 'raise NotImplementedError("TODO' in text:
        return text
    done = subprocess.run(["git", "show", f"HEAD:exercises/{name}.py"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{path} is solved in place and git has no blank to compare with"
    return done.stdout


def test_every_exercise_has_a_grader_and_a_reference_answer():
    assert len(NAMES) >= 3
    for name in NAMES:
        assert (EXERCISES / f"test_{name}.py").is_file(), f"exercise {name} has no grader"
        assert (Path(__file__).parent / "exercise_solutions" / f"{name}.py").is_file(), f"{name}: no reference answer"


@pytest.mark.parametrize("name", NAMES)
def test_grader_passes_on_the_project_implementation(name):
    answer = load(Path(__file__).parent / "exercise_solutions" / f"{name}.py", f"answer_{name}")
    for check in grader_checks(name).values():
        check(answer)


@pytest.mark.parametrize("name", NAMES)
def test_grader_fails_on_the_blank(name, tmp_path):
    (tmp_path / f"{name}.py").write_text(blank_source(name))
    blank = load(tmp_path / f"{name}.py", f"blank_{name}")
    for check in grader_checks(name).values():  # every single check fails on the blank
        with pytest.raises((NotImplementedError, AssertionError)):
            check(blank)


# apart: docs/07, 08, 10 (stages), docs/06 (engine), docs/11 (kv store), docs/12 (structured), docs/13 (cluster)
BROKEN = {**BROKEN, **BROKEN_STAGES, **BROKEN_ENGINE, **BROKEN_KV_STORE, **BROKEN_STRUCTURED, **BROKEN_CLUSTER}
CASES = [(name, label) for name, variants in BROKEN.items() for label in variants]


@pytest.mark.parametrize(("name", "label"), CASES)
def test_grader_rejects_the_break_it_answers(name, label):
    wrong = BROKEN[name][label]
    failed = []
    for check_name, check in grader_checks(name).items():
        try:
            check(wrong)
        except AssertionError:
            failed.append(check_name)
    assert failed, f"{name}: no check of the grader notices '{label}'"
