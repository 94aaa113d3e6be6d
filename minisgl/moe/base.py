"""The interface every mixture-of-experts backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BaseMoeBackend(ABC):
    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
    ) -> torch.Tensor:
        """The sparse MLP of one layer.

        x (T, H) are the tokens, router_logits (T, E) the router's scores of each expert. w13 (E, 2*I, H)
        holds each expert's gate (rows [0, I)) and up (rows [I, 2I)) projections, w2 (E, H, I) its down
        projection. Each token goes to its `top_k` most likely experts (softmax over the router logits),
        weighted by their probabilities, renormalised to sum to 1 when `renormalize`. Returns (T, H) in
        x's dtype.
        """
