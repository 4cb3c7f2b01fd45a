"""The decode-phase state of every request past its prompt, as one batch: one feature-tracker update per engine
step for all requests and all layers, instead of one per request and layer.

`DecodeBatch` stores what `learnkv.serving.runtime.ServingRuntime` keeps per request (positions, the
`learnkv.features.FeatureTracker` state, and each token's constants: key and value norms, and for a scorer with
content features its content term) stacked over layers and requests, tokens
**right-aligned**: a request with T resident tokens holds columns ``C - T .. C - 1`` of a width-C batch, in
ascending position, and positions -1 pad the left. Right alignment is what `FeatureTracker.update` assumes (the
step's new tokens are the last columns), so the batch calls it unchanged, once, with the layers and requests
flattened into its batch axis, and the numbers equal the per-request ones (padding columns take no part:
they are invisible to every statistic).

`FeatureTracker.update` takes one step number for the whole call, but requests entered decoding at different
engine steps. The batch therefore keeps one clock for all rows and stores ``f.last_high`` in clock units
(request step + the row's offset); only differences of steps enter the update, and `extract` converts back to
the request's own step before features are computed.

Torch only. Shapes: L layers, R rows (requests), H KV heads, G query heads per KV head, C columns, W the
tracker window, T a request's resident tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learnkv.features import FeatureTracker, group_mean_max

# what a token carries from its creation on, as state entries: key and value norms (features), and the content
# gate's term of a scorer that reads value vectors (`learnkv.scorer.model.Scorer.content_term`)
TOKEN_CONSTANTS = ("norm.k", "norm.v", "norm.c")
_REBASE = 1 << 20  # f.last_high is float32: rebase the clock long before 2**24 loses whole steps


class DecodeBatch:
    """Tracker state of the decoding requests, ``[L, R, H, C]`` per tensor (``f.win``: ``[L, R, H, W, C]``).

    Per engine step: `begin` for each request that writes a token, `observe` (per layer, several requests at
    once) or `observe_one` (one request and layer), then `fold`. Decisions read a request with `extract` and
    write the survivors back with `compact`.
    """

    def __init__(self, tracker: FeatureTracker, n_layers: int, device: torch.device):
        self.tracker, self.n_layers, self.device = tracker, n_layers, device
        self.rows: list[str] = []
        self.index: dict[str, int] = {}
        self.lens: list[int] = []  # resident tokens per row
        self.offset: list[int] = []  # clock - offset = the request's own step
        self.positions: Tensor | None = None  # [R, C] int64, -1 = padding
        self.next_pos: Tensor | None = None  # [R] int64, the position the row's next token gets
        self.state: dict[str, Tensor] = {}
        self.last_attn: Tensor | None = None  # [L, R, H, 2, C] the latest step's group mean and max, right-aligned
        # [L, R, C] True where a layer dropped the column's block while another layer holds it (the runtime's
        # pyramid allocation): the column is padding to that layer. None until a row has one
        self.dead: Tensor | None = None
        self.clock = 0
        self._stepping: list[str] = []
        # a step's observations; ``consts`` are the new token's constants in `TOKEN_CONSTANTS` order
        self._chunks: list[list] = [[] for _ in range(n_layers)]  # per layer: (ids, attn, consts, lens)
        self._single: list[dict] = [{} for _ in range(n_layers)]  # per layer: id -> (attn, consts)
        self._all = None  # every layer at once: (ids, attn [L, R, H, G, Tb], consts, lens)

    # -- membership --------------------------------------------------------------------------------------------

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.index

    @property
    def width(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def add(self, req_id: str, positions: Tensor, state: list[dict[str, Tensor]], n_tokens: int) -> None:
        """Move a request in after its prompt: ``positions [T]``, per layer the tracker state and norms
        (``[1, H, T]``, ``f.win`` ``[1, H, W, T]``) as the prefill left them; ``n_tokens`` written so far."""
        T = positions.shape[-1]
        stacked = {name: torch.cat([s[name] for s in state])[:, None] for name in state[0]}  # [L, 1, H, (W,) T]
        stacked["f.last_high"] = stacked["f.last_high"] + self.clock  # request step 0 == now
        self._grow(T)
        C = max(self.width, T)
        row_pos = torch.full((1, C), -1, dtype=torch.long, device=self.device)
        row_pos[0, C - T:] = positions.to(self.device)
        rows = {name: _right(t.to(self.device), C) for name, t in stacked.items()}
        if not self.rows:
            self.state, self.positions = rows, row_pos
            self.next_pos = torch.tensor([n_tokens], device=self.device)
        else:
            self.state = {name: torch.cat([self.state[name], rows[name]], dim=1) for name in self.state}
            self.positions = torch.cat([self.positions, row_pos])
            self.next_pos = torch.cat([self.next_pos, torch.tensor([n_tokens], device=self.device)])
        self.index[req_id] = len(self.rows)
        self.rows.append(req_id)
        self.lens.append(T)
        self.offset.append(self.clock)
        if self.dead is not None:
            self.dead = torch.cat([_right(self.dead, C, fill=False), self.dead.new_zeros(self.n_layers, 1, C)], 1)
        if self.last_attn is not None:  # the new row has no step yet: zeros until its first fold
            self.last_attn = torch.cat([self.last_attn, self.last_attn.new_zeros(self.last_attn[:, :1].shape)], 1)

    def remove(self, req_id: str) -> None:
        """Forget a request (finished, aborted, or no longer tracked); unknown ids are ignored."""
        i = self.index.pop(req_id, None)
        if i is None:
            return
        del self.rows[i], self.lens[i], self.offset[i]
        self.index = {rid: j for j, rid in enumerate(self.rows)}
        if req_id in self._stepping:
            self._stepping.remove(req_id)
        if not self.rows:
            self.positions = self.next_pos = self.last_attn = self.dead = None
            self.state = {}
            return
        keep = torch.tensor([j for j in range(len(self.rows) + 1) if j != i], device=self.device)
        self.state = {name: t.index_select(1, keep) for name, t in self.state.items()}
        self.positions, self.next_pos = self.positions[keep], self.next_pos[keep]
        self.last_attn = None if self.last_attn is None else self.last_attn.index_select(1, keep)
        self.dead = None if self.dead is None else self.dead.index_select(1, keep)

    def _grow(self, needed: int) -> None:
        """Make the batch at least ``needed`` columns wide (left-padding, so the tokens stay right-aligned)."""
        C = self.width
        if needed <= C or not self.rows:
            return
        new = needed + max(32, needed // 8)  # little slack: every step copies the whole width
        self.state = {name: _right(t, new) for name, t in self.state.items()}
        self.positions = _right(self.positions, new, fill=-1)
        self.last_attn = None if self.last_attn is None else _right(self.last_attn, new)
        self.dead = None if self.dead is None else _right(self.dead, new, fill=False)

    # -- one engine step ---------------------------------------------------------------------------------------

    def begin(self, req_id: str) -> None:
        """``req_id`` writes one token in the coming forward pass."""
        self._stepping.append(req_id)

    def observe(self, layer: int, req_ids: list[str], attn: Tensor, k_norm: Tensor, v_norm: Tensor,
                lens: Tensor | None = None, content: Tensor | None = None) -> None:
        """One layer's view of several decoding requests (the engine's batched path).

        Parameters
        ----------
        attn : Tensor
            ``[R', H, G, Tb]`` the new query's attention over each request's resident tokens in ascending
            position, **left-aligned** (request r's T_r tokens first, zeros after).
        k_norm, v_norm : Tensor
            ``[R', H]`` the new token's key and value norms.
        lens : Tensor, optional
            ``[R']`` the engine's T_r, checked against the runtime's own count at `fold`.
        content : Tensor, optional
            ``[R', H]`` the new token's content term (a scorer with content features; then always given).
        """
        self._chunks[layer].append((tuple(req_ids), attn, _consts(k_norm, v_norm, content), lens))

    def observe_all(self, req_ids: list[str], attn: Tensor, k_norm: Tensor, v_norm: Tensor,
                    lens: Tensor | None = None, content: Tensor | None = None) -> None:
        """Every layer's view of several decoding requests: `observe` with a leading layer axis on ``attn``
        (``[L, R', H, G, Tb]``) and the token's constants (``[L, R', H]``)."""
        self._all = (tuple(req_ids), attn, _consts(k_norm, v_norm, content), lens)

    def observe_one(self, layer: int, req_id: str, attn: Tensor, k_norm: Tensor, v_norm: Tensor,
                    content: Tensor | None = None) -> None:
        """One layer's view of one decoding request: ``attn [H, G, T]``, ``k_norm, v_norm`` (``content``) ``[H]``."""
        self._single[layer][req_id] = (attn, _consts(k_norm, v_norm, content))

    def fold(self) -> None:
        """Append this step's token to every stepping row and fold its attention into the tracker state."""
        ids = self._stepping
        if not ids:
            return
        attn, consts, ids, lens = self._assemble(ids)
        attn = group_mean_max(attn, dim=3)  # [L, S, H, 2, Tb]: the group mean and max, all the tracker reads
        rows = [self.index[rid] for rid in ids]
        new_lens = [self.lens[i] + 1 for i in rows]
        if lens is not None and lens.tolist() != new_lens:
            bad = next(rid for rid, a, b in zip(ids, lens.tolist(), new_lens) if a != b)
            raise RuntimeError(f"request {bad!r}: the engine shows attention over {dict(zip(ids, lens.tolist()))[bad]}"
                               f" resident tokens, the runtime holds {dict(zip(ids, new_lens))[bad]} after this step")
        self._grow(max(new_lens))
        C, L, S = self.width, self.n_layers, len(rows)
        H, G, Tb = attn.shape[2], attn.shape[3], attn.shape[4]
        # left-aligned [.., Tb] -> right-aligned [.., C]: column c of row s reads column c - (C - T_s)
        n = torch.tensor(new_lens, device=self.device)
        col = torch.arange(C, device=self.device)[None, :] - (C - n)[:, None]  # [S, C]
        pad = col < 0
        index = col.clamp(0, Tb - 1)[None, :, None, None, :].expand(L, S, H, G, C)
        right = torch.gather(attn.to(self.device), -1, index).masked_fill(pad[None, :, None, None, :], 0.0)
        everyone = rows == list(range(len(self.rows)))
        sel = None if everyone else torch.tensor(rows, device=self.device)
        take = (lambda t: t) if everyone else (lambda t: t.index_select(1, sel))  # noqa: E731
        state = {name: _shift(take(t)) for name, t in self.state.items() if not name.startswith("norm.")}
        if len(consts) != sum(name in self.state for name in TOKEN_CONSTANTS):
            raise RuntimeError("every decoding token needs the same constants as its request's prompt: key and value "
                               "norms, and a content term exactly when the scorer reads values")
        for name, c in zip(TOKEN_CONSTANTS, consts):
            state[name] = _shift(take(self.state[name]), c.float()[..., None])
        new_pos = self.next_pos if everyone else self.next_pos[sel]
        positions = _shift(self.positions if everyone else self.positions[sel], new_pos[:, None])
        self.clock += 1
        flat = {name: t.reshape(L * S, *t.shape[2:]) for name, t in state.items() if not name.startswith("norm.")}
        layer_pos = positions[None, :, None, :].expand(L, S, H, C)
        dead = None if self.dead is None else _shift(take(self.dead))
        if dead is not None:  # a layer's dropped columns are padding to it
            layer_pos = layer_pos.masked_fill(dead[:, :, None, :], -1)
        self.tracker.update(right.reshape(L * S, H, G, 1, C), layer_pos.reshape(L * S, H, C), 1, self.clock, flat)
        state.update({name: t.view(L, S, *t.shape[1:]) for name, t in flat.items()})
        if dead is not None:
            if everyone:
                self.dead = dead
            else:
                self.dead.index_copy_(1, sel, dead)
        if everyone:
            self.state, self.positions, self.last_attn = state, positions, right
            self.next_pos = self.next_pos + 1
        else:
            for name, t in state.items():
                self.state[name].index_copy_(1, sel, t)
            self.positions.index_copy_(0, sel, positions)
            self.next_pos.index_add_(0, sel, torch.ones_like(sel))
            if self.last_attn is None or self.last_attn.shape[-1] != C or self.last_attn.shape[3] != G:
                self.last_attn = right.new_zeros(L, len(self.rows), H, G, C)
            self.last_attn.index_copy_(1, sel, right)
        for i, new in zip(rows, new_lens):
            self.lens[i] = new
        self._stepping = []
        self._chunks = [[] for _ in range(self.n_layers)]
        self._single = [{} for _ in range(self.n_layers)]
        self._all = None
        if self.clock > _REBASE:
            self._rebase()

    def _assemble(self, ids: list[str]):
        """The step's observations as ``[L, S, H, G, Tb]`` attention and a tuple of ``[L, S, H]`` token constants,
        plus their order and lengths."""
        chunks = self._chunks
        if self._all is not None:
            if any(chunks) or any(self._single) or set(self._all[0]) != set(ids) or len(self._all[0]) != len(ids):
                raise RuntimeError("a step's decoding requests must be shown either all layers at once or per layer")
            all_ids, attn, consts, lens = self._all
            return attn, consts, list(all_ids), lens
        first = chunks[0][0][0] if len(chunks[0]) == 1 else None
        if first is not None and set(first) == set(ids) and len(first) == len(ids) and \
                all(len(c) == 1 and c[0][0] == first for c in chunks) and not any(self._single):
            # the engine's path: one chunk per layer, the same requests in the same order
            attn = torch.stack([c[0][1] for c in chunks])
            consts = tuple(torch.stack([c[0][2][k] for c in chunks]) for k in range(len(chunks[0][0][2])))
            return attn, consts, list(first), chunks[0][0][3]
        per_layer = []
        for layer in range(self.n_layers):
            seen = dict(self._single[layer])
            for cids, a, consts, lens in chunks[layer]:
                for j, rid in enumerate(cids):
                    T = a.shape[-1] if lens is None else int(lens[j])
                    seen[rid] = (a[j, ..., :T], tuple(c[j] for c in consts))
            missing = [rid for rid in ids if rid not in seen]
            if missing:
                raise RuntimeError(f"request {missing[0]!r}: layer {layer} was not observed this step; every layer "
                                   "must be observed before deciding")
            per_layer.append([seen[rid] for rid in ids])
        Tb = max(a.shape[-1] for a, _ in per_layer[0])
        attn = torch.stack([torch.stack([torch.nn.functional.pad(a, (0, Tb - a.shape[-1])) for a, _ in layer])
                            for layer in per_layer])
        n_consts = {len(c) for layer in per_layer for _, c in layer}
        if len(n_consts) != 1:
            raise RuntimeError("a step's decoding requests were observed with and without a content term")
        consts = tuple(torch.stack([torch.stack([c[k] for _, c in layer]) for layer in per_layer])
                       for k in range(n_consts.pop()))
        lens = torch.tensor([a.shape[-1] for a, _ in per_layer[0]])
        return attn, consts, list(ids), lens

    def _rebase(self) -> None:
        shift = min(self.offset)
        self.clock -= shift
        self.offset = [o - shift for o in self.offset]
        self.state["f.last_high"] = self.state["f.last_high"] - shift

    # -- decisions ---------------------------------------------------------------------------------------------

    def n_resident(self, req_id: str) -> int:
        return self.lens[self.index[req_id]]

    def extract(self, req_id: str) -> tuple[Tensor, dict[str, Tensor], Tensor, int]:
        """One request's resident tokens, layers on the batch axis, as the decode loop holds them per layer.

        Returns ``positions [L, H, T]`` (-1 where the layer dropped the token, `set_dead`), the state
        (``[L, H, T]``, ``f.win`` ``[L, H, W, T]``, norms included, ``f.last_high`` in the request's own steps), the
        latest attention's group mean and max ``[L, H, 2, 1, T]`` and the request's step. Contiguous copies, so
        reductions over them run exactly as over the decode loop's tensors.
        """
        i = self.index[req_id]
        T, C = self.lens[i], self.width
        state = {name: t[:, i, ..., C - T:].contiguous() for name, t in self.state.items()}
        state["f.last_high"] = state["f.last_high"] - self.offset[i]
        H = state["norm.k"].shape[1]
        positions = self.positions[i, C - T:][None, None, :].expand(self.n_layers, H, T).contiguous()
        if self.dead is not None:
            positions.masked_fill_(self.dead[:, i, None, C - T:], -1)
        attn = self.last_attn[:, i, ..., C - T:].unsqueeze(-2).contiguous()
        return positions, state, attn, self.clock - self.offset[i]

    def compact(self, req_id: str, keep: Tensor) -> None:
        """Keep only columns ``keep`` (``[K]`` ascending indices into the request's T resident tokens)."""
        i = self.index[req_id]
        T, C, K = self.lens[i], self.width, keep.numel()
        keep = keep.to(self.device)
        for name, t in self.state.items():
            kept = t[:, i, ..., C - T:].index_select(-1, keep)
            t[:, i, ..., :C - K] = 0
            t[:, i, ..., C - K:] = kept
        kept = self.positions[i, C - T:].index_select(0, keep)
        self.positions[i, :C - K] = -1
        self.positions[i, C - K:] = kept
        if self.dead is not None:
            kept = self.dead[:, i, C - T:].index_select(-1, keep)
            self.dead[:, i, :C - K] = False
            self.dead[:, i, C - K:] = kept
        self.lens[i] = K

    def set_dead(self, req_id: str, dead: Tensor) -> None:
        """``dead [L, T]``: which of the request's resident tokens each layer no longer holds (padding to it)."""
        if self.dead is None:
            if not bool(dead.any()):
                return
            self.dead = torch.zeros(self.n_layers, len(self.rows), self.width, dtype=torch.bool, device=self.device)
        i = self.index[req_id]
        self.dead[:, i, self.width - self.lens[i]:] = dead.to(self.device)

    def resident_positions(self, req_id: str) -> Tensor:
        i = self.index[req_id]
        return self.positions[i, self.width - self.lens[i]:]

    def bytes_per_token(self) -> int:
        """State bytes one resident token costs (positions included)."""
        R, C = len(self.rows), self.width
        per = sum(t.numel() // (R * C) * t.element_size() for t in self.state.values())
        dead = 0 if self.dead is None else self.n_layers * self.dead.element_size()  # pyramid's per-layer mask
        return per + self.positions.element_size() + dead


def _consts(k_norm: Tensor, v_norm: Tensor, content: Tensor | None) -> tuple[Tensor, ...]:
    """A new token's constants in `TOKEN_CONSTANTS` order."""
    return (k_norm, v_norm) if content is None else (k_norm, v_norm, content)


def _right(t: Tensor, width: int, fill: float = 0) -> Tensor:
    """Left-pad the last axis of ``t`` to ``width``."""
    pad = width - t.shape[-1]
    if pad <= 0:
        return t
    return torch.cat([t.new_full((*t.shape[:-1], pad), fill), t], dim=-1)


def _shift(t: Tensor, new: Tensor | None = None) -> Tensor:
    """Drop the leftmost (padding) column and append ``new`` (default zeros) on the right."""
    if new is None:
        new = t.new_zeros((*t.shape[:-1], 1))
    return torch.cat([t[..., 1:], new.to(t.dtype).expand(*t.shape[:-1], 1)], dim=-1)

