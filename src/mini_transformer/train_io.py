"""What a training run writes and reads back: checkpoints (atomically), the training state, the loss
curve and a few samples. Kept apart from train.py so the loop itself stays one screen of logic."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .checkpoint import CONFIG_NAME, WEIGHTS_NAME, save_pretrained

TRAIN_STATE_FILE = "train_state.pt"  # optimizer, step, RNG states, history: torch.load(weights_only=True)
TRAIN_CONFIG_FILE = "train_config.json"  # the same TrainConfig, for people to read


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped before the bad update."""


def save_checkpoint(path: str | Path, model: torch.nn.Module, tokenizer, state: dict) -> None:
    """Write a complete checkpoint directory: weights, config, tokenizer, training state.

    Everything goes to a temporary sibling directory first, which is then renamed into place, so a
    kill at any moment leaves either the previous checkpoint or the new one, never half of each.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tmp)  # unwraps torch.compile and strips DDP/compile prefixes
    tokenizer.save(tmp)
    torch.save(state, tmp / TRAIN_STATE_FILE)
    (tmp / TRAIN_CONFIG_FILE).write_text(json.dumps(state.get("train_config", {}), indent=2))
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)  # two renames: between them only `.old` exists, and find_checkpoint uses it
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint path or a run directory (-> its `last/`).

    If a kill fell between the two renames of `save_checkpoint`, the previous checkpoint is still
    there under its `.old` name and is used."""
    path = Path(path)
    for candidate in (path, path / "last"):
        if (candidate / TRAIN_STATE_FILE).is_file():
            return candidate
        old = candidate.with_name(f".{candidate.name}.old")
        if not candidate.exists() and (old / TRAIN_STATE_FILE).is_file():
            return old
    raise ValueError(
        f"resume={str(path)!r} holds no training checkpoint; expected a directory with {TRAIN_STATE_FILE}, "
        f"{WEIGHTS_NAME} and {CONFIG_NAME} (or a run directory containing last/)"
    )


def load_train_state(path: str | Path) -> dict:
    """The training state saved next to the weights; tensors and plain Python values only."""
    return torch.load(Path(path) / TRAIN_STATE_FILE, map_location="cpu", weights_only=True)


def plot_losses(losses: list[float], evals: list[list[float]], path: str | Path) -> None:
    """Train loss of every step (light), its running mean, and train/val loss at each eval."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, safe in any process

    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss (step)")
    window = max(1, len(losses) // 50)
    smooth = torch.tensor(losses).unfold(0, window, 1).mean(dim=1).tolist() if len(losses) >= window else []
    ax.plot(range(window, len(losses) + 1), smooth, color="tab:blue", label=f"train loss (mean of {window})")
    if evals:
        ax.plot([e[0] for e in evals], [e[2] for e in evals], "o-", color="tab:orange", label="val loss (eval)")
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "s--", color="tab:green", label="train loss (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


@torch.no_grad()
def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, *, temperature: float = 0.8,
                generator: torch.Generator | None = None, device="cpu") -> str:
    """Sample a continuation with the KV cache; past the model's context the window slides (generate_long)."""
    from .generate import generate_long

    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long, device=device)  # (1, T)
    new = generate_long(model, ids, max_new_tokens, temperature=temperature, generator=generator)  # (1, N)
    return prompt + tokenizer.decode(new[0].tolist())


def finish_run(cfg, model, tokenizer, text: str, losses, evals, out_dir: Path, device) -> None:
    """The loss-curve PNG and a few samples, written next to the checkpoints."""
    plot_losses(losses, evals, out_dir / "loss.png")
    if cfg.num_samples == 0:
        return
    prompt = "\n" if "\n" in text else text[0]
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    samples = [sample_text(model, tokenizer, prompt, cfg.sample_tokens, generator=generator, device=device)
               for _ in range(cfg.num_samples)]
    (out_dir / "samples.txt").write_text("\n\n-----\n\n".join(samples), encoding="utf-8")
    if cfg.progress:
        print("\n-----\n".join(samples))
