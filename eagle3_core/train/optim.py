"""The drafter's optimizer: AdamW, or Muon on the 2-D weights with AdamW on the rest, as one optimizer.

Muon (torch.optim.Muon) orthogonalises the update of a weight matrix; it is meant for the hidden layers'
matrices, not for vectors (the norms) nor for the output head, whose rows are per-token (Jordan et al. 2024,
and speculators' own split). On several ranks, or under FSDP, Muon is DistributedMuon (train/muon.py), which
orthogonalises each matrix on one rank instead of on every rank. Both optimizers sit behind one
`torch.optim.Optimizer`-shaped object, so the trainer sets one learning rate per step, and a checkpoint
saves and restores one state_dict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from eagle3_core.config import TrainConfig
from eagle3_core.train.muon import DistributedMuon

ADAMW_BETAS = (0.9, 0.95)
MUON_WEIGHT_DECAY = 0.1  # torch's and speculators' default for the Muon group
# 2-D weights that stay with AdamW: the (frozen) embedding and the output head
ADAMW_MATRICES = ("embed_tokens", "lm_head")


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's): trainable matrices other than the head go to Muon."""
    muon: list[nn.Parameter] = []
    adamw: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matrix = param.ndim == 2 and min(param.shape) > 1
        (muon if matrix and not name.startswith(ADAMW_MATRICES) else adamw).append(param)
    return muon, adamw


class Optimizers(torch.optim.Optimizer):
    """Several optimizers stepped together; their groups, state and state_dict read as one optimizer's."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        # deliberately no super().__init__: the groups and state are the parts' own (read through below)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for p in self.parts for g in p.param_groups]

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The parts' state_dicts with parameter indices numbered on from one part to the next."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for part in self.parts:
            sd = part.state_dict()
            state.update({offset + i: v for i, v in sd["state"].items()})
            for g in sd["param_groups"]:
                groups.append({**g, "params": [offset + i for i in g["params"]]})
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = list(state_dict["param_groups"])
        for part in self.parts:
            mine = groups[: len(part.param_groups)]
            groups = groups[len(part.param_groups) :]
            ids = [i for g in mine for i in g["params"]]
            first = min(ids) if ids else 0
            part.load_state_dict(
                {
                    "state": {i - first: state_dict["state"][i] for i in ids if i in state_dict["state"]},
                    "param_groups": [{**g, "params": [i - first for i in g["params"]]} for g in mine],
                }
            )


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return adamw([p for p in model.parameters() if p.requires_grad], cfg)
    muon, rest = muon_split(model)
    # match_rms_adamw scales Muon's update to AdamW's RMS, so one learning rate serves both groups
    settings: dict[str, Any] = {
        "lr": cfg.lr,
        "weight_decay": MUON_WEIGHT_DECAY,
        "adjust_lr_fn": "match_rms_adamw",
    }
    sharded = any(isinstance(p, DTensor) for p in muon)  # FSDP, even on one rank
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    orthogonal = (DistributedMuon if sharded or several else torch.optim.Muon)(muon, **settings)
    return Optimizers([orthogonal, adamw(rest, cfg)])


def adamw(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    # on a GPU the fused kernel: one pass over weights, gradients and moments instead of foreach's several;
    # elsewhere torch's default
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=ADAMW_BETAS, fused=fused or None
    )
