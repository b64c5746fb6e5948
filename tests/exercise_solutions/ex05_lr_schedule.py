"""Exercise answered by the project's own code: train.lr_at."""

from mini_transformer.training.config import TrainConfig
from mini_transformer.training.optim import lr_at as project_lr_at


def lr_at(step, lr_max, lr_min, warmup, decay_steps):
    cfg = TrainConfig(lr=lr_max, min_lr=lr_min, warmup_steps=warmup, lr_decay_steps=decay_steps,
                      max_steps=decay_steps)
    return project_lr_at(step, cfg)
