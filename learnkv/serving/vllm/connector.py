"""`LearnKVConnector`: the KV connector that carries eviction between vLLM's scheduler and its worker.

Load it with ``--kv-transfer-config '{"kv_connector": "LearnKVConnector", "kv_connector_module_path":
"learnkv.serving.vllm.connector", "kv_role": "kv_both", "kv_connector_extra_config": {...}}'``; the extra config takes
the keys of `learnkv.serving.config.ServingConfig` and overrides ``LEARNKV_*`` variables. Everything here uses the
connector API (``KVConnectorBase_V1``, official, marked experimental), vLLM 0.33:

- scheduler half, ``build_connector_meta``: for every scheduled request it tracks, the number of new tokens, whether
  they complete the prompt, its per-request budget (``vllm_xargs={"learnkv_budget": N, "learnkv_enable": 0/1}``) and
  the physical slot of its newest token (from ``KVCacheManager.get_block_ids``), which lets the worker find the
  request's row in the batch without reading the model runner's input batch (`paged.row_requests`);
- worker half: ``bind_connector_metadata`` starts the step in the runtime, the ``CUSTOM`` backend calls `attend` per
  layer, ``wait_for_save`` (once per step, after the forward) asks the runtime which blocks to free and, in evict
  mode, marks them in the worker's evicted-block mask before the next forward; ``build_connector_worker_meta``
  sends the decisions and their host-time overhead back;
- scheduler half, ``update_connector_output``: shadow mode logs the decisions; evict mode hands them to
  `manager.EvictableFullAttentionManager.evict_blocks`, which frees the blocks (the mask was set first, so a freed
  block is never read again by its old request).

Not tracked (decode as stock vLLM): requests with a prefix-cache hit (the runtime never saw the hit tokens' attention)
and requests resumed after preemption (recomputed from scratch; their runtime state is dropped).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from learnkv.serving.config import merge_config
from learnkv.serving.runtime import runtime_for
from learnkv.serving.vllm import compat, hooks
from learnkv.serving.vllm.paged import masked_paged_attention, row_requests

logger = logging.getLogger("learnkv.serving")
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class LearnKVMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one per step."""

    new: dict[str, int] = field(default_factory=dict)  # request -> budget (tokens)
    steps: dict[str, tuple[int, bool, int]] = field(default_factory=dict)  # request -> (new tokens, final, last slot)
    finished: list[str] = field(default_factory=list)


@dataclass
class LearnKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one per step: (request, logical blocks, resident tokens, budget, cacheable blocks)."""

    decisions: list[tuple[str, list[int], int, int, int]] = field(default_factory=list)
    overhead_s: float = 0.0

    def aggregate(self, other):
        # one worker only (tensor and pipeline parallelism are refused), so nothing to merge
        return LearnKVWorkerMetadata(self.decisions + other.decisions, self.overhead_s + other.overhead_s)


class LearnKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        compat.check_version(vllm.__version__)
        self.config = merge_config(self._kv_transfer_config.kv_connector_extra_config)
        if self.config is None:
            raise RuntimeError("LearnKVConnector needs a scorer: LEARNKV_SCORER or kv_connector_extra_config.scorer")
        compat.refuse(vllm_config, self.config.mode)
        block_size = vllm_config.cache_config.block_size
        if block_size != self.config.block_size:
            raise RuntimeError(f"learnkv block_size {self.config.block_size} differs from vLLM's --block-size {block_size}")
        hf = vllm_config.model_config.hf_config
        device = "cpu" if role == KVConnectorRole.SCHEDULER else torch.device("cuda", torch.cuda.current_device())
        # both halves load and check the artifact: a wrong version, checksum or model stops the engine at start-up
        self.runtime = runtime_for(self.config, n_layers=hf.num_hidden_layers, n_kv_heads=hf.num_key_value_heads,
                                   served_model=vllm_config.model_config.model, device=device)
        self.evict = self.config.mode == "evict"
        # scheduler half
        self.prompt_len: dict[str, int] = {}
        self.finished: list[str] = []
        self.log = open(self.config.log, "a") if self.config.log and role == KVConnectorRole.SCHEDULER else None
        # worker half
        self.evicted: dict[str, set[int]] = {}
        self.last_slots: dict[str, int] = {}
        self.rows: dict[int, str] | None = None
        self.observed = 0
        self.decisions: list = []
        self.overhead_s = 0.0
        if role == KVConnectorRole.WORKER:
            hooks.set_worker(self)

    # -- scheduler half --------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False  # loads nothing from outside

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        meta = LearnKVMetadata(finished=self.finished)
        self.finished = []
        computed = {}
        for req in scheduler_output.scheduled_new_reqs:
            extra = (req.sampling_params.extra_args or {}) if req.sampling_params is not None else {}
            if req.num_computed_tokens > 0 or str(extra.get("learnkv_enable", 1)) in ("0", "false", "False"):
                continue  # prefix-cache hit or opted out: stock decoding
            self.prompt_len[req.req_id] = len(req.prompt_token_ids or ())
            meta.new[req.req_id] = int(extra.get("learnkv_budget", self.config.budget))
            computed[req.req_id] = 0
        cached = scheduler_output.scheduled_cached_reqs
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
            if rid in cached.resumed_req_ids and rid in self.prompt_len:
                del self.prompt_len[rid]  # preempted and recomputed: its runtime state is stale
                meta.finished.append(rid)
            computed.setdefault(rid, n)
        bs = self.config.block_size
        for rid, n_new in scheduler_output.num_scheduled_tokens.items():
            if rid not in self.prompt_len:
                continue
            last = computed[rid] + n_new - 1
            blocks = self._kv_cache_manager.get_block_ids(rid)[0]
            meta.steps[rid] = (n_new, last + 1 >= self.prompt_len[rid], blocks[last // bs] * bs + last % bs)
        return meta

    def request_finished(self, request, block_ids):
        if self.prompt_len.pop(request.request_id, None) is not None:
            self.finished.append(request.request_id)
        return False, None

    def update_connector_output(self, connector_output):
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, LearnKVWorkerMetadata):
            return
        manager = self._kv_cache_manager.coordinator.single_type_managers[0] if self.evict else None
        for rid, blocks, resident, budget, cacheable in meta.decisions:
            freed = manager.evict_blocks(rid, blocks, cacheable) if manager is not None and blocks else 0
            if blocks or self.log is not None:
                self._log({"request": rid, "mode": self.config.mode, "blocks": blocks, "freed": freed,
                           "resident_tokens": resident, "budget": budget, "overhead_s": meta.overhead_s})

    def _log(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        else:
            logger.info("learnkv %s", json.dumps(record))

    # -- worker half -----------------------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        for rid in meta.finished:
            self.runtime.finish(rid)
            self.evicted.pop(rid, None)
        for rid, budget in meta.new.items():
            self.runtime.add_request(rid, budget)
            self.evicted[rid] = set()
        steps = {rid: step for rid, step in meta.steps.items() if rid in self.runtime.requests}
        for rid, (n_new, final, _) in steps.items():
            self.runtime.begin_step(rid, n_new, final)
        self.last_slots = {rid: slot for rid, (_, _, slot) in steps.items()}
        self.rows, self.observed = None, 0

    def attend(self, impl, layer, query, key, value, kv_cache, attn_metadata, output) -> None:
        """Called by the backend after the stock kernel, once per layer: show the runtime every tracked row."""
        if not self.last_slots:
            return
        t0 = time.perf_counter()
        if self.rows is None:
            self.rows = row_requests(attn_metadata.slot_mapping, attn_metadata.query_start_loc, self.last_slots)
        layer_idx = int(_LAYER.search(layer.layer_name).group(1))
        kv = kv_cache.transpose(1, 2)  # [num_blocks, bs, H, 2 * D], as the Triton backend reads it
        key_cache, value_cache = kv.split(impl.head_size, dim=-1)
        qsl = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        for row, rid in self.rows.items():
            lo, hi = qsl[row], qsl[row + 1]
            n_blocks = attn_metadata.block_table.shape[1]
            mask = torch.zeros(n_blocks, dtype=torch.bool, device=query.device)
            mask[list(b for b in self.evicted[rid] if b < n_blocks)] = True
            out, probs = masked_paged_attention(query[lo:hi], key_cache, value_cache, attn_metadata.block_table[row],
                                                seq_lens[row], mask, impl.scale)
            if self.evict and self.evicted[rid]:
                output[lo:hi].copy_(out.reshape(output[lo:hi].shape))
            self.runtime.observe(rid, layer_idx, probs, key[lo:hi].transpose(0, 1), value[lo:hi].transpose(0, 1))
        self.observed += 1
        self.overhead_s += time.perf_counter() - t0

    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None  # the backend shows the runtime the attention; nothing is saved anywhere

    def wait_for_save(self):
        if not self.last_slots:
            return
        if self.observed == 0:
            raise RuntimeError("learnkv: no attention was observed; start vLLM with --attention-backend CUSTOM")
        t0 = time.perf_counter()
        seen = set((self.rows or {}).values())
        for rid in set(self.last_slots) - seen:  # not found in the batch: stop tracking rather than guess
            self.runtime.finish(rid)
            self.evicted.pop(rid, None)
        tracked = [rid for rid in self.last_slots if rid in seen]
        for d in self.runtime.decide(tracked):
            if self.evict:
                self.evicted[d.req_id].update(d.blocks)  # masked from the next forward on, before the block is freed
            self.decisions.append((d.req_id, d.blocks, d.resident_tokens, d.budget,
                                   self.runtime.cacheable_blocks(d.req_id)))
        self.last_slots = {}
        self.overhead_s += time.perf_counter() - t0

    def build_connector_worker_meta(self):
        if not self.decisions:
            return None
        meta = LearnKVWorkerMetadata(self.decisions, self.overhead_s)
        self.decisions, self.overhead_s = [], 0.0
        return meta
