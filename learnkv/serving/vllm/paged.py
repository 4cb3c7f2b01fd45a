"""Pure-torch pieces of the adapter that need no vLLM, tested on CPU: attention over one request's paged KV with
evicted blocks masked out (positions untouched; `masked_paged_attention`, the reference), the same for every
decoding request and layer at once over gathered resident blocks (`resident_blocks`, `block_attention`,
`block_output`, what the plugin runs), and mapping the engine's batch rows to request ids.

The reference's layout is token-major, as vLLM's Triton backend sees it: ``key_cache`` / ``value_cache``
``[num_blocks, bs, H, D]``; a request's ``block_row`` lists its physical blocks in logical order; its tokens
``[0, seq_len)`` sit at logical slots.
"""

from __future__ import annotations

import torch
from torch import Tensor


def resident_slots(block_row: Tensor, seq_len: int, evicted: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Physical slots and logical positions of a request's resident tokens, ascending.

    Parameters
    ----------
    block_row : Tensor
        ``[N]`` int physical block ids in logical order (at least ``ceil(seq_len / bs)`` entries).
    evicted : Tensor
        ``[N]`` bool, True for evicted logical blocks (the mask the decode attention honours).
    """
    n_blocks = -(-seq_len // block_size)
    keep = (~evicted[:n_blocks]).nonzero().flatten()
    pos = (keep[:, None] * block_size + torch.arange(block_size, device=keep.device)).flatten()
    pos = pos[pos < seq_len]
    slots = block_row[pos // block_size].long() * block_size + pos % block_size
    return slots, pos


def masked_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_row: Tensor, seq_len: int,
                           evicted: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of one request's ``q`` newest tokens over its resident (non-evicted) tokens.

    Parameters
    ----------
    query : Tensor
        ``[q, Hq, D]`` the queries of tokens ``seq_len - q .. seq_len - 1``; query head ``h * G + g`` uses KV head h.
    key_cache, value_cache : Tensor
        ``[num_blocks, bs, H, D]``.

    Returns
    -------
    tuple of Tensor
        Output ``[q, Hq, D]`` and the probabilities ``[H, G, q, T]`` over the resident tokens (what
        `learnkv.serving.runtime.ServingRuntime.observe` takes), both from fp32 softmax as in `learnkv.attention`.
    """
    q, Hq, D = query.shape
    bs, H = key_cache.shape[1], key_cache.shape[2]
    G = Hq // H
    slots, pos = resident_slots(block_row, seq_len, evicted, bs)
    k = key_cache.reshape(-1, H, D)[slots].transpose(0, 1)  # [H, T, D]
    v = value_cache.reshape(-1, H, D)[slots].transpose(0, 1)
    qh = query.transpose(0, 1).reshape(H, G * q, D)  # [H, G*q, D]
    scores = (torch.matmul(qh, k.transpose(-1, -2).to(qh.dtype)) * scale).view(H, G, q, -1)
    q_pos = torch.arange(seq_len - q, seq_len, device=pos.device)
    allowed = pos[None, :] <= q_pos[:, None]  # [q, T]
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(probs.to(v.dtype).view(H, G * q, -1), v).view(H, G, q, D)
    return out.permute(2, 0, 1, 3).reshape(q, Hq, D), probs


def row_requests(slot_mapping: Tensor, query_start_loc: Tensor, last_slots: dict[str, int]) -> dict[int, str]:
    """Batch row -> request id, by the slot each request's newest scheduled token is written to.

    The scheduler knows every request's blocks and token count, so it knows that slot; a slot being written
    belongs to exactly one request. This needs no access to the worker's (reordered) input batch.
    """
    ends = query_start_loc[1:].long() - 1
    written = slot_mapping[ends].tolist()
    by_slot = {slot: rid for rid, slot in last_slots.items()}
    return {row: by_slot[s] for row, s in enumerate(written) if s in by_slot}


def resident_blocks(block_table: Tensor, seq_lens: Tensor, evicted: Tensor, block_size: int
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Every decoding request's resident blocks, batched: which physical blocks to read, and which columns count.

    Parameters
    ----------
    block_table : Tensor
        ``[R, MB]`` int physical block ids in logical order, one row per request (the engine's rows).
    seq_lens : Tensor
        ``[R]`` tokens written so far, this step's included.
    evicted : Tensor
        ``[R, MB]`` bool, True for evicted logical blocks.

    Returns
    -------
    tuple of Tensor
        ``blocks [R, NB]`` the resident blocks' physical ids in ascending logical order (padded with the row's
        first entry), ``valid [R, NB * bs]`` bool for the columns that hold a resident token, and ``lens [R]``
        the resident token count. Only the newest block may be partial, and it is always resident (the recent
        window), so each row's resident tokens are a prefix of its columns.
    """
    R, MB = block_table.shape
    n_blocks = (seq_lens.long() + block_size - 1) // block_size
    logical = torch.arange(MB, device=block_table.device)
    resident = ~evicted[:, :MB] & (logical[None, :] < n_blocks[:, None])
    count = resident.sum(1)
    NB = max(int(count.max()), 1) if R else 1
    order = torch.sort((~resident).to(torch.int8), dim=1, stable=True).indices[:, :NB]  # resident first, ascending
    blocks = block_table.long().gather(1, order)
    lens = count * block_size - (n_blocks * block_size - seq_lens.long())
    valid = torch.arange(NB * block_size, device=block_table.device)[None, :] < lens[:, None]
    return blocks, valid, lens


def block_attention(query: Tensor, keys: Tensor, valid: Tensor, scale: float) -> Tensor:
    """One new query per request over its resident tokens, every request (and layer) at once, fp32 softmax.

    Parameters
    ----------
    query : Tensor
        ``[..., R, Hq, D]``, query head ``h * G + g`` on KV head ``h`` (a leading layer axis is allowed).
    keys : Tensor
        ``[..., R, NB, H, D, bs]`` the resident blocks' keys, transposed per block (`layouts` readers).
    valid : Tensor
        ``[R, NB * bs]`` bool, the columns holding resident tokens (the query's own token included).

    Returns
    -------
    Tensor
        ``[..., R, H, G, NB * bs]`` float32 probabilities in token order, zero on invalid columns.
    """
    *lead, R, NB, H, D, bs = keys.shape
    Hq = query.shape[-2]
    q = query.reshape(*lead, R, 1, H, Hq // H, D).float()
    scores = torch.matmul(q, keys.float())  # [..., R, NB, H, G, bs]: one small matmul per block
    scores = scores.movedim(-4, -2).reshape(*lead, R, H, Hq // H, NB * bs) * scale
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def block_output(probs: Tensor, values: Tensor) -> Tensor:
    """Attention output ``[..., R, Hq, D]`` of ``probs [..., R, H, G, NB * bs]`` over the resident blocks'
    ``values [..., R, NB, H, bs, D]``."""
    *lead, R, NB, H, bs, D = values.shape
    G = probs.shape[-2]
    p = probs.reshape(*lead, R, H, G, NB, bs).movedim(-2, -4)  # [..., R, NB, H, G, bs]
    out = torch.matmul(p, values.float()).sum(dim=-4)  # [..., R, H, G, D]
    return out.reshape(*lead, R, H * G, D)
