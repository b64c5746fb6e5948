"""Pipeline parallelism on 2 gloo ranks: the bubble measured against its formula, and activation memory.

    python benchmarks/bench_parallel.py --pp --plot      # the tables below, and out/pp_timeline.png
    python benchmarks/bench_pipeline.py --plot           # the same, on its own

For each schedule (GPipe, 1F1B, interleaved 1F1B with 2 stages per rank) and M in {1, 2, 4, 8}
microbatches, one training step of the same global batch on 2 ranks (PipelineTrainer, parallel/pp.py):
  * step time, and the MEASURED bubble: every call of a stage's forward_one_chunk / backward_one_chunk is
    timed (perf_counter, one clock for all processes of the machine); a rank's idle fraction is 1 - its
    busy time / the step's span (first start to last end over both ranks). Compared with the formula
    (p-1)/(M+p-1) for GPipe and 1F1B and (p-1)/(vM+p-1) for the interleaved schedule (v = 2).
  * the same calls replayed (replayed_bubble): each lasting the CPU time its thread really spent in it, in
    the recorded order, with the pipeline's dependencies: the bubble of this run on an otherwise idle
    machine. On a shared machine the wall-clock bubble also counts the time a rank was descheduled.
  * peak activation memory per rank: the bytes of the tensors autograd saves for backward, counted
    while they are alive (torch.autograd.graph.saved_tensors_hooks; parameters are not counted). GPipe
    keeps all M microbatches' activations until its backward phase, 1F1B at most p.
Stages are balanced (4 equal blocks, a small char vocabulary, so the head costs little), as the formula
assumes. The warm-up step (shape inference, allocations) is not measured; of --repeats steps the fastest is
reported: on a shared machine other processes only ever add time, and they add it unevenly to the ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from mini_transformer import TransformerConfig, TransformerLM
from mini_transformer.parallel import run_processes
from mini_transformer.parallel.pp import STAGES_PER_RANK, PipelineTrainer, bubble_fraction, check_pipeline

MICROBATCHES = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
RANKS = 2


def bench_config(args) -> TransformerConfig:
    return TransformerConfig(vocab_size=96, d_model=args.pp_d_model, n_heads=4, n_layer=4, d_ff=4 * args.pp_d_model,
                             max_seq_len=args.pp_seq, attn_backend="sdpa")


def formula(schedule: str, microbatches: int, ranks: int = RANKS) -> float:
    return bubble_fraction(ranks, microbatches, STAGES_PER_RANK[schedule])


class SavedActivations:
    """Bytes of the non-parameter tensors autograd holds for backward right now, and their peak."""

    def __init__(self, parameters):
        self.params = {p.untyped_storage().data_ptr() for p in parameters}
        self.live = self.peak = 0

    def pack(self, tensor):
        if tensor.untyped_storage().data_ptr() in self.params:
            return tensor
        holder = _Held(tensor)
        self.live += holder.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._release, holder.nbytes)
        return holder

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed


class _Held:
    def __init__(self, tensor):
        self.tensor, self.nbytes = tensor, tensor.numel() * tensor.element_size()


def time_calls(stage, events: list) -> None:
    """Wrap this stage's forward_one_chunk and backward_one_chunk to log (kind, stage, microbatch, start, end,
    CPU seconds of this thread during the call)."""
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        method = getattr(stage, name)

        def timed(chunk, *a, _method=method, _kind=kind, **k):
            start, cpu = time.perf_counter(), time.thread_time()
            out = _method(chunk, *a, **k)
            events.append((_kind, stage.stage_index, chunk, start, time.perf_counter(), time.thread_time() - cpu))
            return out

        setattr(stage, name, timed)


def measure_one(args, model: TransformerLM, schedule: str, microbatches: int) -> list[dict]:
    """--repeats timed steps of one schedule at one M on this rank: its calls' times and peak activations."""
    trainer = PipelineTrainer(model, schedule, microbatches)
    events: list = []
    for stage in trainer.stages:
        time_calls(stage, events)
    x = torch.randint(model.config.vocab_size, (args.pp_batch, args.pp_seq), generator=torch.Generator().manual_seed(1))
    trainer.step(x, x)  # warm-up: shape inference, buffers
    steps = []
    for _ in range(args.pp_repeats):
        model.zero_grad(set_to_none=False)
        events.clear()
        memory = SavedActivations(model.parameters())
        dist.barrier()
        with torch.autograd.graph.saved_tensors_hooks(memory.pack, memory.unpack):
            trainer.step(x, x)
        steps.append({"events": list(events), "peak": memory.peak})
    return steps


def pp_worker(rank: int, world_size: int, args) -> dict:
    """Every schedule at every M, in this one launch (a start costs seconds); None where a schedule
    refuses the M (check_pipeline raises on both ranks before any message)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TransformerLM(bench_config(args))
    out = {}
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            try:
                check_pipeline(model.config, world_size, schedule, m, args.pp_batch)
            except ValueError:
                out[schedule, m] = None
                continue
            out[schedule, m] = measure_one(args, model, schedule, m)
    return out


def replayed_bubble(events: list[list[tuple]], n_stages: int) -> float:
    """The bubble of the SAME calls, in the same order per rank, each lasting the CPU time it really took,
    started as soon as its rank is free and its inputs exist (a forward needs the previous stage's forward
    of its microbatch, a backward its own forward and the next stage's backward): the step as it would run
    on a machine where nothing else competes for the cores. Mean idle fraction over the ranks."""
    end, free, busy = {}, [0.0] * len(events), [0.0] * len(events)
    pending = [sorted(rank, key=lambda e: e[3]) for rank in events]
    while any(pending):
        progress = False
        for r, queue in enumerate(pending):
            while queue:
                kind, stage, chunk, *_, cpu = queue[0]
                needs = [("F", stage - 1, chunk)] if kind == "F" and stage > 0 else []
                if kind == "B":
                    needs = [("F", stage, chunk)] + ([("B", stage + 1, chunk)] if stage < n_stages - 1 else [])
                if any(n not in end for n in needs):
                    break
                end[kind, stage, chunk] = free[r] = max([free[r]] + [end[n] for n in needs]) + cpu
                busy[r] += cpu
                queue.pop(0)
                progress = True
        assert progress, "the recorded orders wait on each other"
    span = max(end.values())
    return statistics.mean(1 - b / span for b in busy)


def summarize(ranks: list[dict], key, repeats: int) -> dict | None:
    """The fastest of the --repeats steps of one schedule and M: span, idle fraction per rank, events."""
    if ranks[0][key] is None:
        return None
    rows = []
    for step in range(repeats):
        events = [ranks[r][key][step]["events"] for r in range(RANKS)]
        start = min(e[3] for rank in events for e in rank)
        span = max(e[4] for rank in events for e in rank) - start
        idle = [1 - sum(e[4] - e[3] for e in rank) / span for rank in events]
        replayed = replayed_bubble(events, RANKS * STAGES_PER_RANK[key[0]])
        rows.append(dict(span=span, idle=idle, start=start, events=events, replayed=replayed))
    best = min(rows, key=lambda r: r["span"])  # the least disturbed step: other processes only ever add time
    return dict(step_s=best["span"], bubble=statistics.mean(best["idle"]), idle=best["idle"], events=best["events"],
                start=best["start"], replayed=best["replayed"], peak=[ranks[r][key][0]["peak"] for r in range(RANKS)])


def bench_pipeline(args) -> list[dict]:
    ranks = run_processes(pp_worker, RANKS, args=(args,), timeout=args.timeout)
    rows = []
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            r = summarize(ranks, (schedule, m), args.pp_repeats)
            row = dict(schedule=schedule, m=m, formula=formula(schedule, m))
            if r is None:
                rows.append({**row, "step_s": "refused (M < p)", "bubble": "-", "gap": "-", "idle": "-", "peak": None,
                             "replayed": "-"})
                continue
            rows.append({**row, "step_s": r["step_s"], "bubble": r["bubble"], "gap": r["bubble"] - row["formula"],
                         "idle": " / ".join(f"{i:.3f}" for i in r["idle"]), "peak": r["peak"],
                         "replayed": r["replayed"],
                         "events": r["events"], "start": r["start"]})
    return rows


def memory_rows(rows: list[dict]) -> list[dict]:
    """Peak saved activations per rank at each M, as a ratio to GPipe's at the same M."""
    gpipe = {r["m"]: r["peak"] for r in rows if r["schedule"] == "gpipe"}
    out = []
    for r in rows:
        if r["peak"] is None:
            continue
        ratios = [p / g for p, g in zip(r["peak"], gpipe[r["m"]], strict=True)]
        out.append(dict(schedule=r["schedule"], m=r["m"], rank0_mb=r["peak"][0] / 1e6, rank1_mb=r["peak"][1] / 1e6,
                        ratio=" / ".join(f"{x:.3f}" for x in ratios)))
    return out


def plot_timelines(rows: list[dict], m: int, path: Path) -> None:
    """One panel per schedule: per rank, a box per forward (blue) and backward (orange) call, labelled with
    its microbatch (and stage, where a rank holds two); gaps = bubble."""
    from matplotlib.figure import Figure

    chosen = [r for r in rows if r["m"] == m and r["peak"] is not None]
    fig = Figure(figsize=(12, 1.4 + 1.3 * len(chosen)))
    axes = fig.subplots(len(chosen), 1, squeeze=False)[:, 0]
    colours = {"F": "#4c72b0", "B": "#dd8452"}
    for ax, r in zip(axes, chosen, strict=True):
        for rank, events in enumerate(r["events"]):
            for kind, stage, chunk, start, end, _cpu in events:
                left, width = (start - r["start"]) * 1e3, (end - start) * 1e3
                second = stage >= RANKS  # interleaved: this rank's later stage, drawn lighter
                ax.broken_barh([(left, width)], (rank - 0.4, 0.8), facecolors=colours[kind], edgecolors="white",
                               alpha=0.6 if second else 1.0)
                label = f"{kind}{chunk}" + (f"/s{stage}" if r["schedule"] == "interleaved-1f1b" else "")
                ax.text(left + width / 2, rank, label, ha="center", va="center", fontsize=6, color="black")
        ax.set_yticks(range(RANKS), [f"rank {i}" for i in range(RANKS)])
        ax.invert_yaxis()
        ax.set_title(f"{r['schedule']}, M={m}: measured bubble {r['bubble']:.3f}, formula {r['formula']:.3f}",
                     fontsize=9)
    axes[-1].set_xlabel("ms since the step's first forward (F = forward, B = backward, then the microbatch; "
                        "/s = stage)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def table(rows: list[dict], headers: dict[str, str]) -> str:
    def cell(v):
        return f"{v:+.3f}" if isinstance(v, float) and v < 0 else (f"{v:.3f}" if isinstance(v, float) else str(v))

    lines = ["| " + " | ".join(headers.values()) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[k]) for k in headers) + " |" for r in rows])


def run(args) -> None:
    print(f"pipeline: load before {os.getloadavg()}; d_model {args.pp_d_model}, 4 layers, batch {args.pp_batch} x "
          f"{args.pp_seq}, {args.threads} thread(s) per rank, fastest of {args.pp_repeats} steps")
    rows = bench_pipeline(args)
    print("\n" + table(rows, dict(schedule="schedule", m="M", step_s="step s", bubble="measured bubble",
                                  formula="formula", gap="measured - formula", idle="idle rank 0 / 1",
                                  replayed="replayed on CPU times")))
    print("\n" + table(memory_rows(rows), dict(schedule="schedule", m="M", rank0_mb="peak activations rank 0 MB",
                                              rank1_mb="rank 1 MB", ratio="x GPipe (rank 0 / 1)")))
    print(f"\npipeline: load after {os.getloadavg()}")
    if args.plot:
        plot_timelines(rows, args.pp_plot_m, Path("out") / "pp_timeline.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp-d-model", dest="pp_d_model", type=int, default=256, help="pipeline: model width")
    p.add_argument("--pp-batch", dest="pp_batch", type=int, default=16, help="pipeline: sequences per step (global)")
    p.add_argument("--pp-seq", dest="pp_seq", type=int, default=128, help="pipeline: tokens per sequence")
    p.add_argument("--pp-repeats", dest="pp_repeats", type=int, default=5, help="pipeline: steps, fastest reported")
    p.add_argument("--pp-plot-m", dest="pp_plot_m", type=int, default=4, help="pipeline: M of the timeline plot")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--plot", action="store_true")
    run(parser.parse_args())
