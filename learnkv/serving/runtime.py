"""The engine-independent serving core: per-request block statistics and "which blocks to free".

An engine (the paged simulator, the vLLM adapter) shows the runtime what the decode loop's `learned` policy sees:
for every request and layer, the attention of the step's new queries over the request's resident tokens, and the
new tokens' keys and values. The runtime keeps the `learnkv.features.FeatureTracker` state of the resident tokens,
scores them with the exported `learnkv.scorer.model.Scorer` (batched over requests, one call per layer), pools the
scores of every layer and KV head into one per token (`learnkv.pooling`, the rule the artifact declares) and picks
whole blocks to free with `learnkv.pooling.shared_keep_slots`, the function the decode loop's block mode calls.
So, fed the same attention, it frees exactly the blocks that ``generate(..., policy="learned", granularity="block")``
evicts.

It knows nothing about any engine: no block ids, no pools, no vLLM. Blocks are *logical* (block ``i`` holds the
request's tokens ``[i * block_size, (i + 1) * block_size)``); an engine maps them to its physical blocks. Needs
torch and safetensors only. Memory per request is bounded: only resident tokens carry state, and after every
decision at most ``budget`` of them remain. A finished or aborted request frees everything (`finish`).

Shapes: H KV heads, G query heads per KV head, q new tokens this step, T resident tokens, D head dim, F features.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from learnkv.features import FeatureTracker
from learnkv.pooling import shared_keep_slots
from learnkv.scorer.artifact import load_scorer


@dataclass
class _Request:
    """One request's resident tokens and their state, token axis last (``[1, H, T]``)."""

    policy: object  # the resolved `Learned` policy: sinks, recent window, block size
    budget: int
    n_tokens: int = 0  # logical length written so far
    step: int = 0  # 0 for the prefill (every chunk of it), then 1, 2, ... per decode step
    prefilled: bool = False
    final: bool = True  # whether the current step ends the prefill (decisions start then)
    n_new: int = 0
    positions: Tensor | None = None  # [1, H, T] int64, ascending
    state: list[dict[str, Tensor]] = field(default_factory=list)  # per layer: tracker state + key/value norms
    last_row: list[Tensor | None] = field(default_factory=list)  # per layer: this step's attention [1, H, G, 1, T]
    evicted: list[int] = field(default_factory=list)  # logical blocks freed so far
    full_context_tokens: int | None = None  # tokens written before the first eviction (prefix-cache rule)


@dataclass
class Decision:
    """What to free for one request after one step."""

    req_id: str
    blocks: list[int]  # logical blocks to free now, ascending
    resident_tokens: int  # tokens left after freeing them
    budget: int


class ServingRuntime:
    """Block eviction for many concurrent requests under per-request budgets.

    Parameters
    ----------
    scorer : str or Path
        Exported scorer directory; refused (`ArtifactError`) if its format, feature version, weights checksum,
        pooling rule, model, layer or KV-head count does not match.
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
    """

    def __init__(self, scorer: str | Path, budget: int, *, block_size: int = 16, sink_blocks: int = 1,
                 recent_blocks: int = 1, expect_model: str | None = None, n_layers: int | None = None,
                 n_kv_heads: int | None = None, device: str | torch.device = "cpu"):
        from learnkv.policies.learned import Learned

        # the same checks as the decode loop's `learned` policy (`learnkv.scorer.artifact.check_binding`)
        self.model, self.manifest = load_scorer(scorer, expect_model=expect_model, expect_layers=n_layers,
                                                expect_kv_heads=n_kv_heads)
        self.model = self.model.to(device)
        self.n_layers = self.model.n_layers
        self.tracker = FeatureTracker(self.n_layers)
        self.block_size = block_size
        self.budget = budget
        # the decode loop's own policy object: same sinks / recent window semantics, same feasibility check
        self._template = Learned(scorer=str(scorer), n_sink=sink_blocks * block_size,
                                 n_recent=recent_blocks * block_size, block_size=block_size)
        self._resolved: dict[int, object] = {}
        self.policy = self._policy(budget)  # refuses an infeasible default budget at start-up
        self.requests: dict[str, _Request] = {}
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
        self.requests[req_id] = _Request(policy=self._policy(budget), budget=budget, state=[{} for _ in range(self.n_layers)],
                                         last_row=[None] * self.n_layers)

    def finish(self, req_id: str) -> None:
        """Forget a finished or aborted request entirely (unknown ids are ignored: aborts may race finishes)."""
        self.requests.pop(req_id, None)

    def begin_step(self, req_id: str, n_new: int, final: bool = True) -> None:
        """The next forward pass writes ``n_new`` tokens of ``req_id``; ``final`` is False for a prefill chunk
        that does not end the prompt (no decision is taken before the whole prompt was seen)."""
        req = self.requests[req_id]
        if n_new < 1:
            raise ValueError(f"a step writes at least one token, got {n_new}")
        req.step = req.step + 1 if req.prefilled else 0
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
        a = attn.float()[None]  # [1, H, G, q, T]
        tracker_state = {k: v for k, v in state.items() if not k.startswith("norm.")}
        self.tracker.update(a, req.positions, q, req.step, tracker_state)
        state.update(tracker_state)
        req.last_row[layer] = a[:, :, :, -1:, :]

    # -- the decision ----------------------------------------------------------------------------------------

    def decide(self, req_ids: list[str] | None = None) -> list[Decision]:
        """End the step of ``req_ids`` (default: all) and return the blocks each must free now.

        Every layer of a request must have been observed this step. Scoring is batched: one scorer call per layer
        over the resident tokens of every request that is over its budget.
        """
        t0 = time.perf_counter()
        req_ids = list(self.requests) if req_ids is None else req_ids
        due = []
        for rid in req_ids:
            req = self.requests[rid]
            if any(row is None for row in req.last_row):
                raise RuntimeError(f"request {rid!r}: every layer must be observed before deciding")
            if req.final and req.positions.shape[-1] > self._keep(req):
                due.append(rid)
        scores = self._score(due)
        decisions = []
        for rid in req_ids:
            req = self.requests[rid]
            blocks = self._evict(req, scores[rid]) if rid in scores else []
            if req.final:
                req.prefilled = True
            req.last_row = [None] * self.n_layers
            decisions.append(Decision(rid, blocks, req.positions.shape[-1], req.budget))
        self.decide_s += time.perf_counter() - t0
        return decisions

    @staticmethod
    def _keep(req: _Request) -> int:
        return req.policy.keep_target(req.budget)

    def _score(self, req_ids: list[str]) -> dict[str, list[Tensor]]:
        """Per request, per layer ``[1, H, T]`` scores; one scorer call per layer for all requests."""
        out: dict[str, list[Tensor]] = {rid: [] for rid in req_ids}
        if not req_ids:
            return out
        for layer in range(self.n_layers):
            feats = []
            for rid in req_ids:
                req = self.requests[rid]
                state = req.state[layer]
                # key_norm / value_norm: the norm of a one-element vector is its absolute value, so the stored
                # norms stand in for the full keys and values the decode loop hands the same function
                f = self.tracker.features(req.last_row[layer], state["norm.k"][..., None], state["norm.v"][..., None],
                                          req.positions, layer, req.step,
                                          {k: v for k, v in state.items() if not k.startswith("norm.")})
                feats.append(f)
            flat = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
            with torch.no_grad():
                s = self.model(flat, layer)
            for rid, f, part in zip(req_ids, feats, s.split([f.shape[:-1].numel() for f in feats])):
                out[rid].append(part.view(f.shape[:-1]))
        return out

    def _evict(self, req: _Request, scores: list[Tensor]) -> list[int]:
        p = req.policy
        index = shared_keep_slots(scores, req.positions, self._keep(req), p.n_sink, p.n_recent, self.block_size,
                                  p.pooling)[0, 0]
        T = req.positions.shape[-1]
        dropped = torch.ones(T, dtype=torch.bool, device=index.device)
        dropped[index] = False
        if not bool(dropped.any()):
            return []
        pos = req.positions[0, 0][dropped]
        blocks = torch.unique(pos // self.block_size)
        # whole blocks by construction (resident slots stay block-aligned): check it, an engine frees whole blocks
        if pos.numel() != blocks.numel() * self.block_size:
            raise RuntimeError(f"eviction of {pos.numel()} tokens is not whole blocks of {self.block_size}")
        if req.full_context_tokens is None:
            req.full_context_tokens = req.n_tokens
        index = index.to(req.positions.device)
        req.positions = req.positions[..., index]
        for state in req.state:
            for name, t in state.items():
                state[name] = t[..., index]
        freed = blocks.tolist()
        req.evicted.extend(freed)
        return freed

    # -- queries for engines and tests -----------------------------------------------------------------------

    def resident_blocks(self, req_id: str) -> list[int]:
        """Logical blocks of ``req_id`` still holding tokens."""
        req = self.requests[req_id]
        return [] if req.positions is None else torch.unique(req.positions[0, 0] // self.block_size).tolist()

    def cacheable_blocks(self, req_id: str) -> int:
        """How many leading full blocks may be published to a prefix cache: those written before the first
        eviction. Later blocks were computed against a pruned context and must never serve another request."""
        req = self.requests[req_id]
        tokens = req.n_tokens if req.full_context_tokens is None else req.full_context_tokens
        return tokens // self.block_size

    def state_bytes(self, req_id: str) -> int:
        """Bytes of state held for ``req_id`` (bounded by the budget after every decision)."""
        req = self.requests[req_id]
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
                          n_kv_heads=n_kv_heads, device=device)


def _bound_name(scorer: str, served_model: str) -> str:
    """The served model as the artifact names it: the hub id or path itself, or the folder's name (learnkv names
    bundled models by folder, e.g. ``smollm2-135m-instruct``)."""
    from learnkv.scorer.artifact import read_artifact_manifest

    bound = read_artifact_manifest(scorer).get("model")
    candidates = {served_model, served_model.rstrip("/").rsplit("/", 1)[-1]}
    return bound if bound in candidates else served_model

