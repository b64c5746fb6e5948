"""Text to train on, and batches cut from it.

Three sources: `shakespeare` (tiny shakespeare, read from a cache directory or downloaded once and
checked by sha256), `pydoc` (the English help text that ships with every CPython: always offline) and
any text file path. The token stream is split 90/10 into train/val; batches are random windows
drawn with a seeded generator, so a run (and a resumed run) sees exactly the same batches.
"""

from __future__ import annotations

import hashlib
import os
import sys
import urllib.request
from pathlib import Path

import torch

from .._checks import path_like, probability

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_FILE = "tinyshakespeare.txt"
DATASETS = ("shakespeare", "pydoc")
DOWNLOAD_TIMEOUT_S = 15


class DatasetUnavailable(RuntimeError):
    """A named dataset is neither in the cache nor downloadable right now."""


def cache_dir() -> Path:
    """`$MINI_TRANSFORMER_CACHE`, else `~/.cache/mini-transformer`."""
    env = os.environ.get("MINI_TRANSFORMER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mini-transformer"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def text_sha256(text: str) -> str:
    """The sha256 of the text's UTF-8 bytes: what a run records, so a resumed run knows its data."""
    return _sha256(text.encode("utf-8"))


def _fetch(url: str) -> bytes:
    """Download `url` (the only network access in the project). Tests replace this function."""
    if os.environ.get("MINI_TRANSFORMER_OFFLINE"):
        raise OSError("downloads are disabled by MINI_TRANSFORMER_OFFLINE")
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
        return response.read()


def shakespeare_text() -> str:
    """Tiny shakespeare (1,115,394 characters): from the cache if its sha256 matches, else downloaded,
    checked and cached. Raises DatasetUnavailable when neither works."""
    path = cache_dir() / SHAKESPEARE_FILE
    if path.is_file():
        data = path.read_bytes()
        if _sha256(data) == SHAKESPEARE_SHA256:
            return data.decode("utf-8")
    try:
        data = _fetch(SHAKESPEARE_URL)
    except OSError as err:  # URLError, timeouts and refused connections are all OSErrors
        raise DatasetUnavailable(f"tiny shakespeare is not in {path} and could not be downloaded ({err})") from err
    digest = _sha256(data)
    if digest != SHAKESPEARE_SHA256:
        raise DatasetUnavailable(
            f"the download from {SHAKESPEARE_URL} has sha256 {digest}, expected {SHAKESPEARE_SHA256}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a reader never sees half a file
    return data.decode("utf-8")


def pydoc_text() -> str:
    """The documentation topics bundled with CPython (about 465k characters of English)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def load_text(source: str | os.PathLike | None = None) -> tuple[str, str]:
    """-> (text, name). `source`: 'shakespeare', 'pydoc', a file path, or None for shakespeare with a
    one-line fallback to pydoc when shakespeare cannot be had (so the first command always works)."""
    if source is None:
        try:
            return shakespeare_text(), "shakespeare"
        except DatasetUnavailable as err:
            print(f"{err}; training on the offline 'pydoc' corpus instead", file=sys.stderr)
            return pydoc_text(), "pydoc"
    path_like("data", source, "a dataset name or a file path")
    if source == "shakespeare":
        return shakespeare_text(), "shakespeare"
    if source == "pydoc":
        return pydoc_text(), "pydoc"
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"data={str(source)!r} is neither a dataset ({', '.join(DATASETS)}) nor an existing file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"data={str(source)!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}); convert it to UTF-8 first") from None
    if not text:
        raise ValueError(f"data={str(source)!r} is an empty file")
    return text, str(path.resolve())  # the name a resumed run reads it by, from any working directory


def split_tokens(ids: torch.Tensor, block_size: int, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """First 90% of the stream for training, last 10% for validation. Each part needs block_size + 1
    tokens: one window of inputs plus the target of its last position."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D token stream, got shape {tuple(ids.shape)}")
    probability("val_fraction", val_fraction, zero=False, one=False)
    n_train = int(len(ids) * (1.0 - val_fraction))
    train, val = ids[:n_train], ids[n_train:]
    need = block_size + 1
    if len(train) < need or len(val) < need:
        raise ValueError(
            f"the text has {len(ids)} tokens: {len(train)} for training and {len(val)} for validation, but each "
            f"part needs at least block_size + 1 = {need}; use a longer text or a smaller block_size"
        )
    return train, val


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    block_size: int,
    generator: torch.Generator,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: x = data[i : i+T], y = data[i+1 : i+T+1] (the same text shifted by one token).

    Every rank draws the offsets of the whole global batch (world_size * batch_size) from the same
    seeded generator and keeps its own slice, so N ranks with batch B see exactly the batch that one
    process with batch N*B sees. Returns x, y of shape (B, T).
    """
    n_windows = len(data) - block_size  # valid start offsets: 0 .. len - T - 1
    if n_windows < 1:
        raise ValueError(f"data has {len(data)} tokens; a batch needs at least block_size + 1 = {block_size + 1}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    starts = torch.randint(n_windows, (world_size * batch_size,), generator=generator)
    starts = starts[rank * batch_size : (rank + 1) * batch_size]  # (B,)
    offsets = starts[:, None] + torch.arange(block_size + 1)  # (B, T + 1)
    window = data[offsets]  # (B, T + 1)
    return window[:, :-1], window[:, 1:]  # (B, T), (B, T)
