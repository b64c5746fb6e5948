"""Builds the C++ kernels of csrc/ on first use (torch.utils.cpp_extension.load) and loads their operators.

Each kernel module keeps a PyTorch reference beside its kernel; `build` answers False where the C++ cannot be
built (no compiler, not a POSIX system, MINI_TRANSFORMER_NATIVE_KERNELS=0), and the caller runs the reference.
The compiler's own macros pick each kernel's path (csrc/README.md): AVX-512 where the machine has it, else AVX2,
else the portable C++ beside them. `build_variant` builds every kernel for a narrower instruction set than the
machine's into one extension (the portable path; AVX2 alone, or AVX-512 without BF16 and VNNI, on an AVX-512
machine), for the tests and
benchmarks/bench_kernels.py, so each path is checked on any machine that can run it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["CSRC", "ENABLE_VARIABLE", "KERNEL_SOURCES", "VARIANTS", "build", "build_variant"]

CSRC = Path(__file__).parent / "csrc"
ENABLE_VARIABLE = "MINI_TRANSFORMER_NATIVE_KERNELS"  # "0": every kernel module runs its PyTorch reference
KERNEL_SOURCES = ("float_gemv.cpp", "int4_gemv.cpp", "paged_decode.cpp", "one_query.cpp", "fused_ops.cpp")
# The narrower builds: the macro csrc/ops.h appends to every operator library's name (mt_float_portable, ...), the
# x86 flags that take the wider instruction sets away, and the CPU flags the build needs.
VARIANTS = {
    "portable": ("-DMINI_TRANSFORMER_PORTABLE", ["-mno-avx2"], ()),  # AVX-512 depends on AVX2: both go
    "avx2": ("-DMINI_TRANSFORMER_AVX2", ["-mno-avx512f"], ("avx2", "fma", "f16c")),  # every AVX-512 extension goes
    # AVX-512 as Skylake-SP has it: bf16 widened on load, int4 on the AVX2 loop
    "avx512": ("-DMINI_TRANSFORMER_AVX512", ["-mno-avx512bf16", "-mno-avx512vnni", "-mno-avx512fp16"],
               ("avx512f", "avx512bw", "avx512vl")),
}

_built: dict[str, bool] = {}


def _build_name(prefix: str, source: str) -> str:
    """The extension's name: the CPU's flags, torch's version and the source are part of it, since it is
    built with -march=native and a shared cache directory might otherwise hand one machine's (or one
    version's) build to another. So is torch's directory: the build's command line names it (-isystem, -L),
    and ninja rebuilds when the command changes, so two virtual environments sharing the cache would
    otherwise rebuild each other's kernel every time they took turns."""
    flags = " ".join(sorted(_cpu_flags()))
    key = f"{platform.machine()} {flags} {torch.__version__} {os.path.dirname(torch.__file__)} {source}"
    return f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _source_text(sources: list[Path], cflags: list[str]) -> str:
    """What a build's name must follow besides the machine: every file of csrc/ it may include (the headers
    too), byte for byte, the compiler flags, and csrc/'s directory (the build's command line names it, so
    two checkouts sharing the cache would otherwise rebuild each other's kernels, as for torch's directory)."""
    files = sorted({*sources, *CSRC.glob("*.h")})
    return f"{CSRC} " + " ".join(cflags) + "".join(path.read_text() for path in files)


def _cpu_flags() -> set[str]:
    if not os.path.exists("/proc/cpuinfo"):
        return set()
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def _cflags(variant: str | None = None) -> list[str]:
    """-O3 for this machine's instruction sets (clang on Apple silicon spells it -mcpu=native); a `variant`
    (VARIANTS) names its ops *_portable or *_avx2 and, on x86, takes the wider instruction sets away.

    -fopenmp where torch's threads are OpenMP's: at::parallel_for is a plain loop on one thread in code
    compiled without it (ATen/ParallelOpenMP.h tests _OPENMP). Only compiled with it, not linked: the OpenMP
    calls bind to the runtime torch loaded, whose thread count torch.set_num_threads sets. Apple's clang
    has no -fopenmp, so there the kernels stay on one thread."""
    darwin = platform.system() == "Darwin"
    arch = "-mcpu=native" if darwin and platform.machine() == "arm64" else "-march=native"
    flags = ["-O3", arch]
    if torch.backends.openmp.is_available() and not darwin:
        flags.append("-fopenmp")
    if variant is not None:
        macro, x86_flags, _ = VARIANTS[variant]
        flags.append(macro)
        if platform.machine().lower() in ("x86_64", "amd64"):
            flags += x86_flags
    return flags


def _load(prefix: str, files: tuple[str, ...], what: str, variant: str | None) -> bool:
    """Build (first call: tens of seconds, then cached on disk) and load `files` of csrc/; False, with one
    warning naming `what`, where that fails; False without a warning where it is switched off."""
    if os.environ.get(ENABLE_VARIABLE, "1") == "0" or os.name != "posix":
        return False
    try:
        from torch.utils.cpp_extension import load

        sources = [CSRC / name for name in files]
        cflags = _cflags(variant)
        load(_build_name(prefix, _source_text(sources, cflags)), sources=[str(path) for path in sources],
             extra_cflags=cflags, extra_include_paths=[str(CSRC)], is_python_module=False, verbose=False)
        return True
    except Exception as error:  # noqa: BLE001 - any build failure means: use the reference
        warnings.warn(f"the {what} C++ kernel could not be built ({error}); using the PyTorch reference",
                      stacklevel=4)
        return False


def build(prefix: str, source: str, what: str, fakes: dict[str, Callable] | None = None) -> bool:
    """Build and load csrc/`source`, which registers its operators with the dispatcher; then register each
    operator's shape function from `fakes` ("lib::op" -> fn), so torch.compile can trace a call without
    running it. False where it cannot be built (the caller runs its reference)."""
    if prefix not in _built:
        _built[prefix] = _load(prefix, (source,), what, variant=None)
        if _built[prefix]:
            for name, shape in (fakes or {}).items():
                torch.library.register_fake(name)(shape)
    return _built[prefix]


def build_variant(variant: str) -> bool:
    """Every kernel built as `variant` (VARIANTS) in one extension, its operators named after it
    (mt_float_portable::gemv, mt_gemv_avx2::int4, mt_paged_<variant>::decode, mt_one_query_<variant>::attend,
    mt_fused_<variant>::*): one compile, loadable beside the ordinary build. False where the CPU lacks what
    the variant needs (AVX2 on a machine without it) or the build fails."""
    if variant not in _built:
        needs = VARIANTS[variant][2]
        runs_here = not needs or (platform.machine().lower() in ("x86_64", "amd64") and set(needs) <= _cpu_flags())
        _built[variant] = runs_here and _load(f"mt_{variant}", KERNEL_SOURCES, variant, variant)
    return _built[variant]
