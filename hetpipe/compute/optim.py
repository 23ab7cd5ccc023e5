"""The local optimizer of a stage: SGD, SGD with momentum, Adam.

On CUDA these are torch.optim's (their multi-tensor kernels). On the CPU they are the same updates written
out here, operation for operation as torch.optim's single-tensor code (what it runs on the CPU, so results
are identical bit for bit; tests/test_optim.py checks it), because constructing or stepping a torch.optim
optimizer imports torch._dynamo, about 1.2 s of every stage process's start on this kind of machine.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["LocalOptimizer", "current_lr", "make_optimizer", "predicted_step", "set_lr"]


class LocalOptimizer:
    """torch.optim's SGD (with momentum) and Adam updates for CPU parameters, without torch.optim."""

    def __init__(
        self,
        params: list[nn.Parameter],
        name: str,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if name not in ("sgd", "momentum", "adam"):
            raise ValueError(f"unknown optimizer {name!r}: use sgd, momentum or adam")
        self.params = params
        self.name, self.lr, self.weight_decay = name, lr, weight_decay
        self.momentum = momentum if name == "momentum" else 0.0
        self.betas, self.eps = betas, eps
        self.state: dict[int, dict[str, Any]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's shape: {"state": {param index: {name: tensor}}, "param_groups": [...]} (what a
        checkpoint of the stage keeps; the settings come from the config)."""
        return {"state": self.state, "param_groups": [{"params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = {
            int(i): {
                name: t.detach().clone().to(self.params[int(i)].device if t.dim() else "cpu")
                for name, t in entry.items()
            }
            for i, entry in state_dict["state"].items()
        }

    @torch.no_grad()
    def step(self) -> None:
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            if self.name == "adam":
                self._adam(i, param, param.grad)
            else:
                self._sgd(i, param, param.grad)

    def _sgd(self, i: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        if self.weight_decay != 0:
            grad = grad.add(param, alpha=self.weight_decay)
        if self.momentum != 0:
            state = self.state.setdefault(i, {})
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = torch.clone(grad).detach()
            else:
                buf.mul_(self.momentum).add_(grad, alpha=1)
            grad = buf
        param.add_(grad, alpha=-self.lr)

    def _adam(self, i: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state.get(i)
        if state is None:
            state = self.state[i] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param),
            }
        beta1, beta2 = self.betas
        step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
        step_t += 1
        if self.weight_decay != 0:
            grad = grad.add(param, alpha=self.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = step_t.item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = self.lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def make_optimizer(params: list[nn.Parameter], name: str, lr: float, momentum: float, weight_decay: float):
    """The local optimizer of a stage: sgd, momentum (SGD with momentum) or adam; None without parameters."""
    if not params:
        return None
    if name not in ("sgd", "momentum", "adam"):
        raise ValueError(f"unknown optimizer {name!r}: use sgd, momentum or adam")
    if params[0].device.type == "cpu":
        return LocalOptimizer(params, name, lr, momentum, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of the next step (LocalOptimizer or a torch.optim optimizer)."""
    if isinstance(optimizer, LocalOptimizer):
        optimizer.lr = lr
    else:
        for group in optimizer.param_groups:
            group["lr"] = lr


def current_lr(optimizer) -> float:
    return optimizer.lr if isinstance(optimizer, LocalOptimizer) else optimizer.param_groups[0]["lr"]


@torch.no_grad()
def predicted_step(optimizer, index: int, param: torch.Tensor) -> torch.Tensor | None:
    """The optimizer's own estimate of its next step for parameter `index` (new - old weights), from its
    state: momentum -lr * buffer (SpecTrain), Adam -lr * m_hat / (sqrt(v_hat) + eps) (XPipe); None without
    state (plain SGD, or before the first step). Weight decay is left out."""
    if isinstance(optimizer, LocalOptimizer):
        name, lr, state = optimizer.name, optimizer.lr, optimizer.state.get(index)
        beta1, beta2, eps = *optimizer.betas, optimizer.eps
    else:
        group = optimizer.param_groups[0]
        name = "adam" if "betas" in group else ("momentum" if group.get("momentum") else "sgd")
        lr, state = group["lr"], optimizer.state.get(param)
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        eps = group.get("eps", 1e-8)
    if not state:
        return None
    if name == "momentum":
        buf = state.get("momentum_buffer")
        return None if buf is None else buf * -lr
    if name == "adam":
        step = float(state["step"])
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        denom = (state["exp_avg_sq"].sqrt() / bias_correction2**0.5).add_(eps)
        return state["exp_avg"] / denom * (-lr / bias_correction1)
    return None
