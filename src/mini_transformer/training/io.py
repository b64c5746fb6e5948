"""What a training run writes and reads back: checkpoints (atomically), the training state, the loss
curve and a few samples. Kept apart from train.py so the loop itself stays one screen of logic."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import torch

from .._checks import path_like
from ..checkpoint import (
    CHECKPOINT_NAMES,
    CONFIG_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    previous_dir,
    resolve_checkpoint_dir,
    verify_checkpoint,
    write_checkpoint,
    write_manifest,
)
from .config import TrainConfig

TRAIN_STATE_FILE = "train_state.pt"  # optimizer, step, RNG states, history: torch.load(weights_only=True)
TRAIN_CONFIG_FILE = "train_config.json"  # the same TrainConfig, for people to read
TMP_MARK = ".tmp-"  # a save in progress writes `.NAME.tmp-PID` first


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped before the bad update."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The TransformerLM inside DDP(...) and/or torch.compile(...)."""
    while isinstance(getattr(model, "module", getattr(model, "_orig_mod", None)), torch.nn.Module):
        model = getattr(model, "module", None) if hasattr(model, "module") else model._orig_mod
    return model


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_leftovers(run_dir: str | Path) -> list[Path]:
    """Delete what killed saves left in `run_dir`: `.NAME.tmp-PID` folders whose process is gone, and
    `.NAME.old` folders whose NAME is back in place. Returns what was removed."""
    run_dir = Path(run_dir)
    removed = []
    for name in CHECKPOINT_NAMES:
        old = previous_dir(run_dir / name)
        stale = [old] if old.is_dir() and (run_dir / name).is_dir() else []
        for tmp in run_dir.glob(f".{name}{TMP_MARK}*"):
            pid = tmp.name.rsplit(TMP_MARK, 1)[1]
            if pid.isdigit() and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
                stale.append(tmp)
        for leftover in stale:
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def fsync_path(path: Path) -> None:
    """Ask the OS to put a file, or a directory's list of names, on the disk now."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | Path, model: torch.nn.Module, tokenizer, state: dict) -> None:
    """Write a complete checkpoint directory: weights, config, tokenizer, training state, manifest.

    Everything goes to a temporary sibling directory first, which is then renamed into place, so a
    kill at any moment leaves either the previous checkpoint or the new one, never half of each. The
    manifest (sha256 of every file) is written last, and temporaries of earlier killed saves are removed.
    The files and the temporary directory are fsynced before the renames, and the parent directory after
    them: a power cut, not only a kill, then leaves one whole checkpoint.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    old = previous_dir(path)
    remove_leftovers(path.parent)
    shutil.rmtree(tmp, ignore_errors=True)
    model = unwrap(model)
    write_checkpoint(tmp, model.config, model.state_dict(), manifest=False)  # strips DDP/compile prefixes
    tokenizer.save(tmp, model_max_length=model.config.max_seq_len)
    torch.save(state, tmp / TRAIN_STATE_FILE)
    (tmp / TRAIN_CONFIG_FILE).write_text(json.dumps(state.get("train_config", {}), indent=2))
    write_manifest(tmp)  # last: the sha256 of every file above
    for file in sorted(tmp.iterdir()):  # on the disk before the renames make them the checkpoint
        fsync_path(file)
    fsync_path(tmp)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)  # two renames: between them only `.old` exists, and loaders use it
    os.replace(tmp, path)
    fsync_path(path.parent)  # the renames themselves
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint path or a run directory (-> its `last/`, or `best/` when a
    kill came before the first `last/` was written), verified against its manifest.

    If a kill fell between the two renames of `save_checkpoint`, the previous checkpoint is still
    there under its `.old` name and is used."""
    path_like("resume", path, "a run or checkpoint directory path")
    # last, then best; silent, because a damaged checkpoint's error must stay the one line on stderr
    candidate = resolve_checkpoint_dir(path, run_checkpoints=CHECKPOINT_NAMES[::-1], say=False)
    if any((candidate / name).is_file() for name in (TRAIN_STATE_FILE, MANIFEST_NAME, WEIGHTS_NAME)):
        verify_checkpoint(candidate)
        return candidate
    raise ValueError(
        f"resume={str(path)!r} holds no training checkpoint; expected a directory with {TRAIN_STATE_FILE}, "
        f"{WEIGHTS_NAME} and {CONFIG_NAME} (or a run directory containing last/)"
    )


END_OF_RUN_FILES = ("loss.png", "samples.txt")


def prepare_out_dir(out_dir: str | Path, *, fresh: bool, overwrite: bool) -> None:
    """Before the first step: refuse to replace an existing run unless `overwrite`, make sure the
    directory can be written, and clear what killed saves left behind."""
    out_dir = Path(out_dir)
    existing = [f"{name}/" for name in CHECKPOINT_NAMES if resolve_checkpoint_dir(out_dir / name).is_dir()]
    if fresh and existing and not overwrite:
        raise ValueError(f"out_dir={str(out_dir)!r} already holds a run ({', '.join(existing)}); continue it with "
                         f"--resume {out_dir} (resume=...), or replace it with --overwrite (overwrite=True)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"out_dir={str(out_dir)!r} cannot be written ({err.strerror or err})") from None
    if fresh and overwrite:  # nothing of the old run may survive to be mistaken for the new one's
        for name in CHECKPOINT_NAMES:
            for folder in (out_dir / name, previous_dir(out_dir / name)):
                shutil.rmtree(folder, ignore_errors=True)
        for name in END_OF_RUN_FILES:
            (out_dir / name).unlink(missing_ok=True)
    remove_leftovers(out_dir)


def load_train_state(path: str | Path) -> dict:
    """The training state saved next to the weights; tensors and plain Python values only."""
    file = Path(path) / TRAIN_STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; this checkpoint holds weights only and cannot be resumed")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as err:
        raise CheckpointError(f"{file} cannot be read ({type(err).__name__}: {err})") from None


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
    from ..inference.generate import generate_long

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


def check_same_data(state: dict, data_sha256: str, data_name: str, ckpt: Path, allow_change: bool) -> None:
    """A resumed run trains on the text its checkpoint recorded (by sha256), unless `allow_change`, which
    continues on the new text with a warning. A checkpoint that recorded no hash has nothing to compare."""
    saved = state.get("data_sha256")
    if saved is None or saved == data_sha256:
        return
    change = (f"the training data {data_name} has sha256 {data_sha256}, but the run in {ckpt} was trained on "
              f"{state['data_name']} with sha256 {saved}")
    if not allow_change:
        raise ValueError(f"{change}; pass --allow-data-change (allow_data_change=True) to continue on the new data")
    print(f"warning: {change}; continuing on the new data", file=sys.stderr)


def check_resumable(cfg: TrainConfig, state: dict, ckpt: Path) -> None:
    """The tokenizer is fixed by the checkpoint, and there must be steps (or end-of-run files) left."""
    saved = state["train_config"]
    names = ("tokenizer", "bpe_vocab_size") if saved.get("tokenizer") == "bpe" else ("tokenizer",)
    for name in names:
        if getattr(cfg, name) != saved.get(name):
            raise ValueError(f"{name}={getattr(cfg, name)!r}, but the run in {ckpt} was trained with "
                             f"{saved.get(name)!r}; a resumed run keeps its tokenizer (leave the option out)")
    step, out_dir = state["step"], Path(cfg.out_dir)
    end_files = END_OF_RUN_FILES if cfg.num_samples > 0 else END_OF_RUN_FILES[:1]  # loss.png [, samples.txt]
    finished = all((out_dir / name).is_file() for name in end_files)
    if step > cfg.max_steps or (step == cfg.max_steps and finished):
        raise ValueError(f"the checkpoint {ckpt} is at step {step}; max_steps={cfg.max_steps} "
                         f"leaves nothing to train (raise max_steps)")
