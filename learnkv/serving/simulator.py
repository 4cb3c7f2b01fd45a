"""A paged KV cache engine in miniature: the serving runtime driven the way vLLM would drive it, on CPU.

`PagedSimulator` decodes several requests over one shared pool of fixed-size blocks (block 0 is the null block,
as in vLLM), with a block table per request. Positions are never rewritten: an evicted block's table entry is
swapped for the null block and its physical block goes back to the free list, and attention reads only the
request's non-null blocks (the torch reference of tier B's evicted-block mask). After every engine step the
runtime (`learnkv.serving.runtime.ServingRuntime`) is shown each request's attention and new keys/values, and
answers which logical blocks to free. The prefix-cache rule is simulated too: a full block is published only if
it was written before the request's first eviction.

Under the runtime's ``pyramid`` allocation each layer has its own pool and block table (what vLLM would need to
hold per-layer budgets: one KV-cache group per layer, which stock vLLM does not form for a standard decoder), and a
layer frees the blocks the runtime's `Decision.layer_blocks` names for it.

The model is any Hugging Face causal LM run through learnkv's attention function (`learnkv.attention`), so the
attention a request sees here is computed by the same code as in the decode loop. Needs transformers.

Shapes: H KV heads, D head dim, bs block size, q new tokens, T resident tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from learnkv import attention
from learnkv.decode import call_model
from learnkv.serving.vllm import compat

NULL_BLOCK = 0


class BlockPool:
    """Physical blocks ``1..num_blocks-1`` (block 0 is the shared null block) with a free list."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a pool needs the null block and at least one more, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, 0, -1))  # pop() hands out the lowest id first

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("out of KV blocks")
        return self.free.pop()

    def release(self, block: int) -> None:
        if block == NULL_BLOCK or block in self.free:
            raise RuntimeError(f"block {block} freed twice or is the null block")
        self.free.append(block)

    @property
    def n_free(self) -> int:
        return len(self.free)


@dataclass
class SimRequest:
    """A request in flight: its block table, tokens and what happened to it."""

    req_id: str
    prompt: Tensor  # [L] token ids
    max_new_tokens: int
    table: list[int] = field(default_factory=list)  # logical block -> physical block (NULL_BLOCK once evicted)
    tables: list[list[int]] = field(default_factory=list)  # pyramid: one table per layer (``table`` unused)
    n_tokens: int = 0  # tokens written to the cache
    tokens: list[int] = field(default_factory=list)  # generated token ids
    evicted_per_step: list[list[int]] = field(default_factory=list)  # logical blocks freed after each forward
    published: int = 0  # leading full blocks published to the (simulated) prefix cache
    peak_blocks: int = 0  # most physical blocks held at once (within a step, before eviction; pyramid: layer-blocks)
    held_per_step: list[list[int]] = field(default_factory=list)  # blocks each layer holds after each step
    done: bool = False


class _PagedLayer(DynamicLayer):
    """One layer of one request: writes new K/V into the pool, returns the resident (non-null) blocks' K/V."""

    def __init__(self, layer_idx: int, owner: "_RequestCache"):
        super().__init__()
        self.layer_idx, self.owner = layer_idx, owner
        self.positions: Tensor | None = None  # [1, H, T] positions of the resident slots
        self.new_keys = self.new_values = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        sim = self.owner.sim
        pos = self.owner.step_positions[0]  # [q]
        k_pool, v_pool = sim.k_pool[self.layer_idx], sim.v_pool[self.layer_idx]
        table = self.owner.table(self.layer_idx)
        blocks = torch.tensor([table[p // sim.block_size] for p in pos.tolist()])
        offsets = pos % sim.block_size
        k_pool[blocks, :, offsets] = key_states[0].transpose(0, 1).to(k_pool.dtype)
        v_pool[blocks, :, offsets] = value_states[0].transpose(0, 1).to(v_pool.dtype)
        self.new_keys, self.new_values = key_states[0], value_states[0]  # [H, q, D]
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        self.gather(int(pos[-1]) + 1)
        return self.keys, self.values

    def gather(self, n_tokens: int) -> None:
        """Resident K/V in logical order: every non-null block, the last one cut at ``n_tokens``."""
        sim = self.owner.sim
        bs, table = sim.block_size, self.owner.table(self.layer_idx)
        logical = [i for i, b in enumerate(table) if b != NULL_BLOCK and i * bs < n_tokens]
        phys = torch.tensor([table[i] for i in logical])
        pos = torch.cat([torch.arange(i * bs, min((i + 1) * bs, n_tokens)) for i in logical])
        slots = torch.cat([torch.arange(len(range(i * bs, min((i + 1) * bs, n_tokens)))) + j * bs
                           for j, i in enumerate(logical)])
        k = sim.k_pool[self.layer_idx][phys]  # [nb, H, bs, D]
        v = sim.v_pool[self.layer_idx][phys]
        H, D = k.shape[1], k.shape[3]
        self.keys = k.transpose(0, 1).reshape(H, -1, D)[:, slots][None]
        self.values = v.transpose(0, 1).reshape(H, -1, D)[:, slots][None]
        self.positions = pos[None, None, :].expand(1, H, -1)


class _RequestCache(Cache):
    """The transformers `Cache` for one request's forward pass; also the ``learnkv_cache`` the attention reads."""

    def __init__(self, sim: "PagedSimulator", req: SimRequest):
        super().__init__(layers=[_PagedLayer(i, self) for i in range(sim.n_layers)])
        self.sim, self.req = sim, req
        self.policy = sim.runtime.policy  # the attention function reads how to hand attention over
        self.step_positions: Tensor | None = None

    def table(self, layer_idx: int) -> list[int]:
        """The block table ``layer_idx`` reads: the request's one table, or the layer's own (``pyramid``)."""
        return self.req.tables[layer_idx] if self.req.tables else self.req.table

    def layer_positions(self, layer_idx: int) -> Tensor:
        return self.layers[layer_idx].positions

    def gather_all(self, n_tokens: int) -> None:
        """Re-read every layer's resident blocks (after an eviction), so the cache length matches the decode loop's."""
        for layer in self.layers:
            layer.gather(n_tokens)

    def observe(self, layer_idx: int, attn: Tensor | None = None, attn_sum=None, attn_sq_sum=None) -> None:
        layer = self.layers[layer_idx]
        # attn [1, H, G, q, T]: every query row (the learned policy observes every prefill row)
        self.sim.runtime.observe(self.req.req_id, layer_idx, attn[0], layer.new_keys, layer.new_values)


class PagedSimulator:
    """Decode requests over a shared paged KV cache, evicting whole blocks as the runtime decides.

    Parameters
    ----------
    model : PreTrainedModel
        A causal LM (greedy decoding; its attention implementation is switched to "learnkv").
    runtime : ServingRuntime
        The serving core; its block size is the pool's.
    num_blocks : int
        Physical blocks in the pool, the null block included.
    """

    def __init__(self, model, runtime, num_blocks: int):
        attention.install(model)
        cfg = model.config
        why = compat.architecture_refusal(cfg)  # the same rule as the vLLM plugin: one full-attention cache per layer
        if why is not None:
            raise ValueError(f"PagedSimulator cannot serve {type(model).__name__}: {why}")
        self.model, self.runtime = model, runtime
        self.block_size = runtime.block_size
        self.n_layers = cfg.num_hidden_layers
        H = cfg.num_key_value_heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, H, self.block_size, D)
        self.k_pool = [torch.zeros(shape, dtype=dtype) for _ in range(self.n_layers)]
        self.v_pool = [torch.zeros(shape, dtype=dtype) for _ in range(self.n_layers)]
        self.per_layer = getattr(runtime, "allocation", "uniform") == "pyramid"
        self.pool = None if self.per_layer else BlockPool(num_blocks)
        self.pools = [BlockPool(num_blocks) for _ in range(self.n_layers)] if self.per_layer else []  # pyramid
        self.requests: dict[str, SimRequest] = {}
        self.caches: dict[str, _RequestCache] = {}
        self.published: set[tuple[str, int]] = set()  # (request, logical block) in the simulated prefix cache

    def add_request(self, req_id: str, prompt: Tensor, max_new_tokens: int, budget: int | None = None) -> None:
        self.runtime.add_request(req_id, budget)
        req = SimRequest(req_id, prompt.reshape(-1), max_new_tokens)
        if self.per_layer:
            req.tables = [[] for _ in range(self.n_layers)]
        self.requests[req_id] = req
        self.caches[req_id] = _RequestCache(self, req)

    def abort(self, req_id: str) -> None:
        """Drop a request at any point: its blocks return to the pool and the runtime forgets it."""
        self._release(self.requests.pop(req_id))
        self.caches.pop(req_id)

    def _release(self, req: SimRequest) -> None:
        for pool, table in zip(self.pools, req.tables):
            for b in table:
                if b != NULL_BLOCK:
                    pool.release(b)
        req.tables = [[NULL_BLOCK] * len(t) for t in req.tables]
        for b in req.table:
            if b != NULL_BLOCK:
                self.pool.release(b)
        req.table = [NULL_BLOCK] * len(req.table)
        self.runtime.finish(req.req_id)

    def step(self) -> None:
        """One engine step: every live request runs one forward pass (its prefill, or one token), then one
        batched runtime decision frees blocks."""
        live = [r for r in self.requests.values() if not r.done]
        for req in live:
            ids = req.prompt if req.n_tokens == 0 else torch.tensor(req.tokens[-1:])
            self._forward(req, ids)
        for d in self.runtime.decide([r.req_id for r in live]):
            req = self.requests[d.req_id]
            if self.per_layer:  # each layer frees what it dropped; else every layer frees the same blocks
                per_table = zip(self.pools, req.tables, d.layer_blocks)
            else:
                per_table = [(self.pool, req.table, d.blocks)]
            for pool, table, blocks in per_table:
                for block in blocks:
                    pool.release(table[block])
                    table[block] = NULL_BLOCK
            req.evicted_per_step.append(d.blocks)
            req.held_per_step.append([len(self.resident_blocks(req.req_id, layer)) for layer in range(self.n_layers)])
            self._publish(req)
            if d.blocks or (self.per_layer and any(d.layer_blocks)):
                self.caches[req.req_id].gather_all(req.n_tokens)
            if len(req.tokens) >= req.max_new_tokens:
                req.done = True
                self._release(req)

    def run(self) -> dict[str, SimRequest]:
        while any(not r.done for r in self.requests.values()):
            self.step()
        return self.requests

    def _forward(self, req: SimRequest, ids: Tensor) -> None:
        q = ids.numel()
        for pool, table in zip(self.pools, req.tables) if self.per_layer else [(self.pool, req.table)]:
            while len(table) * self.block_size < req.n_tokens + q:  # allocate before the forward, as vLLM does
                table.append(pool.allocate())
        held = sum(b != NULL_BLOCK for table in (req.tables or [req.table]) for b in table)
        req.peak_blocks = max(req.peak_blocks, held)
        cache = self.caches[req.req_id]
        pos = torch.arange(req.n_tokens, req.n_tokens + q)[None]
        cache.step_positions = pos
        self.runtime.begin_step(req.req_id, q)
        with torch.no_grad():
            logits = call_model(self.model, cache, ids[None], pos)
        req.n_tokens += q
        req.tokens.append(int(logits[0].argmax()))

    def _publish(self, req: SimRequest) -> None:
        """Publish full blocks to the prefix cache, but never one written after the first eviction."""
        n = min(req.n_tokens // self.block_size, self.runtime.cacheable_blocks(req.req_id))
        for block in range(req.published, n):
            self.published.add((req.req_id, block))
        req.published = max(req.published, n)

    def resident_blocks(self, req_id: str, layer: int = 0) -> list[int]:
        """Logical blocks ``req_id`` holds (in ``layer``: under ``pyramid`` each layer has its own table)."""
        req = self.requests[req_id]
        return [i for i, b in enumerate(req.tables[layer] if req.tables else req.table) if b != NULL_BLOCK]
