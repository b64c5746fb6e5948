"""tools/gpu_check.py on a machine without a GPU: it stops at once and says so; its stage runner
stops what runs too long; its results file is checked here on made-up stage outputs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))  # the script imports its sibling _gpu_check_report
    import gpu_check

    return gpu_check


def test_without_cuda_it_exits_at_once_with_a_skip_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run its stages")
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable)  # never `uv sync` from a test
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(TOOLS / "gpu_check.py"), "--out", str(tmp_path / "out"),
                           "--results-dir", str(tmp_path / "results")],
                          capture_output=True, text=True, timeout=120, env=env)
    seconds = time.monotonic() - start
    assert done.returncode == 77, done.stdout + done.stderr  # 77: skipped, nothing was checked
    assert done.stdout.startswith("SKIP gpu_check:") and "no CUDA device" in done.stdout
    # the promise is "within seconds" (no sync, no stage); 30 s leaves room for a busy 2-core machine
    assert seconds < 30, f"took {seconds:.0f} s"
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended; only its exit status waits to be collected


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_stage_past_its_limit_is_stopped_with_what_it_started(gpu_check):
    starts_a_sleeper = ("import subprocess, sys, time; "
                        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                        "print(p.pid, flush=True); time.sleep(120)")
    rc, output, seconds = gpu_check.run_command([sys.executable, "-c", starts_a_sleeper], 3, dict(os.environ))
    assert rc is None and seconds < 60
    grandchild = int(output.split()[0])
    for _ in range(50):  # SIGKILL is delivered at once; give the kernel a moment to tear it down
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_a_stage_reads_its_output_and_a_crash_in_reading_is_a_failure(gpu_check, tmp_path):
    ctx = gpu_check.Context([sys.executable], dict(os.environ), tmp_path, None, time.monotonic() + 60)
    say = [sys.executable, "-c", "print('== 7 passed, 2 skipped in 1.0s ==')"]
    counts = gpu_check.rep.pytest_counts
    stage = ctx.run("fake-tests", say, 30, lambda rc, out: rc == 0 and counts(out)["passed"],
                    lambda out: f"{counts(out)['passed']} passed")
    assert (stage.status, stage.summary, stage.rc) == ("PASS", "7 passed", 0)
    stage = ctx.run("unreadable", say, 30, lambda rc, out: out["no such key"], str)
    assert stage.status == "FAIL" and "could not read the result: TypeError" in stage.summary
    stage = ctx.run("crashes", [sys.executable, "-c", "raise SystemExit('broken')"], 30, lambda rc, out: rc == 0, str)
    assert stage.status == "FAIL" and stage.summary == "exit 1: broken"


def test_pytest_summary_lines_are_counted(gpu_check):
    counts = gpu_check.rep.pytest_counts
    assert counts("....\n== 3 failed, 200 passed, 5 skipped, 1 warning in 12.30s ==\n") == \
        {"failed": 3, "passed": 200, "skipped": 5, "warning": 1}
    assert counts("8 workers [64 items]\n........\n64 passed in 3.20s\n") == {"passed": 64}
    assert counts("no summary here") == {}


def test_a_benchmark_table_gives_its_last_row(gpu_check):
    last_table_row = gpu_check.rep.last_table_row
    table = ("new tokens |  cache tok/s | no-cache tok/s\n-----------\n        64 |   258.5 |  87.8\n"
             "       256 |   281.1 |  44.2\nplot written to decode.png\n")
    assert last_table_row(table) == "256 | 281.1 | 44.2"


def fake_attention_rows() -> list[dict]:
    rows = []
    for mode, scale in (("fwd", 1.0), ("fwd+bwd", 3.5)):
        for T in (1024, 4096):
            for backend, tflops in (("naive", 20.0), ("sdpa", 400.0), ("tiled", 5.0), ("triton", 340.0)):
                if backend == "naive" and T == 4096 and mode == "fwd+bwd":
                    rows.append(dict(backend=backend, T=T, mode=mode, skipped="~90 GB > --mem-limit-gb 80"))
                    continue
                flops = scale * 4 * 4 * 8 * T * T * 64 / 2
                rows.append(dict(backend=backend, T=T, mode=mode, ms=1e3 * flops / (tflops * 1e12), peak_mb=1.0,
                                 runs=10, tflops=tflops))
    return rows


def test_attention_rows_give_the_triton_to_sdpa_ratio_and_a_table(gpu_check):
    rep = gpu_check.rep
    rows = fake_attention_rows()
    ok, line = rep.attention_summary(rows)
    assert ok and "triton fwd T=4096: 340 TFLOP/s = 0.85x sdpa-flash" in line and "target >= 0.8x met" in line
    ok, line = rep.attention_summary(rows + [dict(backend="triton", T=16384, mode="fwd", error=["OOM"])])
    assert not ok and line.startswith("errors: triton fwd T=16384")
    table = rep.attention_markdown(rows).splitlines()
    assert table[0] == ("| mode | T | naive ms (TFLOP/s) | sdpa ms (TFLOP/s) | tiled ms (TFLOP/s) | "
                        "triton ms (TFLOP/s) | triton / sdpa |")
    assert len(table) == 2 + 4  # header, rule, (fwd, fwd+bwd) x (1024, 4096)
    assert table[5].startswith("| fwd+bwd | 4096 | skipped | ") and table[5].endswith("(340.0) | 0.85 |")
    # a run stopped halfway, or a CPU run (no TFLOP/s): the times that exist, and no table for no rows
    partial = [dict(backend="naive", T=64, mode="fwd", ms=12.34, peak_mb=1.0, runs=3)]
    assert rep.attention_markdown(partial).splitlines()[2] == "| fwd | 64 | 12.3 | - |"
    assert rep.attention_markdown([]) == "" and rep.attention_summary([]) == (False, "no triton and sdpa timings "
                                                                                    "at T=4096")


def test_results_file_from_made_up_stages(gpu_check, tmp_path):
    rep = gpu_check.rep
    table = rep.attention_markdown(fake_attention_rows())
    stages = [
        rep.Stage("attention-tests", "PASS", 81, "212 passed, 3 skipped", "..........\n212 passed, 3 skipped in 70s"),
        rep.Stage("bench-attention", "PASS", 120, rep.attention_summary(fake_attention_rows())[1], "B=4 ...", table),
        rep.Stage("train", "FAIL", 33, "exit 1: CUDA out of memory", "Traceback ...\nCUDA out of memory"),
        rep.Stage("extras", "SKIP", 0, "no other benchmarks/bench_*.py takes --device"),
    ]
    info = dict(date="2026-12-01 10:00 UTC", device="NVIDIA H200 (sm_90, 132 SMs, 140 GiB)", driver="580.159.04",
                cuda_version="13.0", torch="2.11.0+cu130", triton="3.6.0", python="3.12.3",
                how="python3 with PYTHONPATH=src", load="load average 0.10, 0.20, 0.30")
    path = gpu_check.write_results(tmp_path / "out", tmp_path / "results", info, stages, 300, 470)
    text = path.read_text()
    assert path == tmp_path / "results" / "gpu-2026-12-01.md"
    assert (tmp_path / "out" / "gpu-2026-12-01.md").read_text() == text
    assert text.startswith("# GPU check, 2026-12-01 10:00 UTC\n")
    for label, value in (("device", "NVIDIA H200 (sm_90, 132 SMs, 140 GiB)"), ("driver", "580.159.04"),
                         ("torch", "2.11.0+cu130"), ("triton", "3.6.0")):
        assert f"| {label} | {value} |" in text
    assert "| attention-tests | PASS | 81 | 212 passed, 3 skipped |" in text
    assert "| train | FAIL | 33 | exit 1: CUDA out of memory |" in text
    assert table in text  # each stage's table, under its own heading
    assert "## train: FAIL\n\n```\nTraceback ...\nCUDA out of memory\n```" in text
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "===== train: FAIL in 33 s: exit 1: CUDA out of memory\nTraceback ..." in log
    assert rep.summary_line(stages[0]) == "PASS    attention-tests            81 s  212 passed, 3 skipped"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's bf16 row
def test_the_error_worker_against_float64_naive_on_the_cpu(monkeypatch):
    """The attention-errors stage's own code, at a small size on the CPU (triton under the interpreter,
    which gets bf16 dots wrong: that row is expected to fail, as the skip in the backend tests says)."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(TOOLS))
    import _gpu_check_workers

    rows = _gpu_check_workers.attention_errors(device="cpu", batch=2, heads=2, kv_heads=1, T=40, head_dim=16)
    assert [(r["backend"], r["dtype"]) for r in rows][:4] == [("sdpa", "fp32"), ("tiled", "fp32"),
                                                              ("triton", "fp32"), ("sdpa", "bf16")]
    assert all(r["ok"] for r in rows if (r["backend"], r["dtype"]) != ("triton", "bf16"))
    assert all(r["rel_out"] < 1e-6 for r in rows if r["dtype"] == "fp32")
    table = _gpu_check_workers.errors_markdown(rows).splitlines()
    assert len(table) == 2 + 9 and table[2].startswith("| sdpa | fp32 | ")
