"""ScorerModule: the LightningModule that trains a `Scorer` on traces.

What matters is *which tokens stay*, so the objective ranks tokens within each (row, KV head) group:

- a listwise loss (ListNet): cross-entropy between the softmax of the scores and the oracle's future utility
  (the label, normalised over the group, sharpened or flattened by ``temperature``);
- a top-budget membership loss: binary cross-entropy pushing the oracle's top ``membership_budget`` share above the
  current score boundary of the group and the rest below it (averaged over several shares when given several);
- optional distillation toward any mix of teachers (weights per teacher): listwise cross-entropy toward the softmax
  of each teacher's rank percentiles (ranks, because teacher scores live on unrelated scales, some infinite).

Validation reports budget recall at 10/25/50%: the share of the oracle's top-b tokens that the top-b by score keeps,
for the scorer and, on the same rows, for every teacher.

``objective="global"`` (for ``allocation=global``, `learnkv.allocation`) ranks every resident token of one decision
over all layers and KV heads together instead: the group is the decision (`learnkv.scorer.data.DecisionRows`), so
the scores are fitted up to one constant per decision, not per head, and compare across layers and heads as they
are (the ``raw`` rule). The label is first made a distribution per (layer, KV head) (`head_shares`): a token's
share of the future utility its head gives out over the horizon; with ``future_sum``, its share of the head's
future attention mass, each head's query count divided out. That is the ``mass`` rule the cache compares
attention-mass scores with, and the scale the oracle ranks on under ``global``: one unit of a head's future mass is
worth the same in every layer and head. Then the listwise loss runs over the pooled distribution, and the
membership loss at each of ``membership_budget``'s shares of the decision's TOTAL resident tokens (the pool's top
share, as `learnkv.allocation.allocate` keeps it, without its per-head floor). Validation adds
``val/global_recall@b``: the share of the pooled oracle's top-b (b of the decision's total) that the pooled top-b
by score keeps, and ``val/oracle_per_head/global_recall@b``, what every head keeping its own oracle top share (the
best a ``uniform`` split can do) keeps of it. Checkpoints are then chosen by ``val/global_recall@25``.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from learnkv.features import FEATURES
from learnkv.scorer.model import Scorer

BUDGETS = (0.1, 0.25, 0.5)
MONITOR = "val/recall@25"
OBJECTIVES = ("uniform", "global")


def monitor_for(objective: str) -> str:
    """The validation metric that picks the best checkpoint and stops training early."""
    return "val/global_recall@25" if objective == "global" else MONITOR


class TrainingDiverged(ValueError):
    """The loss became NaN or infinite: the run stops instead of exporting meaningless weights."""


def _masked_log_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    return torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).masked_fill(~mask, 0.0)


def listwise_loss(scores: Tensor, target: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    """ListNet cross-entropy; ``target`` >= 0 is normalised per group (``[..., T]``)."""
    t = target.clamp(min=0).masked_fill(~mask, 0.0) ** (1.0 / temperature)
    p = t / t.sum(-1, keepdim=True).clamp(min=1e-12)
    return -(p * _masked_log_softmax(scores, mask)).sum(-1).mean()


def rank_percentile(x: Tensor, mask: Tensor) -> Tensor:
    """Percentile rank in [0, 1] of each valid entry within its group (padding ranks lowest)."""
    x = torch.nan_to_num(x.float(), nan=float("-inf")).masked_fill(~mask, float("-inf"))
    ranks = x.argsort(-1).argsort(-1).float()
    n_pad = (~mask).sum(-1, keepdim=True)
    return ((ranks - n_pad) / (mask.sum(-1, keepdim=True) - 1).clamp(min=1)).clamp(min=0)


def topk_mask(x: Tensor, mask: Tensor, share: float) -> Tensor:
    """``[..., T]`` bool: the top ``share`` of the valid entries of each group (at least one)."""
    k = (mask.sum(-1) * share).round().clamp(min=1).long()  # [...]
    order = torch.nan_to_num(x.float(), nan=float("-inf")).masked_fill(~mask, float("-inf")).argsort(-1, descending=True)
    position = torch.empty_like(order).scatter_(-1, order, torch.arange(x.shape[-1], device=x.device).expand_as(order))
    return (position < k[..., None]) & mask


def budget_recall(scores: Tensor, label: Tensor, mask: Tensor, share: float) -> Tensor:
    """Mean over groups of |top-b(scores) ∩ top-b(label)| / b."""
    return _recall(topk_mask(scores, mask, share), topk_mask(label, mask, share))


def _recall(kept: Tensor, best: Tensor) -> Tensor:
    """Mean over groups of the share of ``best``'s tokens that ``kept`` holds (``[..., T]`` bool each)."""
    return ((kept & best).sum(-1).float() / best.sum(-1).clamp(min=1)).mean()


def membership_shares(budget: float | tuple[float, ...] | list[float]) -> tuple[float, ...]:
    """The membership budgets as a tuple (checkpoints before multi-budget membership saved one float)."""
    return tuple(budget) if isinstance(budget, (tuple, list)) else (float(budget),)


def membership_loss(scores: Tensor, label: Tensor, mask: Tensor, share: float) -> Tensor:
    """Binary cross-entropy pushing the label's top ``share`` of each group above the group's current keep boundary
    (the lowest score still inside the predicted top ``share``) and the rest below it."""
    target = topk_mask(label, mask, share).float()
    kept = topk_mask(scores.detach(), mask, share)
    boundary = scores.detach().masked_fill(~kept, float("inf")).amin(-1, keepdim=True)
    bce = F.binary_cross_entropy_with_logits(scores - boundary, target, weight=mask.float(), reduction="sum")
    return bce / mask.sum()


def head_shares(label: Tensor, mask: Tensor) -> Tensor:
    """``label`` made a distribution over each group's real tokens (``[..., T]``; 0 where the group has none):
    what the global objective pools, one scale for every layer and KV head (the ``mass`` rule)."""
    x = label.clamp(min=0).masked_fill(~mask, 0.0)
    return x / x.sum(-1, keepdim=True).clamp(min=1e-12)


def ranking_groups(scores: Tensor, label: Tensor, mask: Tensor, decisions: int | None = None):
    """(scores, target, mask) of the groups the losses rank: each (row, KV head) of ``[N, H, T]`` as given, or,
    with ``decisions`` (the global objective), every decision's rows pooled, ``[decisions, L x H x T]`` (rows
    decision-major, `learnkv.scorer.data.collate_decisions`), the target being `head_shares` of the label."""
    if decisions is None:
        return scores, label, mask
    return scores.reshape(decisions, -1), head_shares(label, mask).reshape(decisions, -1), mask.reshape(decisions, -1)


class ScorerModule(L.LightningModule):
    """Trains a `Scorer`; all hyperparameters are saved in the checkpoint."""

    def __init__(self, n_layers: int, hidden: int = 32, lr: float = 3e-3, weight_decay: float = 1e-4,
                 temperature: float = 1.0, membership_weight: float = 0.5,
                 membership_budget: float | tuple[float, ...] = (0.25,),
                 distill: dict[str, float] | None = None, teachers: tuple[str, ...] = (), content_dim: int = 0,
                 n_heads: int = 0, ignore_features: tuple[str, ...] = (), objective: str = "uniform"):
        super().__init__()
        self.save_hyperparameters()
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if objective == "global" and distill:
            raise ValueError("distillation ranks within a head (teacher scores share no scale across heads); "
                             "it does not combine with objective global: set distill to {}")
        self.scorer = Scorer(n_layers, hidden=hidden, content_dim=content_dim, n_heads=n_heads,
                             head_bias=objective == "global")
        if ignore_features:
            # an ignored feature's first-layer weights start at zero and get no gradient, so they stay exactly zero
            # (AdamW's decay of a zero is zero) and the exported scorer needs nothing new to ignore it
            read = torch.tensor([f not in ignore_features for f in FEATURES], dtype=torch.float32)
            with torch.no_grad():
                self.scorer.w1.mul_(read[None, :, None])
            self.scorer.w1.register_hook(lambda grad: grad * read[None, :, None].to(grad.device))
        self.teachers = tuple(teachers)
        unknown = set(distill or {}) - set(self.teachers)
        if unknown:
            raise ValueError(f"distillation weights for teachers not in the traces: {sorted(unknown)}")

    def forward(self, batch: dict) -> Tensor:
        return self.scorer(batch["features"], batch["layer"][:, None, None], batch.get("values"))  # [N, H, T]

    def _step(self, batch: dict, stage: str) -> Tensor:
        hp = self.hparams
        scores = self(batch)
        mask = batch["mask"]  # [N, H, T]
        label = batch["label"]
        pooled = hp.get("objective", "uniform") == "global"  # checkpoints before the setting trained per head
        groups = ranking_groups(scores, label, mask, batch["decisions"] if pooled else None)
        loss = listwise_loss(*groups, hp.temperature)
        logs = {f"{stage}/listwise": loss.detach()}
        if hp.membership_weight:
            shares = membership_shares(hp.membership_budget)
            member = sum(membership_loss(*groups, share) for share in shares) / len(shares)
            loss = loss + hp.membership_weight * member
            logs[f"{stage}/membership"] = member.detach()
        for name, weight in (hp.distill or {}).items():
            teacher = batch["teachers"][:, self.teachers.index(name)]
            term = listwise_loss(scores, torch.exp(rank_percentile(teacher, mask) / 0.1), mask)
            loss = loss + weight * term
            logs[f"{stage}/distill_{name}"] = term.detach()
        if not bool(torch.isfinite(loss)):
            raise TrainingDiverged(f"training diverged: {stage} loss is {loss.item()} at epoch {self.current_epoch}, "
                                   f"step {self.global_step} (train.lr={hp.lr}); lower train.lr and run again")
        logs[f"{stage}/loss"] = loss.detach()
        n = batch["decisions"] if pooled else batch["mask"].shape[0]
        if stage == "val":
            for b in BUDGETS:
                logs[f"val/recall@{round(b * 100)}"] = budget_recall(scores, label, mask, b)
                for t, name in enumerate(self.teachers):
                    logs[f"val/{name}/recall@{round(b * 100)}"] = budget_recall(batch["teachers"][:, t], label, mask, b)
                if pooled:
                    best = topk_mask(groups[1], groups[2], b)
                    logs[f"val/global_recall@{round(b * 100)}"] = _recall(topk_mask(groups[0], groups[2], b), best)
                    per_head = topk_mask(label, mask, b).reshape(n, -1)
                    logs[f"val/oracle_per_head/global_recall@{round(b * 100)}"] = _recall(per_head, best)
        self.log_dict(logs, on_step=False, on_epoch=True, batch_size=n, prog_bar=False)
        return loss

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    def on_train_start(self) -> None:
        # a resumed run restores the optimiser's state, learning rate included: the configured values win
        for optimizer in self.trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"], group["weight_decay"] = self.hparams.lr, self.hparams.weight_decay

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
