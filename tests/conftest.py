import os
import subprocess
import sys
from pathlib import Path

# Small ops on 2 shared cores get much slower with threads; the Triton interpreter must be chosen
# before triton is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# What most processes the suite starts import: warmed once, so even the first of them finds its bytecode.
_WARM_IMPORTS = ("torch, torch._dynamo, torch.distributed.run, mini_transformer.cli, mini_transformer.training.loop, "
                 "mini_transformer.server, mini_transformer.engine")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """A C++ kernel test at 1 and at 2 torch threads (the suite's one thread would never split the kernel's
    work), the count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _shared_bytecode_cache(request, tmp_path_factory):
    """The suite starts ~100 Python processes (the README's commands, torchrun and spawned ranks, servers,
    schemathesis). Where Python may not write bytecode (PYTHONDONTWRITEBYTECODE=1) and the virtual
    environment holds none, each of them compiles torch's ~2,000 modules again: ~3 s of CPU per process,
    test_readme.py took 238 s instead of 135 s. So they share one bytecode cache (PYTHONPYCACHEPREFIX) kept in
    .pytest_cache. Python checks every cached file against its source's size and mtime, so nothing stale
    is ever run; what the processes compute is unchanged. `uv sync --compile-bytecode` makes this moot."""
    torch_dir = Path(torch.__file__).parent
    if not sys.flags.dont_write_bytecode or (torch_dir / "__pycache__").is_dir():
        yield
        return
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    prefix = cache.mkdir("pycache") if cache is not None else tmp_path_factory.mktemp("pycache")
    saved = {name: os.environ.get(name) for name in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE")
    # multiprocessing's spawned ranks inherit -B from this process: they read the cache but cannot fill it
    warmed = prefix / torch_dir.relative_to(torch_dir.anchor) / f"__init__.{sys.implementation.cache_tag}.pyc"
    if not warmed.is_file():
        subprocess.run([sys.executable, "-c", f"import {_WARM_IMPORTS}"], timeout=600, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
