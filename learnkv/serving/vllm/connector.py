"""`LearnKVConnector`: the KV connector that carries eviction between vLLM's scheduler and its worker.

Load it with ``--kv-transfer-config '{"kv_connector": "LearnKVConnector", "kv_connector_module_path":
"learnkv.serving.vllm.connector", "kv_role": "kv_both", "kv_connector_extra_config": {...}}'``; the extra config takes
the keys of `learnkv.serving.config.ServingConfig` and overrides ``LEARNKV_*`` variables. Everything here uses the
connector API (``KVConnectorBase_V1``, official, marked experimental), vLLM 0.32 (CPU) and 0.33 (CUDA):

- scheduler half, ``build_connector_meta``: for every scheduled request it tracks, the number of new tokens, whether
  they complete the prompt, its per-request budget (``vllm_xargs={"learnkv_budget": N, "learnkv_enable": 0/1}``) and
  the physical slot of its newest token (from ``KVCacheManager.get_block_ids``), which lets the worker find the
  request's row in the batch without reading the model runner's input batch (`paged.row_requests`);
- worker half (`learnkv.serving.vllm.worker.WorkerHalf`): ``bind_connector_metadata`` starts the step, the learnkv
  attention backend shows it every layer, ``wait_for_save`` (after the forward) asks the runtime which blocks to
  free and masks them from the next forward on; ``build_connector_worker_meta`` sends the decisions and their
  host-time overhead back;
- scheduler half, ``update_connector_output``: logs the decisions; evict mode hands them to
  `manager.EvictableFullAttentionManager.evict_blocks`, which frees the blocks (the worker's mask was set first, so
  a freed block is never read again by its old request).

Not tracked (decode as stock vLLM): requests with a prefix-cache hit (the runtime never saw the hit tokens' attention)
and requests resumed after preemption (recomputed from scratch; their runtime state is dropped).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.platforms import current_platform

# imports inside functions: vLLM internals used only by the start-up checks, imported when the engine runs them

from learnkv.serving.config import merge_config
from learnkv.serving.runtime import runtime_for
from learnkv.serving.vllm import compat, hooks, layouts
from learnkv.serving.vllm.worker import WorkerHalf

logger = logging.getLogger("learnkv.serving")


@dataclass
class LearnKVMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one per step."""

    new: dict[str, int] = field(default_factory=dict)  # request -> budget (tokens)
    steps: dict[str, tuple[int, bool, int]] = field(default_factory=dict)  # request -> (new tokens, final, last slot)
    finished: list[str] = field(default_factory=list)


@dataclass
class LearnKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one per step: (request, logical blocks, resident tokens, budget, cacheable blocks,
    tokens written)."""

    decisions: list[tuple[str, list[int], int, int, int, int]] = field(default_factory=list)
    overhead_s: float = 0.0

    def aggregate(self, other):
        # one worker only (tensor and pipeline parallelism are refused), so nothing to merge
        return LearnKVWorkerMetadata(self.decisions + other.decisions, self.overhead_s + other.overhead_s)


class LearnKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        device_type = current_platform.device_type
        compat.check_version(vllm.__version__, device_type)
        self.config = merge_config(self._kv_transfer_config.kv_connector_extra_config)
        if self.config is None:
            raise RuntimeError("LearnKVConnector needs a scorer: LEARNKV_SCORER or kv_connector_extra_config.scorer")
        compat.refuse_model(vllm_config.model_config)  # one line naming the model, before the engine's own checks
        compat.refuse(vllm_config, self.config.mode, device_type, self.config.allocation)
        block_size = vllm_config.cache_config.block_size
        if block_size != self.config.block_size:
            raise RuntimeError(f"learnkv block_size {self.config.block_size} differs from vLLM's --block-size "
                               f"{block_size} (set LEARNKV_BLOCK_SIZE or kv_connector_extra_config.block_size)")
        _check_backend_registered(device_type)
        hf = vllm_config.model_config.hf_config
        device = torch.device("cpu" if role == KVConnectorRole.SCHEDULER else device_type)
        # both halves load and check the artifact: a wrong version, checksum or model stops the engine at start-up
        self.runtime = runtime_for(self.config, n_layers=hf.num_hidden_layers, n_kv_heads=hf.num_key_value_heads,
                                   served_model=vllm_config.model_config.model, device=device)
        self.evict = self.config.mode == "evict"
        self.device_type = device_type
        # scheduler half
        self.prompt_len: dict[str, int] = {}
        self.finished: list[str] = []
        self.log = open(self.config.log, "a") if self.config.log and role == KVConnectorRole.SCHEDULER else None
        # worker half
        self.worker: WorkerHalf | None = None
        self.decisions: list = []
        if role == KVConnectorRole.WORKER:
            head_size = vllm_config.model_config.get_head_size()
            layout = layouts.CPULayout(head_size) if device_type == "cpu" else layouts.TritonLayout(head_size)
            self.worker = WorkerHalf(self.runtime, layout, block_size, self.evict)
            hooks.set_worker(self.worker)

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
            if req.num_computed_tokens > 0 or str(extra.get("learnkv_enable", 1)).lower() in ("0", "false"):
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
        pool = self._kv_cache_manager.block_pool
        for rid, blocks, resident, budget, cacheable, n_tokens in meta.decisions:
            free_before = pool.get_num_free_blocks()
            freed = manager.evict_blocks(rid, blocks, cacheable) if manager is not None and blocks else 0
            if blocks or self.log is not None:
                held = self._kv_cache_manager.coordinator.single_type_managers[0].held_blocks(rid) \
                    if manager is not None else None
                self._log({"request": rid, "mode": self.config.mode, "blocks": blocks, "freed": freed,
                           "free_before": free_before, "free_after": pool.get_num_free_blocks(), "held_blocks": held,
                           "resident_tokens": resident, "budget": budget, "tokens": n_tokens,
                           "overhead_s": meta.overhead_s})

    def _log(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        else:
            logger.info("learnkv %s", json.dumps(record))

    # -- worker half -----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        """At start-up, once the caches exist: prove the CPU cache layout for the kernels vLLM chose."""
        if self.device_type != "cpu" or not kv_caches:
            return
        from vllm import _custom_ops as ops
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(self._vllm_config, Attention, list(kv_caches))
        isas = {getattr(layer, "isa", None) for layer in layers.values()}
        if len(isas) != 1 or None in isas:
            raise RuntimeError("learnkv: cannot tell which CPU attention kernels vLLM uses "
                               f"(ISA {sorted(map(str, isas))})")
        cache = next(iter(kv_caches.values()))
        _, n_heads, block_size, _ = cache.shape
        self.worker.layout = layouts.probe_cpu_layout(ops.cpu_attn_reshape_and_cache, isas.pop(), cache.dtype,
                                                      block_size, n_heads, self.worker.layout.head_size)

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        self.worker.begin(meta.new, meta.steps, meta.finished)

    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None  # the backend shows the runtime the attention; nothing is saved anywhere

    def wait_for_save(self):
        for d in self.worker.end():
            self.decisions.append((d.req_id, d.blocks, d.resident_tokens, d.budget,
                                   self.runtime.cacheable_blocks(d.req_id), d.n_tokens))

    def build_connector_worker_meta(self):
        if not self.decisions:
            return None
        meta = LearnKVWorkerMetadata(self.decisions, self.worker.overhead_s)
        self.decisions, self.worker.overhead_s = [], 0.0
        return meta


def _check_backend_registered(device_type: str) -> None:
    """The learnkv attention backend must be in vLLM's registry in this process: it is what shows the runtime the
    attention. The plugin registers it when LEARNKV_SCORER is in the environment."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from learnkv.serving.vllm.plugin import backend_for

    enum_name, path = backend_for(device_type)
    registered = getattr(AttentionBackendEnum, enum_name).get_path()
    if registered != path:
        raise RuntimeError(
            f"learnkv: vLLM's {enum_name} attention backend is {registered}, not learnkv's; the plugin registers it "
            "only when LEARNKV_SCORER is set in the environment of every vLLM process (kv_connector_extra_config "
            "alone is read too late)"
        )
