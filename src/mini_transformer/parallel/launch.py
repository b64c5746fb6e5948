"""Run a function on N local processes joined in one torch.distributed group — for tests and benchmarks.

    results = run_processes(check_tp, world_size=2, args=(cfg,), timeout=60)   # [rank 0's, rank 1's]

torchrun is the launcher for real runs; this helper exists so that a test can start two gloo ranks,
get their return values back, and never hang: every rank reports its result or its traceback through
a queue, a rank that fails lets the others report for a moment (a bad setup should fail on EVERY rank
with the same clear error) and then everything still running is terminated; past `timeout` the ranks
still running are named in a TimeoutError. Whatever happens, no process outlives the call.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._checks import number, positive_int

GRACE_S = 5.0  # after one rank fails, how long the others get to report their own error


class RankFailed(RuntimeError):
    """One or more ranks raised; `errors` maps rank -> the traceback text it reported."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        detail = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items()))
        super().__init__(f"rank(s) {sorted(errors)} failed:\n{detail}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(value) -> bytes:  # through bytes: a tensor must not be shared with a process about to exit
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(fn, rank: int, world_size: int, port: int, backend: str | None, timeout: float, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        if backend is not None:  # None: fn joins the group itself from the environment, as under torchrun
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        results.put((rank, "ok", _dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which re-raises it
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_processes(fn: Callable, world_size: int = 2, *, args: tuple = (), timeout: float = 60.0,
                  backend: str | None = "gloo") -> list:
    """Call fn(rank, world_size, *args) in `world_size` spawned processes sharing a process group on
    127.0.0.1; return their return values in rank order. `fn` must be importable (module level).

    backend=None starts no group: the ranks get torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) and `fn` calls init_process_group itself (as `train` does)."""
    positive_int("world_size", world_size)
    number("timeout", timeout, low=0.0, low_open=True, expected="a positive number of seconds")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, port, backend, timeout, args, results),
                         daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        done, errors = _collect(results, procs, timeout)
    finally:
        _stop(procs)
    if errors:
        raise RankFailed(errors)
    missing = [rank for rank in range(world_size) if rank not in done]
    if missing:
        raise TimeoutError(f"rank(s) {missing} did not finish within timeout={timeout}s and were terminated")
    return [torch.load(io.BytesIO(done[rank]), weights_only=False) for rank in range(world_size)]


def _collect(results, procs, timeout: float) -> tuple[dict[int, bytes], dict[int, str]]:
    """Read reports until every rank has one, the deadline passes, or the grace after a failure ends."""
    done: dict[int, bytes] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(done) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0)
                    and rank not in done and rank not in errors]
            for rank in dead:  # killed without reporting (a segfault, the OOM killer)
                errors[rank] = f"process exited with code {procs[rank].exitcode} without reporting"
                deadline = min(deadline, time.monotonic() + GRACE_S)  # the others may be waiting for it
            continue
        if status == "ok":
            done[rank] = payload
        else:
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + GRACE_S)
    return done, errors


def _stop(procs) -> None:
    for p in procs:
        p.join(timeout=2.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()
