"""Loads the file a grader grades: exercises/<EXERCISE>.py, or the same name under $EXERCISE_DIR.

    uv run pytest exercises/test_ex01_attention.py                        # grades exercises/ex01_attention.py
    EXERCISE_DIR=my_answers uv run pytest exercises/test_ex01_attention.py  # grades my_answers/ex01_attention.py
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def load_exercise(path: Path):
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def solution(request):
    """The module under grading; each grader names its exercise in EXERCISE."""
    folder = Path(os.environ.get("EXERCISE_DIR", Path(__file__).parent))
    torch.manual_seed(0)
    return load_exercise(folder / f"{request.module.EXERCISE}.py")
