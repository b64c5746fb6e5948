"""Training on real text, stage 5 (docs 05).

  config.py   TrainConfig: every knob of a run, validated
  data.py     tiny shakespeare (download + sha256 + cache), the pydoc text, any local file; batches
  loop.py     train(): the loop (AdamW, warm-up + cosine, clipping, eval, DDP / FSDP2, autocast)
  io.py       the run directory: atomic checkpoints with a manifest, resume, loss.png
  runtime.py  device, autocast precision, joining and leaving the process group
"""

from .config import TrainConfig
from .loop import train

__all__ = ["TrainConfig", "train"]
