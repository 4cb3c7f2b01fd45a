"""Oracle: evicts by true future utility, the upper bound every policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting


@dataclass
class Oracle(Policy):
    """Keeps the tokens that the full-cache run will attend to most over the next ``horizon`` steps.

    Score of a token at position p when the newest token is at position t: the attention it receives from the
    queries at positions t+1 .. t+horizon in a full-cache run of the same sequence (group mean, summed). This is
    the label the learned scorer is trained on, so the oracle is its ceiling on that objective; over a thousand
    decode steps tokens go quiet for longer than 32 steps and return, and there a longer horizon than the labels'
    keeps the better output (docs/long-chain.md, "The long table"). It needs the future: `generate`
    first decodes with the full cache (or is handed that run's attention, as the fidelity task's reference holds
    it), then replays the same tokens (teacher forcing) under the budget with this policy.
    Compared across heads and layers (``allocation=head|global``) its scores are ``mass``
    (`learnkv.allocation.normalisation_for`): each head's divided by its live total. With ``utility="output"``
    they are ``raw``: each token's future mass is weighted by what dropping it would move the residual stream
    (below), a scale every layer and head shares; with ``utility="fisher"`` too: the score is then the cost itself,
    in nats of KL to each future step's next-token distribution.

    Parameters
    ----------
    horizon : int
        H, steps of future that count.
    utility : str
        ``"attention"``: the future attention mass. ``"output"``: that mass times the size of the token's share of
        the head's output in the residual stream, ``||W_o (v_i - o)||`` (CAOTE's attention-output error, Goel et
        al., https://arxiv.org/abs/2504.14051, with the future mass for the attention weight): dropping token i
        from a head whose output is ``o`` moves it by ``p_i (o - v_i) / (1 - p_i)``, and ``W_o`` (the head's
        slice of the layer's output projection) carries that into the residual stream, which every layer adds
        to directly, so one scale serves every layer and head. ``o`` is the future-mass-weighted mean of the
        head's live values, and the norm is the root mean square over the query heads sharing the KV head.
        ``"fisher"``: the second-order KL cost of dropping the token, summed over the horizon's steps
        (`learnkv.fisher`: through everything above the layer at each step, the later layers' included, with
        the full-cache run's attention at each step; 8 sampled tokens per step, seed 0), the decode computing it
        from the full-cache run before the replay (`future_kind`).
    """

    name = "oracle"
    pooling = "mean_mass"  # future attention mass: comparable across layers and heads
    needs_attention = False
    needs_future = True
    horizon: int = setting(32, ge=1)
    utility: str = setting("attention", choices=("attention", "output", "fisher"))
    #: per row of the batch, `step_attention` of its prompt and continuation (per layer ``[H, steps, keys]``; its
    #: first query row is at position keys - steps, the prompt length)
    future: list | None = field(default=None, repr=False, compare=False)
    #: with ``utility="output"``, per layer ``[H, D, D]``: the mean over each KV head's query heads of
    #: ``W_o,g^T W_o,g`` (`output_grams`), so ``u^T M u`` is the mean squared residual-stream norm of ``W_o,g u``
    out_grams: list | None = field(default=None, repr=False, compare=False)

    @property
    def normalisation(self) -> str | None:
        return "raw" if self.utility in ("output", "fisher") else None

    @property
    def future_kind(self) -> str:  # the Fisher utility is its own future; the other utilities read attention
        return "fisher" if self.utility == "fisher" else "attention"

    def params(self) -> dict:
        out = {"n_sink": self.n_sink, "n_recent": self.n_recent, "horizon": self.horizon}
        return out | ({"utility": self.utility} if self.utility != "attention" else {})

    def with_future(self, future: list[list[Tensor]], model=None) -> "Oracle":
        """A copy that looks ahead at ``future``: per row, `step_attention` of that row's unpadded prompt and the
        continuation it replays (`future_kind`: attention, or the Fisher utility). ``utility="output"`` also reads
        the output projections of ``model``."""
        clone = replace(self, future=list(future), out_grams=None)  # every setting carried, block_size included
        if self.utility == "output":
            if model is None:
                raise ValueError("oracle utility 'output' needs the model's output projections: pass the model")
            clone.out_grams = output_grams(model)
        return clone

    def score(self, view: LayerView) -> Tensor:
        if self.future is None:
            raise ValueError("the oracle needs future attention: run it through learnkv.generate(policy='oracle', ...)")
        if len(self.future) != view.positions.shape[0]:
            raise ValueError(f"future attention for {len(self.future)} rows, a batch of {view.positions.shape[0]}")
        pos = view.positions.clamp(min=0)
        scores = torch.empty(view.positions.shape, dtype=torch.float32, device=pos.device)
        for b in range(pos.shape[0]):
            attn = self.future[b][view.layer]  # [H, steps, keys]: query rows from the prompt's end on
            start = attn.shape[-1] - attn.shape[-2]  # the prompt length: keys = prompt + steps
            t = int(view.positions[b].max())
            first = t + 1 - start
            if first < 0:
                raise ValueError(f"the oracle holds no future before position {start} (row {b}), "
                                 f"asked at newest position {t}")
            future_mass = attn[:, first : first + self.horizon, :].float().sum(dim=1)  # [H, keys]
            # past the row's own continuation (a row of the batch that has finished) nothing is ahead: score 0
            short = int(pos[b].max()) + 1 - future_mass.shape[-1]
            if short > 0:
                future_mass = torch.nn.functional.pad(future_mass, (0, short))
            scores[b] = future_mass.to(pos.device).gather(-1, pos[b])
        if self.utility == "output":
            scores = scores * self._output_error(view, scores)
        return scores

    def _output_error(self, view: LayerView, mass: Tensor) -> Tensor:
        """``[B, H, T]``: ``||W_o (v_i - o)||`` per slot (root mean square over the KV head's query heads), ``o``
        the head's live values averaged with their future ``mass`` as weights: its output over the horizon as far
        as the oracle sees it (dead and padding slots weigh nothing)."""
        if self.out_grams is None:
            raise ValueError("oracle utility 'output' needs the model's output projections (with_future(..., model))")
        weight = mass * (view.positions >= 0)
        values = view.values.float()  # [B, H, T, D]
        out = (weight[..., None] * values).sum(-2) / weight.sum(-1, keepdim=True).clamp(min=1e-12)  # [B, H, D]
        u = values - out[:, :, None, :]
        gram = self.out_grams[view.layer].to(u.device)  # [H, D, D]
        sq = torch.einsum("bhtd,hde,bhte->bht", u, gram, u)
        return sq.clamp(min=0).sqrt()


def output_grams(model) -> list[Tensor]:
    """Per decoder layer ``[H, D, D]`` fp32: ``mean_g W_g^T W_g`` over the query heads g of each KV head, ``W_g``
    the columns of the layer's attention output projection (``self_attn.o_proj``) that head g's output meets.
    Refuses a model without one such projection per layer."""
    cfg = model.config
    projections = [m for name, m in model.named_modules() if name.endswith("self_attn.o_proj")]
    if len(projections) != cfg.num_hidden_layers:
        raise ValueError(f"oracle utility 'output' reads each layer's self_attn.o_proj; {type(model).__name__} has "
                         f"{len(projections)} for {cfg.num_hidden_layers} layers")
    Hq = cfg.num_attention_heads
    H = getattr(cfg, "num_key_value_heads", None) or Hq
    grams = []
    for proj in projections:
        w = proj.weight.detach().float()  # [hidden, Hq * D]
        D = w.shape[1] // Hq
        per_head = w.view(w.shape[0], Hq, D).permute(1, 2, 0)  # [Hq, D, hidden]
        g = per_head @ per_head.transpose(-1, -2)  # [Hq, D, D]
        grams.append(g.view(H, Hq // H, D, D).mean(1))  # query heads j*G .. j*G+G-1 share KV head j
    return grams
