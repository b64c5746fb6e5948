"""Small C++ kernels built on first use (torch.utils.cpp_extension.load_inline), shared by every module
that has one (the int4 GEMV in model/, the paged decode attention in attention/, ...).

Each kernel module keeps a pure-PyTorch reference beside its C++ source; `build` answers False where the
C++ cannot be built (no compiler, not Linux, MT_NATIVE_KERNELS=0), and the caller then runs the reference.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from collections.abc import Callable

import torch

__all__ = ["build"]

_built: dict[str, bool] = {}


def _build_name(prefix: str, source: str) -> str:
    """The extension's name: the CPU's flags, torch's version and the source are part of it, since it is
    built with -march=native and a shared cache directory might otherwise hand one machine's (or one
    version's) build to another. So is torch's directory: the build's command line names it (-isystem, -L),
    and ninja rebuilds when the command changes, so two virtual environments sharing the cache would
    otherwise rebuild each other's kernel (~30 s on 2 cores) every time they took turns."""
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    key = f"{platform.machine()} {flags} {torch.__version__} {os.path.dirname(torch.__file__)} {source}"
    return f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build(prefix: str, source: str, what: str, fakes: dict[str, Callable] | None = None) -> bool:
    """Build (first call in a process: ~30 s, then cached on disk) and load `source`, which registers its
    operators with TORCH_LIBRARY; then register each operator's shape function from `fakes` ("lib::op" ->
    fn), so torch.compile can trace a call without running it. False, with one warning naming `what`,
    where it cannot be built; False without a warning where MT_NATIVE_KERNELS=0 asks for the references."""
    if prefix in _built:
        return _built[prefix]
    ok = False
    if os.environ.get("MT_NATIVE_KERNELS", "1") != "0" and platform.system() == "Linux":
        try:
            from torch.utils.cpp_extension import load_inline

            load_inline(_build_name(prefix, source), cpp_sources=[source], extra_cflags=["-O3", "-march=native"],
                        is_python_module=False, verbose=False)
            ok = True
        except Exception as error:  # noqa: BLE001 - any build failure means: use the reference
            warnings.warn(f"the {what} C++ kernel could not be built ({error}); using the PyTorch reference",
                          stacklevel=3)
    if ok:
        for name, shape in (fakes or {}).items():
            torch.library.register_fake(name)(shape)
    _built[prefix] = ok
    return ok
