"""The worker half of the vLLM plugin: what the runtime is shown in each forward pass, and what it decided.

`WorkerHalf` is engine-agnostic torch code (it imports no vLLM; the connector and the attention backends call it),
so it runs on CPU in tests with a hand-made paged cache. Per engine step:

- `begin` (the connector's ``bind_connector_metadata``, before the forward): requests that started or finished,
  and for each tracked request the number of tokens it writes and the physical slot of its newest token;
- `attend` (the attention backend, once per layer, after the stock kernel): for the step's **decoding** requests
  at once, the new query's attention over each request's resident blocks (one gather of the resident blocks
  through the backend's `layouts` reader, one matmul, one softmax for all of them) and the new keys' and values'
  norms go to the runtime in one call; in evict mode the rows of requests with evicted blocks get the attention
  output recomputed over their resident blocks (the stock kernel read every block of the row, freed ones
  included). Requests still writing their prompt are shown one by one (a prompt chunk has many queries; it
  happens once per request);
- `end` (the connector's ``wait_for_save``, after the forward): the runtime decides; decided blocks enter the
  evicted-block mask **in both modes**, so the attention the runtime is shown next step covers exactly the blocks
  it still holds. Shadow mode differs from evict mode only in that the stock output is kept and nothing is freed.

Which batch row belongs to which request is found from the slot each request's newest token is written to
(`paged.row_requests`), so the worker never reads the model runner's input batch.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from learnkv.serving.vllm.layouts import stack_layers
from learnkv.serving.vllm.paged import block_attention, block_output, resident_blocks, row_requests


@dataclass
class StepPlan:
    """Where each tracked request sits in this step's batch (built at the step's first layer)."""

    ids: list[str]  # decoding requests, in row order
    rows: Tensor  # [R] each one's row in the batch
    tok: Tensor  # [R] index of each one's query token in the batch
    blocks: Tensor  # [R, NB] resident physical blocks, ascending logical order
    valid: Tensor  # [R, NB * bs] columns holding resident tokens
    lens: Tensor  # [R] resident tokens (this step's included)
    replace: Tensor | None  # indices into ``ids`` whose output is recomputed (evict mode, evicted blocks)
    prefill: list[tuple[str, int, int, int]]  # (request, first token, end token, batch row) of prompt chunks
    found: set[str]


class WorkerHalf:
    """Shows a `learnkv.serving.runtime.ServingRuntime` every tracked request's attention, step by step.

    Parameters
    ----------
    runtime : ServingRuntime
        The worker's runtime (on the engine's device).
    layout : object
        The backend's paged-cache reader (`learnkv.serving.vllm.layouts`).
    block_size : int
        The engine's block size.
    evict : bool
        Evict mode: recompute the output of rows with evicted blocks.
    """

    def __init__(self, runtime, layout, block_size: int, evict: bool):
        self.runtime, self.layout, self.block_size, self.evict = runtime, layout, block_size, evict
        self.evicted: dict[str, set[int]] = {}  # request -> evicted logical blocks
        self._masks: dict[str, Tensor] = {}  # request -> [MB] bool, rebuilt when its set changes
        self.last_slots: dict[str, int] = {}
        self.plan: StepPlan | None = None
        self.observed = 0
        self.overhead_s = 0.0
        self.observer = None  # tests: called with (event, **tensors) at every step event
        self._q = self._k = self._v = None  # [L, R, Hq | H, D] the decoding rows' new queries, keys, values
        self._caches: list[Tensor | None] = []
        self._scale = 1.0
        self._stacked, self._stacked_key = None, None  # every layer's cache as one [L, ...] view

    # -- per step ----------------------------------------------------------------------------------------------

    def begin(self, new: dict[str, int], steps: dict[str, tuple[int, bool, int]], finished: list[str]) -> None:
        """Before the forward: ``new`` request -> budget, ``steps`` request -> (new tokens, prompt complete, slot of
        the newest token), ``finished`` requests to forget."""
        for rid in finished:
            self.forget(rid)
        for rid, budget in new.items():
            self.runtime.add_request(rid, budget)
            self.evicted[rid] = set()
        steps = {rid: step for rid, step in steps.items() if rid in self.runtime.requests}
        for rid, (n_new, final, _) in steps.items():
            self.runtime.begin_step(rid, n_new, final)
        self.last_slots = {rid: slot for rid, (_, _, slot) in steps.items()}
        self.plan, self.observed = None, 0
        if self.observer is not None:
            self.observer("begin", new=new, steps=steps, finished=finished)

    def forget(self, rid: str) -> None:
        self.runtime.finish(rid)
        self.evicted.pop(rid, None)
        self._masks.pop(rid, None)

    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, metadata,
               output: Tensor, scale: float) -> None:
        """One layer, after the stock kernel wrote ``output [N, Hq, D]``; ``query [N, Hq, D]``, ``key, value
        [N, H, D]`` are the step's new tokens, ``kv_cache`` the layer's paged cache (this step's tokens written).

        Decoding requests cost three row copies here; their attention is computed for every layer at once in
        `end` (the cache still holds the same keys then). Only rows whose output must change (evict mode,
        evicted blocks) are computed now, as the next layer needs them.
        """
        if not self.last_slots:
            return
        t0 = time.perf_counter()
        if self.plan is None:
            self.plan = self._plan(metadata, query, key)
        plan = self.plan
        if plan.ids:
            torch.index_select(query, 0, plan.tok, out=self._q[layer])
            torch.index_select(key, 0, plan.tok, out=self._k[layer])
            torch.index_select(value, 0, plan.tok, out=self._v[layer])
            self._caches[layer], self._scale = kv_cache, scale
            if plan.replace is not None:
                keys, values = self.layout.gather(kv_cache, plan.blocks.index_select(0, plan.replace))
                probs = block_attention(self._q[layer].index_select(0, plan.replace), keys,
                                        plan.valid.index_select(0, plan.replace), scale)
                rows = plan.tok.index_select(0, plan.replace)
                output[rows] = block_output(probs, values).to(output.dtype)
        for rid, lo, hi, row in plan.prefill:
            self._attend_prompt(layer, rid, query[lo:hi], key[lo:hi], value[lo:hi], kv_cache, metadata, row, scale)
        self.observed += 1
        self.overhead_s += time.perf_counter() - t0
        if self.observer is not None:
            self.observer("attend", layer=layer, query=query, kv_cache=kv_cache, metadata=metadata, output=output,
                          plan=plan, scale=scale)

    def _observe_decoding(self) -> None:
        """Every layer's attention of the step's decoding requests: one gather of their resident blocks from the
        stacked caches, one batched matmul and softmax, one call into the runtime."""
        plan = self.plan
        if self._stacked is None or self._stacked_key != self._caches[0].data_ptr():
            self._stacked, self._stacked_key = stack_layers(self._caches), self._caches[0].data_ptr()
        if self._stacked is not None:
            keys = self.layout.gather_keys(self._stacked, plan.blocks)  # [L, R, NB, H, D, bs]
        else:  # layers in separate allocations: one gather each
            keys = torch.stack([self.layout.gather_keys(c, plan.blocks) for c in self._caches])
        probs = block_attention(self._q, keys, plan.valid, self._scale)  # [L, R, H, G, T]
        self.runtime.observe_step(plan.ids, probs, self._k.float().norm(dim=-1), self._v.float().norm(dim=-1),
                                  plan.lens, values=self._v if self.runtime.reads_values else None)

    def _attend_prompt(self, layer, rid, query, key, value, kv_cache, metadata, row, scale) -> None:
        """A prompt chunk of one request (no evicted block yet: decisions start when the prompt is complete)."""
        seq = int(metadata.seq_lens[row])
        n_blocks = -(-seq // self.block_size)
        blocks = metadata.block_table[row, :n_blocks].long()[None]
        keys = self.layout.gather(kv_cache, blocks)[0][0]  # [NB, H, D, bs]
        NB, H, D, bs = keys.shape
        keys_t = keys.permute(1, 2, 0, 3).reshape(H, D, NB * bs)[..., :seq]  # [H, D, seq]
        q, Hq = query.shape[0], query.shape[1]
        qh = query.view(q, H, Hq // H, D).permute(1, 2, 0, 3).float()  # [H, G, q, D]
        scores = torch.matmul(qh, keys_t[:, None].float()) * scale  # [H, G, q, seq]
        pos = torch.arange(seq, device=query.device)
        future = pos[None, :] > pos[seq - q:, None]  # [q, seq]: causal within the chunk
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        self.runtime.observe(rid, layer, probs, key.transpose(0, 1), value.transpose(0, 1))

    def end(self) -> list:
        """After the forward: the runtime's decisions for the requests seen in this step's batch."""
        if not self.last_slots:
            return []
        if self.observed == 0 or (self.plan is not None and self.observed < self.runtime.n_layers):
            if sys.exc_info()[0] is not None:
                return []  # the forward pass failed: let its own exception surface, not a consequence of it
            raise RuntimeError(f"learnkv: attention was observed in {self.observed} of {self.runtime.n_layers} "
                               "layers this step; the learnkv attention backend is not in use (is LEARNKV_SCORER "
                               "set in the environment of every vLLM process?)")
        t0 = time.perf_counter()
        if self.plan.ids:
            self._observe_decoding()
        for rid in set(self.last_slots) - self.plan.found:  # not found in the batch: stop tracking, never guess
            self.forget(rid)
        tracked = [rid for rid in self.last_slots if rid in self.plan.found]
        decisions = self.runtime.decide(tracked)
        for d in decisions:
            if d.blocks:  # masked from the next forward on, in both modes: the runtime no longer holds them
                self.evicted[d.req_id].update(d.blocks)
                self._masks.pop(d.req_id, None)
        self.last_slots = {}
        self.overhead_s += time.perf_counter() - t0
        if self.observer is not None:
            self.observer("decide", tracked=tracked, decisions=decisions)
        return decisions

    # -- the step's layout -------------------------------------------------------------------------------------

    def _mask(self, rid: str, width: int, device) -> Tensor:
        mask = self._masks.get(rid)
        if mask is None or mask.shape[0] != width:
            mask = torch.zeros(width, dtype=torch.bool, device=device)
            blocks = [b for b in self.evicted.get(rid, ()) if b < width]
            if blocks:
                mask[blocks] = True
            self._masks[rid] = mask
        return mask

    def _plan(self, md, query: Tensor, key: Tensor) -> StepPlan:
        rows = row_requests(md.slot_mapping, md.query_start_loc, self.last_slots)
        requests = self.runtime.requests
        decode = [(row, rid) for row, rid in rows.items() if requests[rid].prefilled]
        qsl = md.query_start_loc
        prefill = []
        if len(decode) < len(rows):
            starts = qsl.tolist()
            prefill = [(rid, starts[row], starts[row + 1], row) for row, rid in rows.items()
                       if not requests[rid].prefilled]
        device = md.block_table.device
        ids = [rid for _, rid in decode]
        row_t = torch.tensor([row for row, _ in decode], dtype=torch.long, device=device)
        width = md.block_table.shape[1]
        if ids:
            evicted = torch.stack([self._mask(rid, width, device) for rid in ids])
            blocks, valid, lens = resident_blocks(md.block_table.index_select(0, row_t),
                                                  md.seq_lens.index_select(0, row_t), evicted, self.block_size)
        else:
            blocks = valid = lens = torch.zeros(0, 1, dtype=torch.long, device=device)
        replace = None
        if self.evict:
            sel = [j for j, rid in enumerate(ids) if self.evicted.get(rid)]
            replace = torch.tensor(sel, dtype=torch.long, device=device) if sel else None
        L, R = self.runtime.n_layers, len(ids)
        self._q = query.new_empty((L, R, *query.shape[1:]))
        self._k = key.new_empty((L, R, *key.shape[1:]))
        self._v = key.new_empty((L, R, *key.shape[1:]))
        self._caches = [None] * L
        return StepPlan(ids, row_t, qsl.index_select(0, row_t).long(), blocks, valid, lens, replace, prefill,
                        set(rows.values()))
