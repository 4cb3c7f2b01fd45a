"""The engine-independent serving core: per-request block statistics and "which blocks to free".

An engine (the paged simulator, the vLLM adapter) shows the runtime what the decode loop's `learned` policy sees:
for every request and layer, the attention of the step's new queries over the request's resident tokens, and the
new tokens' keys and values. The runtime keeps the `learnkv.features.FeatureTracker` state of the resident tokens,
scores them with the exported `learnkv.scorer.model.Scorer` (one call per layer, as the decode loop does), pools the
scores of every layer and KV head into one per token (`learnkv.pooling`, the rule the artifact declares) and picks
whole blocks to free with `learnkv.pooling.shared_keep_slots`, the function the decode loop's block mode calls.
So, fed the same attention, it frees exactly the blocks that ``generate(..., policy="learned", granularity="block",
policy_params={"refresh": 1})`` evicts (scores recomputed at every decision, about once per block of new tokens).

It knows nothing about any engine: no block ids, no pools, no vLLM. Blocks are *logical* (block ``i`` holds the
request's tokens ``[i * block_size, (i + 1) * block_size)``); an engine maps them to its physical blocks. Needs
torch and safetensors only. Memory per request is bounded: only resident tokens carry state, and after every
decision at most ``budget`` of them remain. A finished or aborted request frees everything (`finish`).

Two phases per request. While its prompt is written (one or more prefill chunks) its state is its own, as in the
decode loop. After the step that completes the prompt it joins a `learnkv.serving.batch.DecodeBatch`: from then on
one batched `FeatureTracker` update per engine step covers every decoding request and every layer, and an engine
can show a layer's attention for all of them at once (`observe_batch`), or every layer's (`observe_step`). Only a
decision (a request over its budget, about once per block of new tokens) reads a request on its own.

Allocation (``allocation``, `learnkv.serving.config.ALLOCATIONS`; docs/allocation.md, "Serving"): ``uniform`` (the
default) keeps one set of blocks for every layer, as above. ``pyramid`` gives each layer its own budget in whole
blocks (`pyramid_block_budgets`): a layer over its budget keeps its own top blocks, by its own heads' pooled scores
(`shared_keep_slots` over that layer alone), among the blocks it still holds. A block leaves the request
(`Decision.blocks`) once every layer has dropped it; `Decision.layer_blocks` says what each layer dropped, for an
engine with one block table per layer (the paged simulator). The runtime keeps the union of the layers' blocks, with
each layer's dropped tokens as padding to that layer (`DecodeBatch.set_dead`), so a layer's features count only the
tokens it holds. It is shown each layer's attention over its own blocks (`observe`); the batched paths
(`observe_batch`, `observe_step`) are ``uniform`` only.

Shapes: H KV heads, G query heads per KV head, q new tokens this step, T resident tokens, D head dim, F features,
L layers, R requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from learnkv.allocation import pyramid_budgets
from learnkv.features import FEATURES, FeatureTracker, group_mean_max
from learnkv.pooling import shared_keep_slots
from learnkv.policies.learned import Learned
from learnkv.scorer.artifact import load_scorer, read_artifact_manifest
from learnkv.serving.batch import DecodeBatch
from learnkv.serving.config import check_allocation


@dataclass
class _Request:
    """One request. Until its prompt is complete its resident tokens and their state live here, token axis last
    (``[1, H, T]``); afterwards in the runtime's `DecodeBatch` (``state`` is then empty and ``positions`` reads the
    batch)."""

    req_id: str
    policy: object  # the resolved `Learned` policy: sinks, recent window, block size
    budget: int
    n_tokens: int = 0  # logical length written so far
    step: int = 0  # 0 for the prefill (every chunk of it), then 1, 2, ... per decode step
    prefilled: bool = False
    final: bool = True  # whether the current step ends the prefill (decisions start then)
    n_new: int = 0
    own_positions: Tensor | None = None  # [1, H, T] int64, ascending (prompt phase)
    batch: DecodeBatch | None = None  # set once the request decodes in the batch
    state: list[dict[str, Tensor]] = field(default_factory=list)  # per layer: tracker state + key/value norms
    last_row: list[Tensor | None] = field(default_factory=list)  # per layer: the step's group mean, max [1, H, 2, 1, T]
    evicted: list[int] = field(default_factory=list)  # logical blocks freed so far
    full_context_tokens: int | None = None  # tokens written before the first eviction (prefix-cache rule)
    layer_budgets: list[int] | None = None  # pyramid: each layer's budget in tokens (whole blocks); None: uniform
    dropped: list[set[int]] = field(default_factory=list)  # pyramid, per layer: blocks it dropped, others still hold
    layer_blocks: list[list[int]] | None = None  # pyramid: what each layer dropped at the latest decision

    @property
    def positions(self) -> Tensor | None:
        """``[1, H, T]`` (prompt phase) or ``[1, 1, T]`` (decoding) positions of the resident tokens, ascending."""
        if self.batch is not None:
            return self.batch.resident_positions(self.req_id)[None, None]
        return self.own_positions

    @positions.setter
    def positions(self, value: Tensor | None) -> None:
        self.own_positions = value


@dataclass
class Decision:
    """What to free for one request after one step."""

    req_id: str
    blocks: list[int]  # logical blocks to free now, ascending
    resident_tokens: int  # tokens left after freeing them
    budget: int
    n_tokens: int = 0  # tokens the request has written (its logical length)
    layer_blocks: list[list[int]] | None = None  # pyramid: logical blocks each layer drops now (None: uniform)


class ServingRuntime:
    """Block eviction for many concurrent requests under per-request budgets.

    Parameters
    ----------
    scorer : str or Path
        Exported scorer directory; refused (`ArtifactError`) if its format, feature version, weights checksum,
        pooling rule, model, layer or KV-head count, or the allocation it was trained for does not match.
    budget : int
        Default per-request budget in tokens (per layer and KV head).
    block_size, sink_blocks, recent_blocks : int
        Block size and protected blocks (see `learnkv.serving.config.ServingConfig`).
    expect_model : str, optional
        Refuse an artifact bound to another model (checked by `learnkv.scorer.artifact.load_scorer`).
    n_layers, n_kv_heads : int, optional
        The served model's shape; refuse an artifact trained for another.
    device : str or torch.device
        Where scoring runs (the engine's device; state follows the attention it is shown).
    allocation : str
        "uniform" or "pyramid" (module docstring); "head" and "global" are refused in one line saying why.
    beta : float
        ``pyramid``: PyramidKV's beta (`learnkv.allocation.pyramid_budgets`).
    """

    def __init__(self, scorer: str | Path, budget: int, *, block_size: int = 16, sink_blocks: int = 1,
                 recent_blocks: int = 1, expect_model: str | None = None, n_layers: int | None = None,
                 n_kv_heads: int | None = None, device: str | torch.device = "cpu", allocation: str = "uniform",
                 beta: float = 20.0):
        check_allocation(allocation)
        # the same checks as the decode loop's `learned` policy (`learnkv.scorer.artifact.check_binding`), and the
        # allocation the scorer was trained for, which the decode loop leaves free as an experiment
        self.model, self.manifest = load_scorer(scorer, expect_model=expect_model, expect_layers=n_layers,
                                                expect_kv_heads=n_kv_heads, expect_allocation=allocation)
        self.allocation, self.beta = allocation, beta
        self.model = self.model.to(device)
        # a scorer with content features reads each token's value vector; a value never changes, so the runtime
        # keeps its content term (one number per token, layer and KV head, as the norms) from when it is written
        self.reads_values = bool(self.model.content_dim)
        self.n_layers = self.model.n_layers
        self.tracker = FeatureTracker(self.n_layers)
        self.block_size = block_size
        self.budget = budget
        # the decode loop's own policy object: same sinks / recent window semantics, same feasibility check. It
        # scores afresh at every decision (refresh=1): a block decision comes about once per block of new tokens
        self._template = Learned(scorer=str(scorer), n_sink=sink_blocks * block_size,
                                 n_recent=recent_blocks * block_size, block_size=block_size, refresh=1)
        self._resolved: dict[int, object] = {}
        self.policy = self._policy(budget)  # refuses an infeasible default budget at start-up
        if allocation == "pyramid":
            self._layer_budgets(budget)  # and every layer's share of it
        self.requests: dict[str, _Request] = {}
        self.batch = DecodeBatch(self.tracker, self.n_layers, self._device)
        self.decide_s = 0.0  # host time spent deciding (overhead accounting)

    # -- request lifecycle -----------------------------------------------------------------------------------

    def _policy(self, budget: int):
        if budget not in self._resolved:
            self._resolved[budget] = self._template.resolve(budget)
        return self._resolved[budget]

    def add_request(self, req_id: str, budget: int | None = None) -> None:
        """Start tracking a request (before its first forward pass); ``budget`` overrides the default."""
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} is already tracked")
        budget = self.budget if budget is None else int(budget)
        layers = self._layer_budgets(budget) if self.allocation == "pyramid" else None
        self.requests[req_id] = _Request(req_id, policy=self._policy(budget), budget=budget,
                                         state=[{} for _ in range(self.n_layers)],
                                         last_row=[None] * self.n_layers, layer_budgets=layers,
                                         dropped=[set() for _ in range(self.n_layers)] if layers else [])

    def _layer_budgets(self, budget: int) -> list[int]:
        """``pyramid``: each layer's budget in tokens (whole blocks), each checked as the decode loop checks one."""
        p = self._template
        blocks = pyramid_block_budgets(budget, self.n_layers, self.block_size, p.n_sink // self.block_size,
                                       p.n_recent // self.block_size, self.beta)
        budgets = [b * self.block_size for b in blocks]
        for b in set(budgets):
            self._policy(b)
        return budgets

    def finish(self, req_id: str) -> None:
        """Forget a finished or aborted request entirely (unknown ids are ignored: aborts may race finishes)."""
        self.requests.pop(req_id, None)
        self.batch.remove(req_id)

    def begin_step(self, req_id: str, n_new: int, final: bool = True) -> None:
        """The next forward pass writes ``n_new`` tokens of ``req_id``; ``final`` is False for a prefill chunk
        that does not end the prompt (no decision is taken before the whole prompt was seen)."""
        req = self.requests[req_id]
        if n_new < 1:
            raise ValueError(f"a step writes at least one token, got {n_new}")
        if req.prefilled:
            if n_new != 1:
                raise ValueError(f"request {req_id!r}: a decode step writes one token, got {n_new}")
            req.step, req.n_new, req.final = req.step + 1, 1, True
            req.n_tokens += 1
            self.batch.begin(req_id)
            return
        req.step = 0
        req.n_new = n_new
        req.final = final
        new = torch.arange(req.n_tokens, req.n_tokens + n_new, device=self._device)
        req.n_tokens += n_new
        if req.positions is None:
            req.positions = new[None, None, :]
        else:
            req.positions = torch.cat([req.positions, new.expand(1, req.positions.shape[1], n_new)], dim=-1)

    @property
    def _device(self) -> torch.device:
        return self.model.w1.device

    # -- what the engine shows -------------------------------------------------------------------------------

    def observe(self, req_id: str, layer: int, attn: Tensor, keys: Tensor, values: Tensor) -> None:
        """One layer's view of one request in the current step.

        Parameters
        ----------
        attn : Tensor
            ``[H, G, q, T]`` attention probabilities of the step's ``q`` new queries over the request's resident
            tokens (ascending position, the new tokens last), query head ``h * G + g`` on KV head ``h``.
        keys, values : Tensor
            ``[H, q, D]`` the new tokens' keys (after RoPE) and values, as written to the cache.
        """
        req = self.requests[req_id]
        H, _, q, T = attn.shape
        if req.prefilled:
            if q != 1:
                raise ValueError(f"request {req_id!r} layer {layer}: a decode step has one query, got {q}")
            self.batch.observe_one(layer, req_id, self._widen(req, layer, attn[:, :, 0]),
                                   keys[:, 0].float().norm(dim=-1), values[:, 0].float().norm(dim=-1),
                                   self._content(values[None], layer)[0, :, 0] if self.reads_values else None)
            return
        if q != req.n_new or T != req.positions.shape[-1]:
            raise ValueError(f"request {req_id!r} layer {layer}: attention {tuple(attn.shape)} does not match "
                             f"{req.n_new} new tokens over {req.positions.shape[-1]} resident ones")
        if req.positions.shape[1] != H:
            req.positions = req.positions[:, :1].expand(1, H, T).contiguous()
        state = req.state[layer]
        for name, t in state.items():  # new slots, as the decode loop's cache appends them
            if not name.startswith("norm."):
                state[name] = torch.cat([t, t.new_zeros(*t.shape[:-1], q)], dim=-1)
        k_norm = keys.float().norm(dim=-1)[None]  # [1, H, q]
        v_norm = values.float().norm(dim=-1)[None]
        state["norm.k"] = k_norm if "norm.k" not in state else torch.cat([state["norm.k"], k_norm], dim=-1)
        state["norm.v"] = v_norm if "norm.v" not in state else torch.cat([state["norm.v"], v_norm], dim=-1)
        if self.reads_values:
            c = self._content(values[None], layer)  # [1, H, q]
            state["norm.c"] = c if "norm.c" not in state else torch.cat([state["norm.c"], c], dim=-1)
        a = group_mean_max(attn.float()[None])  # [1, H, 2, q, T]: the group mean and max, all the tracker reads
        tracker_state = {k: v for k, v in state.items() if not k.startswith("norm.")}
        self.tracker.update(a, req.positions, q, req.step, tracker_state)
        state.update(tracker_state)
        req.last_row[layer] = a[:, :, :, -1:, :]

    def _widen(self, req: _Request, layer: int, attn: Tensor) -> Tensor:
        """``pyramid``: a decoding layer's attention ``[H, G, T_l]`` over the blocks it holds -> over the request's
        resident tokens (the union over layers), zero where this layer dropped the block. As is under ``uniform``."""
        if not req.dropped or not req.dropped[layer]:
            return attn
        pos = self.batch.resident_positions(req.req_id)
        held = ~torch.isin(pos // self.block_size, torch.tensor(sorted(req.dropped[layer]), device=pos.device))
        held = torch.cat([held, held.new_ones(1)]).to(attn.device)  # the step's new token, appended at `fold`
        if attn.shape[-1] != int(held.sum()):
            raise ValueError(f"request {req.req_id!r} layer {layer}: attention over {attn.shape[-1]} tokens, the layer "
                             f"holds {int(held.sum())}")
        wide = attn.new_zeros(*attn.shape[:-1], held.numel())
        wide[..., held] = attn
        return wide

    def _uniform_only(self, what: str) -> None:
        if self.allocation != "uniform":
            raise ValueError(f"{what} shows every layer over one set of blocks: allocation 'uniform' only; show "
                             f"allocation {self.allocation!r} one layer at a time (observe)")

    def observe_batch(self, layer: int, req_ids: list[str], attn: Tensor, k_norm: Tensor, v_norm: Tensor,
                      lens: Tensor | None = None, values: Tensor | None = None) -> None:
        """One layer's view of several decoding requests at once (each past its prompt, one new token).

        Parameters
        ----------
        attn : Tensor
            ``[R, H, G, Tb]`` each request's new query over its resident tokens in ascending position,
            left-aligned (request r's T_r tokens, then zeros up to the widest request's Tb).
        k_norm, v_norm : Tensor
            ``[R, H]`` norms of the new tokens' keys (after RoPE) and values.
        lens : Tensor, optional
            ``[R]`` the engine's T_r; a mismatch with the runtime's resident count is an error at `decide`.
        values : Tensor, optional
            ``[R, H, D]`` the new tokens' values: needed when the scorer reads them (`reads_values`).
        """
        self._uniform_only("observe_batch")
        content = self._content(values[:, :, None], layer)[:, :, 0] if self._needs(values) else None
        self.batch.observe(layer, req_ids, attn, k_norm, v_norm, lens, content)

    def observe_step(self, req_ids: list[str], attn: Tensor, k_norm: Tensor, v_norm: Tensor,
                     lens: Tensor | None = None, values: Tensor | None = None) -> None:
        """`observe_batch` for every layer at once: ``attn [L, R, H, G, Tb]``, ``k_norm, v_norm [L, R, H]``,
        ``values [L, R, H, D]`` (when the scorer reads them)."""
        self._uniform_only("observe_step")
        content = None
        if self._needs(values):  # every layer's gate in one einsum: [L, R, H, D] -> [L, H, R] -> [L, R, H]
            layers = torch.arange(self.n_layers, device=self._device)
            content = self.model.content_term(values.transpose(1, 2).to(self._device), layers).transpose(1, 2)
        self.batch.observe_all(req_ids, attn, k_norm, v_norm, lens, content)

    def _needs(self, values: Tensor | None) -> bool:
        """Whether to compute content terms; refuses a missing ``values`` for a scorer that reads them."""
        if self.reads_values and values is None:
            raise ValueError("this scorer reads the tokens' value vectors (content features): pass values")
        return self.reads_values

    def _content(self, values: Tensor, layer: int) -> Tensor:
        """``values [..., H, T, D]`` -> the content gate's term ``[..., H, T]``, as the decode loop's scorer adds it."""
        return self.model.content_term(values.to(self._device), layer)

    # -- the decision ----------------------------------------------------------------------------------------

    def decide(self, req_ids: list[str] | None = None) -> list[Decision]:
        """End the step of ``req_ids`` (default: all) and return the blocks each must free now.

        Every layer of a request must have been observed this step. The decoding requests' attention is folded
        in first, in one batched update; then each request over its budget is scored (one scorer call per layer)
        and loses its lowest-scoring whole blocks.
        """
        t0 = time.perf_counter()
        req_ids = list(self.requests) if req_ids is None else req_ids
        self.batch.fold()
        decisions = []
        for rid in req_ids:
            req = self.requests[rid]
            if req.layer_budgets is not None:
                req.layer_blocks = [[] for _ in range(self.n_layers)]
            if req.prefilled:
                blocks = self._decide_decoding(rid, req)
            else:
                blocks = self._decide_prefill(rid, req)
            decisions.append(Decision(rid, blocks, self._n_resident(rid, req), req.budget, req.n_tokens,
                                      req.layer_blocks))
        self.decide_s += time.perf_counter() - t0
        return decisions

    def _n_resident(self, rid: str, req: _Request) -> int:
        return self.batch.n_resident(rid) if rid in self.batch else req.positions.shape[-1]

    def _decide_prefill(self, rid: str, req: _Request) -> list[int]:
        """A prompt chunk's step: decide (if the prompt is complete) on the request's own state, then move the
        request into the decode batch."""
        if any(row is None for row in req.last_row):
            raise RuntimeError(f"request {rid!r}: every layer must be observed before deciding")
        blocks = []
        if req.final and self._over(req, req.positions.shape[-1]):
            scores = []
            for layer in range(self.n_layers):
                state = req.state[layer]
                # key_norm / value_norm: the norm of a one-element vector is its absolute value, so the stored
                # norms stand in for the full keys and values the decode loop hands the same function
                f = self.tracker.features(req.last_row[layer], state["norm.k"][..., None], state["norm.v"][..., None],
                                          req.positions, layer, req.step, _tracker_state(state))
                with torch.no_grad():
                    scores.append(self.model(f, layer, content=state.get("norm.c")))
            index = self._keep_index(req, scores, req.positions)
            blocks = self._dropped_blocks(req, req.positions, index)
            if blocks:
                req.positions = req.positions[..., index]
                for state in req.state:
                    for name, t in state.items():
                        state[name] = t[..., index]
        req.last_row = [None] * self.n_layers
        if req.final:
            req.prefilled = True
            self.batch.add(rid, req.positions[0, 0], req.state, req.n_tokens)
            self._mark_dead(rid, req)
            req.positions, req.state, req.last_row, req.batch = None, [], [], self.batch
        return blocks

    def _decide_decoding(self, rid: str, req: _Request) -> list[int]:
        """A decoding request over its budget: score its resident tokens in every layer and keep `_keep` of them
        (for a lagged scorer, ``budget - interval + 1``: the decode loop's overflow rule, `Policy.keep_target`)."""
        if not self._over(req, self.batch.n_resident(rid)):
            return []
        positions, state, attn, step = self.batch.extract(rid)  # layers on the batch axis
        norms = state.pop("norm.k")[..., None], state.pop("norm.v")[..., None]
        content = state.pop("norm.c", None)  # [L, H, T]
        feats = self.tracker.features(attn, norms[0], norms[1], positions, 0, step, state)  # [L, H, T, F]
        # the layer column, which `features` fills with one layer's value: every layer's own, computed as the
        # decode loop computes it (a Python float per layer, rounded once to float32)
        layer_col = torch.tensor([i / max(self.n_layers - 1, 1) for i in range(self.n_layers)], dtype=torch.float64)
        feats[..., FEATURES.index("layer")] = layer_col.to(feats)[:, None, None]
        with torch.no_grad():
            scores = [self.model(feats[i:i + 1], i, content=None if content is None else content[i:i + 1])
                      for i in range(self.n_layers)]
        if req.layer_budgets is not None:  # the union's positions: ``positions`` has -1 where a layer dropped a token
            positions = self.batch.resident_positions(rid)[None, None].expand(1, *positions.shape[1:]).contiguous()
        index = self._keep_index(req, scores, positions[:1])
        blocks = self._dropped_blocks(req, positions[:1], index)
        if blocks:
            self.batch.compact(rid, index)
        self._mark_dead(rid, req)
        return blocks

    def _mark_dead(self, rid: str, req: _Request) -> None:
        """``pyramid``: show the batch which resident tokens each layer dropped, so that layer's features and
        tracker statistics count only the tokens it holds, as if it held them alone."""
        if req.layer_budgets is None:
            return
        block = self.batch.resident_positions(rid) // self.block_size
        self.batch.set_dead(rid, torch.stack([torch.isin(block, torch.tensor(sorted(d), dtype=block.dtype,
                                                                             device=block.device))
                                              for d in req.dropped]))

    def _over(self, req: _Request, n_resident: int) -> bool:
        """Whether a layer holds more than its budget (a dropped block is whole and still resident elsewhere)."""
        if req.layer_budgets is None:
            return n_resident > req.budget
        return any(n_resident - len(d) * self.block_size > b for d, b in zip(req.dropped, req.layer_budgets))

    @staticmethod
    def _keep(req: _Request) -> int:
        return req.policy.keep_target(req.budget)

    def _keep_index(self, req: _Request, scores: list[Tensor], positions: Tensor) -> Tensor:
        """``[K]`` kept slots (ascending) of the per-layer ``[1, H, T]`` scores over ``positions [1, H, T]``."""
        if req.layer_budgets is not None:
            return self._pyramid_keep(req, scores, positions)
        p = req.policy
        return shared_keep_slots(scores, positions, self._keep(req), p.n_sink, p.n_recent, self.block_size,
                                 p.pooling)[0, 0]

    def _pyramid_keep(self, req: _Request, scores: list[Tensor], positions: Tensor) -> Tensor:
        """``pyramid``: every layer over its budget keeps its top whole blocks (its own heads' pooled scores) among
        those it holds, down to its keep target; returns the slots some layer still holds (``[K]``, ascending) and
        records each layer's drops (``req.dropped``, ``req.layer_blocks``)."""
        p, bs = req.policy, self.block_size
        pos = positions[0, 0]
        block = pos // bs
        for layer, (budget, dropped) in enumerate(zip(req.layer_budgets, req.dropped)):
            cols = (~torch.isin(block, torch.tensor(sorted(dropped), dtype=block.dtype, device=block.device))
                    ).nonzero().flatten()
            if cols.numel() <= budget:
                continue
            keep = self._policy(budget).keep_target(budget)
            kept = shared_keep_slots([scores[layer][..., cols.to(scores[layer].device)]], positions[..., cols], keep,
                                     p.n_sink, p.n_recent, bs, p.pooling)[0, 0]
            lost = torch.ones(cols.numel(), dtype=torch.bool, device=cols.device)
            lost[kept.to(cols.device)] = False
            gone = pos[cols[lost]]
            new = torch.unique(gone // bs)
            if gone.numel() != new.numel() * bs:
                raise RuntimeError(f"layer {layer}: eviction of {gone.numel()} tokens is not whole blocks of {bs}")
            dropped.update(new.tolist())
            req.layer_blocks[layer] = new.tolist()
            if req.full_context_tokens is None:  # later blocks are computed against this layer's pruned context
                req.full_context_tokens = req.n_tokens
        everywhere = set.intersection(*req.dropped)
        for dropped in req.dropped:
            dropped -= everywhere
        gone = torch.tensor(sorted(everywhere), dtype=block.dtype, device=block.device)
        return (~torch.isin(block, gone)).nonzero().flatten()

    def _dropped_blocks(self, req: _Request, positions: Tensor, index: Tensor) -> list[int]:
        """Logical blocks of the slots not in ``index``; records them as evicted."""
        T = positions.shape[-1]
        dropped = torch.ones(T, dtype=torch.bool, device=index.device)
        dropped[index] = False
        if not bool(dropped.any()):
            return []
        pos = positions[0, 0][dropped.to(positions.device)]
        blocks = torch.unique(pos // self.block_size)
        # whole blocks by construction (resident slots stay block-aligned): check it, an engine frees whole blocks
        if pos.numel() != blocks.numel() * self.block_size:
            raise RuntimeError(f"eviction of {pos.numel()} tokens is not whole blocks of {self.block_size}")
        if req.full_context_tokens is None:
            req.full_context_tokens = req.n_tokens
        freed = blocks.tolist()
        req.evicted.extend(freed)
        return freed

    # -- queries for engines and tests -----------------------------------------------------------------------

    def resident_blocks(self, req_id: str, layer: int | None = None) -> list[int]:
        """Logical blocks of ``req_id`` still holding tokens (in some layer), or in ``layer`` (``pyramid``)."""
        req = self.requests[req_id]
        if req_id in self.batch:
            positions = self.batch.resident_positions(req_id)
        elif req.positions is None:
            return []
        else:
            positions = req.positions[0, 0]
        blocks = torch.unique(positions // self.block_size).tolist()
        if layer is None or not req.dropped:
            return blocks
        return [b for b in blocks if b not in req.dropped[layer]]

    def resident_positions(self, req_id: str) -> Tensor:
        """``[T]`` positions of ``req_id``'s resident tokens, ascending."""
        req = self.requests[req_id]
        return self.batch.resident_positions(req_id) if req_id in self.batch else req.positions[0, 0]

    def cacheable_blocks(self, req_id: str) -> int:
        """How many leading full blocks may be published to a prefix cache: those written before the first
        eviction. Later blocks were computed against a pruned context and must never serve another request."""
        req = self.requests[req_id]
        tokens = req.n_tokens if req.full_context_tokens is None else req.full_context_tokens
        return tokens // self.block_size

    def state_bytes(self, req_id: str) -> int:
        """Bytes of state held for ``req_id`` (bounded by the budget after every decision)."""
        req = self.requests[req_id]
        if req_id in self.batch:  # its share of the batch: the padding columns are the batch's, not its
            return self.batch.n_resident(req_id) * self.batch.bytes_per_token()
        tensors = [req.positions] + [t for s in req.state for t in s.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def runtime_for(config, *, n_layers: int | None = None, n_kv_heads: int | None = None, served_model: str = "",
                device: str | torch.device = "cpu") -> ServingRuntime:
    """A runtime from a `learnkv.serving.config.ServingConfig`, bound to the served model's name and shape."""
    expect = config.expect_model or None
    if expect is None and served_model:
        expect = _bound_name(config.scorer, served_model)
    return ServingRuntime(config.scorer, config.budget, block_size=config.block_size, sink_blocks=config.sink_blocks,
                          recent_blocks=config.recent_blocks, expect_model=expect, n_layers=n_layers,
                          n_kv_heads=n_kv_heads, device=device, allocation=config.allocation)


def pyramid_block_budgets(budget: int, n_layers: int, block_size: int, sink_blocks: int, recent_blocks: int,
                          beta: float = 20.0) -> list[int]:
    """``pyramid``'s per-layer budgets in whole blocks, largest at layer 0.

    PyramidKV's schedule (`learnkv.allocation.pyramid_budgets`, exact by largest remainder) over ``budget //
    block_size`` blocks per layer, each layer at least ``sink_blocks + recent_blocks + 1`` (the protected blocks
    and one evictable block, the least a block decision fits). Rounded down to whole blocks first, so a request's
    total, ``sum x block_size`` tokens, is ``n_layers x block_size x (budget // block_size)``: never more than
    ``uniform``'s ``n_layers x budget``, and short of it by ``n_layers x (budget mod block_size)`` tokens.
    """
    least = sink_blocks + recent_blocks + 1
    if budget // block_size < least:
        raise ValueError(f"allocation 'pyramid': a budget of {budget} tokens is {budget // block_size} whole blocks of "
                         f"{block_size} per layer, fewer than the {least} a layer needs (sink and recent blocks and "
                         "one evictable block); raise the budget")
    return pyramid_budgets(budget // block_size, n_layers, beta, min_budget=least)


def _bound_name(scorer: str, served_model: str) -> str:
    """The served model as the artifact names it: the hub id or path itself, or the folder's name (learnkv names
    bundled models by folder, e.g. ``smollm2-135m-instruct``)."""
    bound = read_artifact_manifest(scorer).get("model")
    candidates = {served_model, served_model.rstrip("/").rsplit("/", 1)[-1]}
    return bound if bound in candidates else served_model


def _tracker_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The `FeatureTracker` entries of a layer's state (without the stored key and value norms)."""
    return {k: v for k, v in state.items() if not k.startswith("norm.")}
