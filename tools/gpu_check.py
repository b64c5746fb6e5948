"""One prepared check of everything CUDA-side, in one go on a lent GPU (at most 8 minutes).

    python3 tools/gpu_check.py                  # results in out/gpu-check-<date>/ and benchmarks/results/
    python3 tools/gpu_check.py --out DIR        # results in DIR; copy its gpu-<date>.md into benchmarks/results/
    python3 tools/gpu_check.py --stages bench-attention,train   # rerun some stages only

Stages, each a subprocess with its own time limit, all inside --budget seconds:
  attention-tests   tests/test_attention_backends.py -k cuda: sdpa, tiled, triton against float64 naive (fp32,
                    bf16, fp16; forward and backward; padding; GQA), compiled kernels (TRITON_INTERPRET=0)
  attention-errors  each backend's error per dtype at T=1024, D=64, GQA, padding (_gpu_check_workers.py errors)
  bench-attention   bench_attention.py --device cuda --dtype bf16, T = 1024, 4096, 16384: TFLOP/s, plots
  train             a short training run with bf16 autocast and torch.compile (_gpu_check_workers.py train)
  bench-decode      bench_decode.py --device cuda with every decode method it has
  cuda-tests        every other test with a cuda case (pytest tests -k cuda), if there is one
  extras            every other benchmarks/bench_*.py that takes --device (engine, quantization, ...), on cuda;
                    bench_decode_speed.py --quick: ours compiled (CUDA graphs) against HF's static compiled generate
Limits (s): 150, 60, 200, 180, 100, 120, 60 per extra (120 for bench_decode_speed.py, which compiles four
decode graphs); on an H200 they should take about 60, 20, 130, 90, 40.
Python: `uv sync` + `uv run` where uv exists and its torch sees the GPU; else this interpreter with
PYTHONPATH=src (the lent machines have no network and no uv; their python3 has torch, triton and pytest).
The folder gets the results file, one log of every stage and the plots: at most 8 files, what the device
tool returns.

Exit status: 0 every stage that ran passed; 1 a stage failed or ran out of time; 77 (the usual "skipped"
code) when there is no CUDA device: then it prints one line starting with SKIP, within seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _gpu_check_report as rep
from _gpu_check_report import Stage

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = 77
OWN_SCRIPTS = {"bench_attention.py", "bench_decode.py", "bench_train.py"}  # bench_train: the CPU baby run
EXTRA_LIMITS = {"bench_decode_speed.py": 120}  # seconds; any other extra gets 60
PROBE = """import importlib.util, json, sys, torch
info = dict(cuda=torch.cuda.is_available(), torch=torch.__version__, cuda_version=torch.version.cuda,
            python=sys.version.split()[0], xdist=importlib.util.find_spec("xdist") is not None)
if info["cuda"]:
    p = torch.cuda.get_device_properties(0)
    gib = p.total_memory / 2**30
    info["device"] = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {gib:.0f} GiB)"
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = "not installed"
print(json.dumps(info))"""


def run_command(cmd: list[str], limit: float, env: dict) -> tuple[int | None, str, float]:
    """-> (exit status, or None when it ran past `limit`; output; seconds). The command leads its own
    process group, so a timeout also ends what it started (pytest workers, benchmark subprocesses)."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended on its own just now
                pass
            proc.wait()
            rc = None
        log.seek(0)
        return rc, log.read(), time.monotonic() - start


def driver_present() -> bool:
    """Cheap test for an NVIDIA driver, before any slow import."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version")) or \
        shutil.which("nvidia-smi") is not None


@dataclass
class Context:
    python: list[str]
    env: dict
    out: Path
    args: argparse.Namespace
    deadline: float
    xdist: bool = False

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], limit: float, ok, summary, report=None, **env) -> Stage:
        """Run one stage's command inside its own limit and what is left of the budget; ok(rc, output),
        summary(output) and report(output) read the result."""
        limit = min(limit, self.remaining())
        rc, output, seconds = run_command([str(c) for c in cmd], limit, {**self.env, **env})
        try:
            passed, line = bool(ok(rc, output)), summary(output)
            body = report(output) if report else ""
        except Exception as err:  # a result that cannot be read is a failed stage, not a crashed check
            passed, line, body = False, f"could not read the result: {type(err).__name__}: {err}", ""
        if rc is None:
            line = f"ran past its {limit:.0f} s limit; {line}"
        elif not passed and rc != 0:
            line = f"exit {rc}: {rep.tail(output, 1)[:200]}"
        return Stage(name, rep.status_of(rc, passed), seconds, line, output, body, rc)


# ------------------------------------------------------------------------------------- the stages
def attention_tests(ctx: Context) -> list[Stage]:
    cmd = [*ctx.python, "-m", "pytest", "tests/test_attention_backends.py", "-k", "cuda", "-rfE", "-p",
           "no:cacheprovider", *(["-n", "8"] if ctx.xdist else [])]
    counts = lambda out: ", ".join(f"{n} {w}" for w, n in rep.pytest_counts(out).items())  # noqa: E731
    return [ctx.run("attention-tests", cmd, 150, lambda rc, out: rc == 0 and rep.pytest_counts(out).get("passed"),
                    counts, lambda out: rep.code_block(rep.tail(out, 15)), TRITON_INTERPRET="0")]


def attention_errors(ctx: Context) -> list[Stage]:
    def summary(out):
        rows = rep.last_json(out)["rows"]
        r = next(r for r in rows if r["backend"] == "triton" and r["dtype"] == "bf16")
        bad = [f"{r['backend']} {r['dtype']}" for r in rows if not r["ok"]]
        over = f"; over the bound: {', '.join(bad)}" if bad else ""
        return (f"triton bf16 relative error out {r['rel_out']:.1g}, dq {r['rel_dq']:.1g}, dk {r['rel_dk']:.1g}, "
                f"dv {r['rel_dv']:.1g} (bound {r['tolerance']:g}){over}")

    cmd = [*ctx.python, "tools/_gpu_check_workers.py", "errors"]
    return [ctx.run("attention-errors", cmd, 60, lambda rc, out: rc == 0 and rep.last_json(out)["ok"], summary,
                    rep.markdown_lines, TRITON_INTERPRET="0")]


def bench_attention(ctx: Context) -> list[Stage]:
    json_path = ctx.out / "attention.json"
    cmd = [*ctx.python, "benchmarks/bench_attention.py", "--device", "cuda", "--dtype", "bf16", "--seq-lens",
           "1024,4096,16384", "--batch", ctx.args.attn_batch, "--sdpa-kernel", "flash", "--mem-limit-gb", "80",
           "--seconds", "1", "--max-repeats", "50", "--plot", "--out-dir", ctx.out, "--json", json_path]
    rows = lambda: json.loads(json_path.read_text()) if json_path.exists() else []  # noqa: E731
    return [ctx.run("bench-attention", cmd, 200, lambda rc, out: rc == 0 and rep.attention_summary(rows())[0],
                    lambda out: rep.attention_summary(rows())[1],
                    lambda out: "\n\n".join(filter(None, [rep.attention_markdown(rows()),
                                                            rep.code_block(rep.section_from(out, "B="))])),
                    TRITON_INTERPRET="0")]


def train(ctx: Context) -> list[Stage]:
    def summary(out):
        r = rep.last_json(out)
        return (f"{r['tokens_per_s']:,.0f} tokens/s ({r['ms_per_step']:.1f} ms/step), loss {r['loss_first10']:.2f} "
                f"-> {r['loss_last10']:.2f} ({'falls' if r['loss_falls'] else 'does NOT fall'}), "
                f"first step with compile {r['first_step_s']:.0f} s")

    cmd = [*ctx.python, "tools/_gpu_check_workers.py", "train", "--out-dir", ctx.out, "--steps",
           ctx.args.train_steps, "--data", ctx.args.train_data]
    return [ctx.run("train", cmd, 180, lambda rc, out: rc == 0 and rep.last_json(out)["loss_falls"], summary,
                    rep.markdown_lines)]


def bench_decode(ctx: Context) -> list[Stage]:
    cmd = [*ctx.python, "benchmarks/bench_decode.py", "--device", "cuda", "--lengths", "64", "256", "--repeats",
           "3", "--plot", ctx.out / "decode.png"]
    return [ctx.run("bench-decode", cmd, 100, lambda rc, out: rc == 0, rep.last_table_row,
                    lambda out: rep.code_block(rep.section_from(out, "GPT-2 arch")))]


def cuda_tests(ctx: Context) -> list[Stage]:
    cmd = [*ctx.python, "-m", "pytest", "tests", "-k", "cuda", "-rfE", "-p", "no:cacheprovider",
           "--ignore=tests/test_attention_backends.py", "--ignore=tests/test_gpu_check.py"]
    stage = ctx.run("cuda-tests", cmd, 120, lambda rc, out: rc == 0,
                    lambda out: ", ".join(f"{n} {w}" for w, n in rep.pytest_counts(out).items()),
                    lambda out: rep.code_block(rep.tail(out, 15)), TRITON_INTERPRET="0")
    if stage.rc == 5:  # pytest: no test selected
        stage.status, stage.summary = "SKIP", "no other test has a cuda case"
    return [stage]


def extras(ctx: Context) -> list[Stage]:
    """Whatever later stages added with a CUDA path: each benchmarks/bench_*.py that takes --device."""
    stages = []
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        text = script.read_text(encoding="utf-8")
        if script.name in OWN_SCRIPTS or '"--device"' not in text:
            continue
        if ctx.remaining() < 10:
            stages.append(Stage(f"extra {script.name}", "SKIP", summary="no time left in --budget"))
            continue
        cmd = [*ctx.python, script, "--device", "cuda", *(["--quick"] if '"--quick"' in text else [])]
        stages.append(ctx.run(f"extra {script.name}", cmd, EXTRA_LIMITS.get(script.name, 60), lambda rc, out: rc == 0,
                              lambda out: " ".join(rep.tail(out, 1).split())[:200]))
    return stages or [Stage("extras", "SKIP", summary="no other benchmarks/bench_*.py takes --device")]


STAGES = {"attention-tests": attention_tests, "attention-errors": attention_errors,
          "bench-attention": bench_attention, "train": train, "bench-decode": bench_decode,
          "cuda-tests": cuda_tests, "extras": extras}


# ------------------------------------------------------------------------------ python and the GPU
def base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(ROOT / "src")
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")])), PYTHONUNBUFFERED="1",
               MPLBACKEND="Agg", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def pick_python(env: dict, deadline: float) -> tuple[list[str] | None, dict, list[Stage]]:
    """-> (the command that starts Python, what the probe saw, the uv-sync stage if uv ran). The first
    candidate whose torch sees a GPU wins: a uv environment's torch may be built for a newer driver."""
    candidates, stages = [], []
    if os.environ.get("GPU_CHECK_PYTHON"):
        candidates.append(([os.environ["GPU_CHECK_PYTHON"]], "GPU_CHECK_PYTHON with PYTHONPATH=src"))
    elif shutil.which("uv"):
        rc, output, seconds = run_command(["uv", "sync"], min(60, deadline - time.monotonic()), env)
        sync = Stage("uv-sync", "PASS" if rc == 0 else "SKIP", seconds, "", output)
        sync.summary = "uv sync done" if rc == 0 else f"uv sync failed ({rep.tail(output, 1)[:120]}): no uv run"
        stages.append(sync)
        if rc == 0:
            candidates.append((["uv", "run", "--no-sync", "python"], "uv sync + uv run"))
    candidates.append(([sys.executable], f"{sys.executable} with PYTHONPATH=src (no uv environment)"))
    seen = {}
    for python, how in candidates:
        rc, output, _ = run_command([*python, "-c", PROBE], min(120, deadline - time.monotonic()), env)
        seen = rep.last_json(output) or {"probe": rep.tail(output, 2)}
        seen["how"] = how
        if rc == 0 and seen.get("cuda"):
            return python, seen, stages
    return None, seen, stages


def machine_info(probe: dict) -> dict:
    info = {k: v for k, v in probe.items() if isinstance(v, str)}
    info["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    info["load"] = "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    for key, cmd in (("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                     ("smi", ["nvidia-smi", "--query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,"
                              "utilization.gpu", "--format=csv,noheader"]),
                     ("commit", ["git", "rev-parse", "--short", "HEAD"])):
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
            info[key] = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""
        except (OSError, subprocess.TimeoutExpired):
            info[key] = ""
    return info


# -------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="folder for everything (default out/gpu-check-<date>)")
    p.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results",
                   help="where gpu-<date>.md goes besides --out")
    p.add_argument("--budget", type=float, default=470, help="seconds for all stages together (default 470)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list, in this order: {','.join(STAGES)}")
    p.add_argument("--attn-batch", type=int, default=4, help="bench-attention batch (H=8, D=64)")
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--train-data", default="pydoc", help="pydoc (no network needed) | shakespeare | PATH")
    args = p.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        p.error(f"--stages: {', '.join(unknown)} not known; expected some of {', '.join(STAGES)}")
    if args.budget <= 0 or args.attn_batch <= 0 or args.train_steps < 20:
        p.error("--budget and --attn-batch must be positive, --train-steps at least 20")
    return args


def write_results(out: Path, results: Path, info: dict, stages: list[Stage], seconds: float, budget: float) -> Path:
    """gpu-<date>.md into `out` and `results`, and every stage's output into out/gpu-check.log."""
    day = info["date"][:10]
    for folder in (out, results):
        folder.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu-check.log", "w", encoding="utf-8") as log:
        for s in stages:
            log.write(f"\n===== {s.name}: {s.status} in {s.seconds:.0f} s: {s.summary}\n{s.output}\n")
    text = rep.assemble_report(info, stages, seconds, budget)
    for folder in (out, results):
        (folder / f"gpu-{day}.md").write_text(text, encoding="utf-8")
    return results / f"gpu-{day}.md"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not driver_present():
        print("SKIP gpu_check: no CUDA device here (no nvidia-smi, /dev/nvidiactl or /proc/driver/nvidia); "
              "nothing was checked", flush=True)
        return SKIPPED
    start = time.monotonic()
    env = base_env()
    python, probe, stages = pick_python(env, start + args.budget)
    if python is None:
        print(f"SKIP gpu_check: torch sees no CUDA device ({probe}); nothing was checked", flush=True)
        return SKIPPED
    out = args.out or ROOT / "out" / f"gpu-check-{time.strftime('%Y-%m-%d', time.gmtime())}"
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(python, env, out.resolve(), args, start + args.budget, bool(probe.get("xdist")))
    print(f"gpu_check: {probe.get('device')}, torch {probe.get('torch')}, {probe['how']}", flush=True)
    for name in args.stages:
        new = [Stage(name, "SKIP", summary="no time left in --budget")] if ctx.remaining() < 10 else STAGES[name](ctx)
        for stage in new:
            print(rep.summary_line(stage), flush=True)
        stages += new
    path = write_results(out, args.results_dir, machine_info(probe), stages, time.monotonic() - start, args.budget)
    print(f"\nresults: {path} (and {out})\n" + "\n".join(rep.summary_line(s) for s in stages))
    return 0 if all(s.status in ("PASS", "SKIP") for s in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
