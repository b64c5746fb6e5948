"""Weights in 2 MB pages: a decode step streams its weights from memory faster when the TLB has less to do.

A CPU decode step reads every weight once, front to back, so its time is the time to stream hundreds of MB
in. Each 4 KB page of that stream needs its own address translation: 400 MB of fp32 weights are 100,000
pages a step, far more than the TLB holds, so every page costs a page-table walk, and the prefetches issued
ahead of the loads (csrc/float_gemv.cpp) wait for those walks too. With 2 MB pages the same weights are 200
translations. Linux backs an anonymous private mapping with 2 MB pages where it is asked to
(`madvise(MADV_HUGEPAGE)`, with /sys/kernel/mm/transparent_hugepage/enabled at "madvise" or "always");
PyTorch's allocator does not ask (unless THP_MEM_ALLOC_ENABLE=1 is set before it first allocates), so its
tensors sit in 4 KB pages.

    place_weights(model)           # in place: the CPU parameters and buffers of >= 64 KB move to 2 MB pages
    huge_page_empty(shape, dtype)  # a new uninitialised CPU tensor in 2 MB pages

Moving a weight copies its values into a fresh mapping and points the parameter at it (`param.data = new`):
the Parameter objects, their values and dtypes are unchanged, so an optimiser, the state_dict and a compiled
step still see the same model. A tensor that shares its storage with another (a view, a slice of a packed
weight) stays where it is. Where the OS cannot give 2 MB pages (not Linux, THP "never") nothing moves.
What it gains: docs/08b §4 (benchmarks/bench_float_gemv.py --parts pages).
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch
import torch.nn as nn

HUGE_PAGE = 2 << 20  # bytes in one transparent huge page (x86-64, and arm64 with 4 KB base pages)
MIN_BYTES = 64 << 10  # smaller tensors (norms, biases) are read in a few pages whatever their size
_MARK = "_huge_page_data_ptr"  # set on a moved parameter or buffer: where its bytes were put


def available() -> bool:
    """Whether this OS lets a mapping ask for 2 MB pages, and the kernel has not turned them off."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose bytes start on a 2 MB boundary of a mapping that asked for
    2 MB pages (where available() is True). The tensor keeps the mapping alive."""
    mapping, start = _mapping(math.prod(shape) * dtype.itemsize)
    return _tensor(mapping, start, shape, dtype)


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A mapping of at least nbytes in 2 MB pages, and where in it the first 2 MB boundary lies."""
    # private and anonymous: Python's default, shared, is shmem, which THP's "enabled" setting does not cover
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the page faults then take 2 MB pages
    view = ctypes.c_char.from_buffer(mapping)
    start = -ctypes.addressof(view) % HUGE_PAGE  # the kernel aligns a mapping to 4 KB only
    del view  # release the buffer export, so the mapping can go when its tensors do
    return mapping, start


def _tensor(mapping: mmap.mmap, offset: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the bytes of `mapping` from `offset`, with a storage of its own (so two never look like one
    shared storage to a checkpoint writer), which holds the mapping."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


def place_weights(model: nn.Module) -> int:
    """Move every CPU parameter and buffer of at least MIN_BYTES that owns its whole storage into one mapping of
    2 MB pages, each from a 4 KB boundary, once: a second call finds them placed. A tensor registered in several
    modules (tied weights) moves once. Returns the bytes this call moved (0 where available() is False).
    Not while another thread runs the model: each old storage is freed as its tensor moves."""
    if not available():
        return 0
    slots, seen = [], set()
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and id(t) not in seen and _movable(t):
                seen.add(id(t))
                slots.append(t)
    if not slots:
        return 0
    offsets, total = [], 0
    for t in slots:
        offsets.append(total)
        total += -(-t.nbytes // 4096) * 4096
    mapping, start = _mapping(total)
    moved = {}  # id of a moved buffer -> its copy
    # generate() runs under inference mode, whose tensors autograd and in-place updates refuse later: the copies
    # must be ordinary tensors, or the model could not be trained or loaded into after a compiled decode
    with torch.inference_mode(False):
        for t, offset in zip(slots, offsets, strict=True):
            new = _tensor(mapping, start + offset, t.shape, t.dtype).copy_(t.detach())
            if isinstance(t, nn.Parameter):
                t.data = new
                new = t
            else:
                moved[id(t)] = new
            setattr(new, _MARK, new.data_ptr())  # a later `t.data = ...` elsewhere changes the pointer: moved again
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and id(b) in moved:
                module._buffers[name] = moved[id(b)]
    return sum(t.nbytes for t in slots)


def _movable(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized and t.nbytes >= MIN_BYTES
            and t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
            and getattr(t, _MARK, None) != t.data_ptr())
