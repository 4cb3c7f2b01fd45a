"""The vLLM adapter's torch parts, without vLLM (they run in the main tier): the paged-cache readers of both
backends, the start-up layout probe, the stacked per-layer caches, and the batched attention over resident blocks
against learnkv's per-request masked reference."""

import pytest
import torch

from learnkv.serving.vllm.layouts import CPULayout, TritonLayout, probe_cpu_layout, stack_layers
from learnkv.serving.vllm.paged import block_attention, block_output, masked_paged_attention, resident_blocks

H, D, BS = 2, 8, 4


def cpu_write(key, value, key_cache, value_cache, slots, isa):
    """The "vec" layout, written by hand: per (block, head) the keys transposed [D, bs], then the values [bs, D]."""
    nb, n_heads, bs, d = key_cache.shape
    kc = key_cache.reshape(nb, n_heads, -1)  # the chunk views: bs * D elements per (block, head) each
    vc = value_cache.reshape(nb, n_heads, -1)
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, bs)
        kc[b, :, torch.arange(d) * bs + o] = key[t]
        vc[b, :, o * d + torch.arange(d)] = value[t]


def token_major_write(key, value, key_cache, value_cache, slots, isa):
    """Keys not transposed: a layout the CPU reader must refuse."""
    nb, n_heads, bs, d = key_cache.shape
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, bs)
        key_cache[b, :, o] = key[t]
        value_cache[b, :, o] = value[t]


def test_cpu_layout_probe_accepts_the_vec_layout_and_refuses_another():
    layout = probe_cpu_layout(cpu_write, "vec", torch.float32, BS, H, D)
    assert isinstance(layout, CPULayout)
    with pytest.raises(RuntimeError, match="ISA 'amx'.*layout learnkv cannot read"):
        probe_cpu_layout(token_major_write, "amx", torch.float32, BS, H, D)


def paged(layout_name, n_blocks=12, seed=0):
    """A random paged cache in the backend's layout, and the same keys/values token-major ``[nb, bs, H, D]``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_blocks, BS, H, D, generator=gen)
    v = torch.randn(n_blocks, BS, H, D, generator=gen)
    if layout_name == "cpu":
        cache = torch.empty(n_blocks, H, BS, 2 * D)
        raw = cache.view(n_blocks, H, 2, BS * D)
        raw[:, :, 0] = k.permute(0, 2, 3, 1).reshape(n_blocks, H, D * BS)
        raw[:, :, 1] = v.transpose(1, 2).reshape(n_blocks, H, BS * D)
        return CPULayout(D), cache, k, v
    cache = torch.cat([k, v], dim=-1).transpose(1, 2).contiguous()  # [nb, H, bs, 2D]
    return TritonLayout(D), cache, k, v


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_readers_gather_whole_blocks(name):
    layout, cache, k, v = paged(name)
    blocks = torch.tensor([[3, 7, 1], [0, 11, 5]])
    keys, values = layout.gather(cache, blocks)  # [R, NB, H, D, bs], [R, NB, H, bs, D]
    assert torch.equal(keys, k[blocks].permute(0, 1, 3, 4, 2))
    assert torch.equal(values, v[blocks].transpose(2, 3))
    assert torch.equal(layout.gather_keys(cache, blocks), keys)
    stacked = stack_layers([cache, cache.clone()])
    assert stacked is None  # two allocations: gathered layer by layer
    pool = torch.stack([cache, cache + 1])
    stacked = stack_layers([pool[0], pool[1]])
    assert stacked is not None and torch.equal(layout.gather(stacked, blocks)[0][1], keys + 1)


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_batched_attention_over_resident_blocks_equals_the_masked_reference(name):
    """Three requests, evicted blocks, a partial newest block, two layers at once."""
    layout, cache, k, v = paged(name)
    gen = torch.Generator().manual_seed(1)
    table = torch.tensor([[4, 9, 2, 6, 0], [1, 3, 0, 0, 0], [8, 10, 11, 5, 7]])
    seq_lens = torch.tensor([15, 6, 20])
    evicted = torch.zeros(3, 5, dtype=torch.bool)
    evicted[0, 1] = evicted[2, 1] = evicted[2, 2] = True
    blocks, valid, lens = resident_blocks(table, seq_lens, evicted, BS)
    assert lens.tolist() == [11, 6, 12]
    G = 3
    query = torch.randn(2, 3, H * G, D, generator=gen)  # [L, R, Hq, D]
    stacked = torch.stack([cache, cache * 0.5])
    keys, values = layout.gather(stacked, blocks)
    probs = block_attention(query, keys, valid, D**-0.5)
    out = block_output(probs, values)
    for layer, scale_kv in enumerate((1.0, 0.5)):
        for r in range(3):
            ref, ref_probs = masked_paged_attention(query[layer, r][None], k * scale_kv, v * scale_kv, table[r],
                                                    int(seq_lens[r]), evicted[r], D**-0.5)
            assert torch.allclose(out[layer, r], ref[0], atol=1e-5)
            T = int(lens[r])
            assert torch.allclose(probs[layer, r, ..., :T], ref_probs[:, :, 0], atol=1e-6)
            assert not probs[layer, r, ..., T:].any()  # columns past the resident tokens
