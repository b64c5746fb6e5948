"""Exercise (docs/09): the MoE router's top-k choice and the load-balancing loss.

Fill in `route` and `load_balancing_loss`, then grade them:

    uv run pytest exercises/test_ex09_moe_router.py
"""

from __future__ import annotations

import torch


def route(router_logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (N, E) -> (weights (N, k) float32, experts (N, k) int64): each token's k most likely experts.

    The softmax runs over ALL E experts first; the weights are those probabilities of the chosen k.
    With renormalize (Mixtral), the k weights are then divided by their sum so that they add up to 1.
    """
    # TODO 1: each token's probabilities over ALL experts (in float32), then its k most likely experts
    # TODO 2: renormalize if asked
    raise NotImplementedError("TODO: exercise ex09_moe_router, route")


def load_balancing_loss(router_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss for one layer, router_logits (N, E) -> a scalar:

        E * sum_e f_e * P_e,  f_e = share of the N*k (token, choice) slots that went to expert e (a count:
                                    no gradient flows through it),
                              P_e = mean over tokens of the router probability of expert e.

    It is 1 when both are uniform and grows when the router sends many tokens where it is also confident.
    """
    # TODO 3: the loss above: f counts what the router actually chose, P averages what it wanted
    raise NotImplementedError("TODO: exercise ex09_moe_router, load_balancing_loss")
