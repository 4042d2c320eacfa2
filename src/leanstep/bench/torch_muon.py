"""The PyTorch peer's ``--optimizer muon``: the update of :mod:`leanstep.training.optimizers`, in torch.

Each block's matrix (the ``weight`` of the ``qkv``, ``proj``, ``fc`` and ``out`` linears) takes
optax's ``scale_by_muon`` (0.2.8) step: a momentum of 0.95 kept as optax keeps it (an exponential
average), Nesterov's look-ahead with optax's bias corrections, the Frobenius-normalized matrix
orthogonalized by five Newton-Schulz iterations (optax's coefficients; the iteration gives the
transpose's result on a transposed matrix, so torch's ``(out, in)`` weights need no transposing),
then decoupled weight decay, the whole times the scheduled rate times ``MUON_LEARNING_RATE / lr``.
Every other parameter takes torch's AdamW, as the peer's ``adamw`` does.
"""

from __future__ import annotations

from typing import Any

from leanstep.training.optimizers import MUON_LEARNING_RATE

__all__ = ["NS_COEFFICIENTS", "TorchMuon", "muon_matrices"]

#: optax's default Newton-Schulz coefficients (``optax.contrib._muon._DEFAULT_NS_COEFFS``).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_MATRICES = ("qkv.weight", "proj.weight", "fc.weight", "out.weight")


def muon_matrices(model: Any) -> tuple[list[Any], list[Any]]:
    """``(matrices, rest)``: the blocks' linear weights, which Muon trains, and every other parameter."""
    matrices: list[Any] = []
    rest: list[Any] = []
    for name, param in model.named_parameters():
        (matrices if name.startswith("blocks.") and name.endswith(_MATRICES) else rest).append(param)
    return matrices, rest


def _orthogonalized(torch: Any, x: Any, steps: int = 5, eps: float = 1e-8) -> Any:
    transposed = x.shape[0] > x.shape[1]
    x = x.T if transposed else x
    x = x / (torch.linalg.matrix_norm(x) + eps)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


class TorchMuon:
    """Muon over ``matrices`` (see the module doc): ``step(lr)`` after the gradients are in place.

    Args:
      torch: the torch module.
      matrices: the parameters, 2-D.
      lr: the run's ``--lr`` (the schedule's peak), which the scheduled rate is divided by.
      weight_decay: decoupled, as optax's ``add_decayed_weights``.
      beta: the momentum.
    """

    def __init__(self, torch: Any, matrices: list[Any], *, lr: float, weight_decay: float, beta: float = 0.95):
        self.torch, self.matrices, self.peak, self.weight_decay, self.beta = torch, matrices, lr, weight_decay, beta
        self.momenta = [torch.zeros_like(p) for p in matrices]
        self.count = 0

    def step(self, lr: float) -> None:
        torch, beta = self.torch, self.beta
        self.count += 1
        first, second = 1 - beta**self.count, 1 - beta ** (self.count + 1)
        rate = lr * MUON_LEARNING_RATE / self.peak
        with torch.no_grad():
            for param, momentum in zip(self.matrices, self.momenta):
                grad = param.grad
                momentum.mul_(beta).add_(grad, alpha=1 - beta)
                nesterov = beta * momentum / second + (1 - beta) * grad / first
                update = _orthogonalized(torch, nesterov) + self.weight_decay * param
                param.sub_(rate * update)
