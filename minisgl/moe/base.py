"""The interface every mixture-of-experts backend implements: one function of the layer's tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from torch import Tensor

# forward(x, router_logits, w13, w2, top_k, renormalize) -> out; see `BaseMoeBackend.forward`
MoeFunction = Callable[[Tensor, Tensor, Tensor, Tensor, int, bool], Tensor]


class BaseMoeBackend(ABC):
    """A backend is its `forward` function: subclasses set it to a plain function of the same arguments
    (`forward = staticmethod(fn)`), which can also be called, or compiled, without the object.
    `graph_capturable`: the function reads nothing on the host, so CUDA graphs can capture it."""

    graph_capturable: bool = False

    @abstractmethod
    def forward(
        self, x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, renormalize: bool
    ) -> Tensor:
        """The sparse MLP of one layer.

        x (T, H) are the tokens, router_logits (T, E) the router's scores of each expert. w13 (E, 2*I, H)
        holds each expert's gate (rows [0, I)) and up (rows [I, 2I)) projections, w2 (E, H, I) its down
        projection. Each token goes to its `top_k` most likely experts (softmax over the router logits),
        weighted by their probabilities, renormalised to sum to 1 when `renormalize`. Returns (T, H) in
        x's dtype. w13 and w2 may also be 4- or 8-bit (`minisgl.kernels.packed.PackedWeights`, both).
        """
