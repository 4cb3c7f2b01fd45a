"""On-policy traces: decode under an acting policy at a budget, record what its cache holds, label from a branch.

A scorer trained on full-cache traces is deployed on caches that have already lost tokens, where attention
redistributes. Here the acting policy (any evicting policy, the learned one included) decides as it would when
deployed, and the `Riders` (feature tracker, teachers) ride along on its cache, so the recorded features and teacher
scores are those of the tokens actually resident. At a decision step, `OnPolicyRecorder` snapshots every layer's
resident state just before the acting policy evicts: the candidates of that decision, with their keys, values and
positions. After the decode, once its tokens are known, each snapshot is branched (`branch_labels`): a non-evicting
cache seeded with the snapshot is teacher-forced along the acting run's next ``horizon`` tokens, and what each
snapshot token receives there is its label (`learnkv.traces.record.step_labels`). Labels thus come only from the
future of that state, never from the full cache's, and never from a run that went on evicting.

Branches of many snapshots (several decision steps, several prompts) decode together as one left-padded batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from learnkv import attention
from learnkv.cache import BudgetCache
from learnkv.decode import forward, generate
from learnkv.memory import TRIM_EVERY, HeapTrim
from learnkv.policies.base import LayerView, Policy
from learnkv.traces.record import (Decision, Riders, Snapshot, add_labels, horizon_fits, label_keep, new_labels,
                                   resident, row_steps, step_labels, take_rows, teacher_view)


@dataclass
class _Log:
    """What every per-row copy of an `OnPolicyRecorder` shares (`generate` resolves one copy per row)."""

    riders: Riders
    snapshots: list[Snapshot] = field(default_factory=list)
    acting_view: tuple | None = None  # (the cache's view, the acting policy's view) of the latest update


@dataclass
class OnPolicyRecorder(Policy):
    """The acting policy evicts; the feature tracker and the teachers ride along; decision steps are snapshotted.

    Resolved for a budget, it takes the acting policy's protected windows, interval and block size, so the cache
    evicts exactly as it does for the acting policy alone (the acting policy's state lives under ``a.``).

    Parameters
    ----------
    acting : Policy
        An evicting policy that needs no future (not the oracle).
    n_layers : int
        Decoder layers of the model.
    teachers : tuple[str, ...]
        Registered policy names whose scores are recorded.
    decision_steps : frozenset[int] or sequence of them
        Decode steps at which to snapshot, for every row or per row of the batch.
    label_budget : float
        Share of the resident tokens that defines ``reenter`` and the teachers' ``keep``.
    """

    name = "onpolicy"
    group_reduce = "none"
    per_row_fields = ("n_sink", "n_recent", "interval", "acting")

    acting: Policy | None = None
    n_layers: int = 1
    teachers: tuple[str, ...] = ()
    decision_steps: frozenset | tuple = frozenset()
    label_budget: float = 0.25
    log: _Log | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.acting, Policy) or not self.acting.evicts or self.acting.needs_future:
            name = getattr(self.acting, "name", self.acting)
            raise ValueError(f"on-policy collection needs an evicting policy that decides on what it has seen, got "
                             f"{name!r} (use policy 'full' for full-cache traces; the oracle needs the future)")
        if self.log is None:
            self.log = _Log(Riders(self.n_layers, self.teachers, self.label_budget))

    # -- what the cache reads: the acting policy's ------------------------------------------------------------

    @property
    def obs_window(self) -> int:
        return 1 << 30  # every query row: the riders and the acting policy rebuild their views from them

    @property
    def needs_dense_slots(self) -> bool:
        return self.acting.needs_dense_slots

    @property
    def scores_prefill(self) -> bool:
        return self.acting.scores_prefill

    @property
    def refresh(self) -> int:
        return self.acting.refresh

    @property
    def pooling(self) -> str:
        return self.acting.pooling

    @property
    def normalisation(self) -> str | None:  # how the cache compares the acting policy's scores across heads
        return self.acting.normalisation

    def block_size_at(self, step: int) -> int:
        return self.acting.block_size_at(step)

    def keep_target(self, budget: int, steps_left: int | None = None) -> int:
        return self.acting.keep_target(budget, steps_left)

    def check_model(self, model) -> None:
        self.acting.check_model(model)

    def resolve(self, budget: int) -> "OnPolicyRecorder":
        acting = self.acting.resolve(budget)
        return dataclasses.replace(self, acting=acting, n_sink=acting.n_sink, n_recent=acting.n_recent,
                                   interval=acting.interval, block_size=acting.block_size)

    def params(self) -> dict:
        return {"acting": self.acting.name, **self.acting.params()}

    # -- the step ---------------------------------------------------------------------------------------------

    def update(self, view: LayerView) -> None:
        log, st = self.log, view.state
        log.riders.update(view)
        sub = {k[2:]: v for k, v in st.items() if k.startswith("a.")}
        acting_view = teacher_view(view, self.acting, sub, view.keep)
        self.acting.update(acting_view)
        for k, v in sub.items():
            st["a." + k] = v
        log.acting_view = (view, acting_view)
        rows = [b for b, steps in enumerate(row_steps(self.decision_steps, view.positions.shape[0]))
                if view.step in steps]
        if rows:
            snap = log.riders.snapshot(view, rows)
            evicts = [k < n for k, n in zip(view.keep_rows(), view.live_tokens())]
            snap.values, snap.keys = take_rows(view.values, rows), take_rows(view.keys, rows)
            snap.evicts = [evicts[b] for b in rows]
            log.snapshots.append(snap)

    def score(self, view: LayerView) -> Tensor:
        seen, acting_view = self.log.acting_view
        if seen is not view:
            raise RuntimeError("OnPolicyRecorder.score must follow update of the same view")
        return self.acting.score(acting_view)


@dataclass
class _BranchLabels(Policy):
    """Non-evicting observer of a branch: accumulates the labels of the ``n_seed`` seeded slots of every layer."""

    name = "branch"
    evicts = False
    group_reduce = "none"
    n_seed: int = 0
    label_budget: float = 0.25
    labels: dict = field(default_factory=dict, compare=False, repr=False)  # layer -> name -> [R, H, n_seed]

    def update(self, view: LayerView) -> None:
        if view.step == 0:
            return
        step = step_labels(view.attn[:, :, :, -1, :], view.values, label_keep(view.live_tokens(), self.label_budget))
        acc = self.labels.setdefault(view.layer, new_labels((*view.positions.shape[:2], self.n_seed), view.keys.device))
        add_labels(acc, step, self.n_seed)


@dataclass
class BranchItem:
    """One decision of one row to branch: the row's snapshot of every layer, and the tokens that follow it."""

    row: int
    snapshots: list[Snapshot]  # one per layer, in layer order
    tokens: Tensor  # [horizon] the acting run's tokens fed after the decision
    start: int  # position of the first of them


@torch.no_grad()
def branch_labels(model, items: list[BranchItem], label_budget: float) -> list[list[dict[str, Tensor]]]:
    """Per item and layer, the labels (name -> ``[H, n]``, in resident-slot order) of the snapshot's tokens, from a
    non-evicting continuation of the snapshot along ``item.tokens``, all items in one left-padded batch."""
    attention.install(model)
    R, n_layers = len(items), len(items[0].snapshots)
    horizon = items[0].tokens.shape[0]
    at = [it.snapshots[0].index(it.row) for it in items]  # each item's row in its snapshots (the same per layer)
    valid = [[s.positions[i] >= 0 for s in it.snapshots] for i, it in zip(at, items)]  # [item][layer] [H, T]
    # resident tokens per layer and item: the most any head holds (a sliding layer of a hybrid model holds fewer;
    # under the head and global allocations the heads differ, and `resident` pads the others with dead slots)
    n_at = [[int(v[layer].sum(-1).max()) for v in valid] for layer in range(n_layers)]
    n = [max(col) for col in zip(*n_at)]  # per item: the slots every layer gets (left-padded with dead slots)
    n_max = max(n)
    observer = _BranchLabels(n_seed=n_max, label_budget=label_budget)
    # slack past every slot: a sliding layer's tokens that age out are marked dead in place, never compacted, so the
    # seeded slots keep their indices (the observer's labels) and an aged-out token's labels stay 0
    cache = BudgetCache(n_layers, observer, None, last_step=horizon, slack=n_max + horizon)
    device = next(model.parameters()).device
    cache.begin_step(torch.full((R, n_max), -1, dtype=torch.long, device=device), n)
    for layer in range(n_layers):
        k0 = items[0].snapshots[layer].keys
        H, D = k0.shape[1], k0.shape[-1]
        keys = k0.new_zeros(R, H, n_max, D)
        values = items[0].snapshots[layer].values.new_zeros(R, H, n_max, items[0].snapshots[layer].values.shape[-1])
        positions = torch.full((R, H, n_max), -1, dtype=torch.long, device=device)
        for i, it in enumerate(items):
            snap, ok, m = it.snapshots[layer], valid[i][layer], n_at[layer][i]
            keys[i, :, n_max - m:] = resident(snap.keys[at[i]], ok)
            values[i, :, n_max - m:] = resident(snap.values[at[i]], ok)
            positions[i, :, n_max - m:] = resident(snap.positions[at[i]], ok, -1)
        cache.layers[layer].update(keys, values)
        cache.layers[layer].positions.copy_(positions)  # per KV head (the append wrote one row of positions per row)
        # counted from the positions: the widest head's (n_at), and whether the heads hold as many (`heads_alike`)
        cache.layers[layer].live = cache.layers[layer].count_live()
    cache.end_step()
    tokens = torch.stack([it.tokens for it in items]).to(device)
    start = torch.tensor([it.start for it in items], device=device)
    trim = HeapTrim()
    for s in range(horizon):
        if s % TRIM_EVERY == 0:
            trim()  # as the decode loop does (learnkv.memory)
        forward(model, cache, tokens[:, s:s + 1], (start + s)[:, None], [1] * R)
    return [[{k: v[i, :, n_max - n_at[layer][i]:].cpu() for k, v in observer.labels[layer].items()}
             for layer in range(n_layers)] for i in range(R)]


def record(model, tokenizer, texts: list[str], acting: Policy, budgets: list[int], decision_steps: list[frozenset],
           teachers: tuple[str, ...], horizon: int, label_budget: float, max_new_tokens: int, chat: bool = True,
           branch_batch: int = 16, record_values: bool = False,
           reply_prefixes: list[str | None] | None = None, on_step=None, allocation="uniform"):
    """Decode ``texts`` (one batch) under ``acting`` at per-row ``budgets`` (tokens), shared by layers and KV heads
    as ``allocation`` says (`learnkv.allocation`), snapshot the decision steps and branch them. Returns (per row:
    its `Decision` list in (step, layer) order, the `GenerationResult`).
    ``record_values``: also record each resident token's value vector (`Decision.values`); ``reply_prefixes`` as
    in `learnkv.decode.encode_prompts`; ``on_step`` as in `learnkv.decode.generate` (the acting decode's steps)."""
    rec = OnPolicyRecorder(acting=acting, n_layers=model.config.num_hidden_layers, teachers=tuple(teachers),
                           decision_steps=tuple(decision_steps), label_budget=label_budget)
    result = generate(model, tokenizer, texts, policy=rec, budget=budgets, max_new_tokens=max_new_tokens, chat=chat,
                      reply_prefixes=reply_prefixes, on_step=on_step, allocation=allocation)
    by_step: dict[int, list[Snapshot]] = {}
    for snap in rec.log.snapshots:
        by_step.setdefault(snap.step, []).append(snap)
    items = []
    for step, snaps in sorted(by_step.items()):
        snaps = sorted(snaps, key=lambda s: s.layer)
        for row in snaps[0].rows:
            if horizon_fits(step, horizon, result.new_tokens[row]):
                items.append(BranchItem(row, snaps, result.tokens[row, step:step + horizon],
                                        result.prompt_lengths[row] + step))
    decisions: list[list[Decision]] = [[] for _ in texts]
    for k in range(0, len(items), branch_batch):
        chunk = items[k:k + branch_batch]
        for it, labels in zip(chunk, branch_labels(model, chunk, label_budget)):
            for snap, lab in zip(it.snapshots, labels):
                evicts = snap.evicts[snap.index(it.row)]
                decisions[it.row].append(snap.decision(it.row, lab, record_values, evicts=evicts,
                                                       budget=budgets[it.row]))
    for d in decisions:
        d.sort(key=lambda x: (x.step, x.layer))
    return decisions, result
