"""The cheaper R-KV redundancy and SnapKV pooling and window update (issue 43, item 2) keep the same tokens.

Each fast path is compared with the code it replaced, kept here verbatim as the reference: on parametrised shapes
(padding, near-duplicates, thresholds, kernel sizes, -0.0) the scores must be bit-identical, except R-KV's blockwise
redundancy (its column sums are another summation: the same zeroed entries, scores within relative 1e-6, the same
kept slots), and a decode on the tiny model must keep the same slots at every step of every layer with either
implementation.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from learnkv import kernels
from conftest import random_ids
from kernel_checks import one_drop_case
from learnkv import generate
from learnkv.policies import lazy, rkv, roco, snapkv
from learnkv.kernels.cpu import one_drop_rows, one_drop_victims
from learnkv.kernels.reference import protected_or_dead, protected_slots
from learnkv.policies.base import LayerView


def redundancy_before(keys, valid, threshold):
    """`learnkv.policies.rkv.redundancy` before the change (commit 45c09ad), verbatim."""
    B, H, T, _ = keys.shape
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    first = valid.int().argmax(dim=-1)
    n_valid = valid.sum(dim=-1).clamp_min(1)
    out = torch.empty(B, H, T, device=keys.device)
    for h in range(H):
        v = valid[:, h]
        cos = k[:, h] @ k[:, h].transpose(-1, -2)
        cos.diagonal(dim1=-2, dim2=-1).zero_()
        cos.masked_fill_(~v[:, :, None], 0.0).masked_fill_(~v[:, None, :], 0.0)
        near = (cos > threshold).flip(-1)
        last = T - 1 - near.view(torch.uint8).argmax(dim=-1)
        last = torch.where(near.any(dim=-1), last, first[:, h, None])
        del near
        cos.scatter_(-1, last[..., None], 0.0)
        mean = cos.sum(dim=1) / n_valid[:, h, None]
        out[:, h] = mean.masked_fill(~v, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return out


def redundancy_dense(keys: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """`learnkv.policies.rkv.redundancy` before it dropped the ``[B, T, T]`` matrix (commit 152dfe3), verbatim.

    ``[B, H, T]`` R-KV redundancy of each cached key (a distribution over the valid slots; 0 on padding).

    keys ``[B, H, T, D]``, valid ``[B, H, T]`` bool, threshold in [0, 1]. Peak memory: one ``[B, T, T]`` fp32
    cosine matrix and two bool masks of that size, one KV head at a time.

    Cost: the ``[B, T, T]`` matmul and five passes over its result (compare, flip, argmax, column sum, and the
    padding masks only where a row has padding); the row's "has a near-duplicate" test reads the one entry the
    argmax found instead of a sixth pass (``any``). The same bits as doing all of them (tests/test_rkv.py).
    """
    B, H, T, _ = keys.shape
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    first = valid.int().argmax(dim=-1)  # [B, H] the oldest cached slot (the source's fallback index 0)
    n_valid = valid.sum(dim=-1).clamp_min(1)
    padded = not bool(valid.all())  # one synchronisation per call; without padding the masks change nothing
    out = torch.empty(B, H, T, device=keys.device)
    for h in range(H):
        v = valid[:, h]
        cos = k[:, h] @ k[:, h].transpose(-1, -2)  # [B, T, T]
        cos.diagonal(dim1=-2, dim2=-1).zero_()
        if padded:
            cos.masked_fill_(~v[:, :, None], 0.0).masked_fill_(~v[:, None, :], 0.0)  # padding: 0, never near
        near = (cos > threshold).flip(-1)  # newest slot first
        found = near.view(torch.uint8).argmax(dim=-1, keepdim=True)  # the first True, or 0 if the row has none
        last = T - 1 - found[..., 0]  # the newest near-duplicate of each row
        last = torch.where(near.gather(-1, found)[..., 0], last, first[:, h, None])
        del near
        cos.scatter_(-1, last[..., None], 0.0)
        mean = cos.sum(dim=1) / n_valid[:, h, None]
        out[:, h] = mean.masked_fill(~v, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return out


def avg_pool_before(x, k):
    """SnapKV's pooling before the change: the pooling call."""
    B, H, n = x.shape
    return F.avg_pool1d(x.reshape(B * H, 1, n), kernel_size=k, stride=1, padding=k // 2)[..., :n].reshape(B, H, n)


def snapkv_update_before(self, view):
    """`SnapKV.update` before the in-place shift of a full window (commit 27bd051), verbatim."""
    rows = view.attn  # [B, H, W, T]; the cache zero-padded old rows for new slots (causally exact)
    window = view.state.get("window_attn")
    window = rows if window is None else torch.cat([window, rows], dim=2)
    view.state["window_attn"] = window[:, :, -self.obs_window :, :]


def rkv_update_before(self, view):
    """`RKV.update` before its window was kept among spare rows (commit 184d9d0), verbatim."""
    rows = view.attn  # [B, H, W, T]; the cache zero-pads old rows for new slots (causally exact)
    obs = view.state.get("obs_attn")
    obs = rows if obs is None else torch.cat([obs, rows], dim=2)
    view.state["obs_attn"] = obs[:, :, -self.obs_window :, :]


def roco_score_with_bool_masks(self, view):
    """`RoCo.score` before its float masks (commit ac1fd22), verbatim, with `lowest_first_with_bool_masks`."""
    st = view.state
    c = st["count"].clamp(min=1)
    mean = st["s1"] / c
    std = (st["s2"] / c - mean * mean).clamp(min=0).sqrt()
    # per row: E tokens to evict, scope = max(keep - r, E) with r = int(recent_ratio * keep)
    keep = view.keep_rows()
    scope_size = [max(k - int(self.recent_ratio * k), live - k, 0) for k, live in zip(keep, view.live_tokens())]
    out_of_scope = protected_or_dead(view.positions, self.n_sink, self.n_recent)
    std = std.masked_fill(out_of_scope, float("inf"))
    in_scope = lowest_first_with_bool_masks(std, scope_size) & ~out_of_scope
    return mean.masked_fill(~in_scope, float("inf"))


def lowest_first_with_bool_masks(values, sizes):
    """`roco.lowest_first` before its float masks (commit ac1fd22), verbatim (docstring aside)."""
    R, H, T = values.shape
    threshold = values.new_empty(R, H, 1)
    size = torch.tensor(sizes, device=values.device).view(R, 1, 1)
    if len(set(sizes)) == 1 and sizes[0] > 0:  # one budget for every row: one selection, no gathered copy
        threshold = values.kthvalue(min(sizes[0], T), dim=-1, keepdim=True).values
    for k in set(sizes) if len(set(sizes)) > 1 or sizes[0] == 0 else ():
        rows = [r for r, n in enumerate(sizes) if n == k]
        index = torch.tensor(rows, device=values.device)
        if k == 0:  # nothing chosen: below every value
            threshold[index] = float("-inf")
        else:
            threshold[index] = values[index].kthvalue(min(k, T), dim=-1, keepdim=True).values
    below = values < threshold
    tied = values == threshold
    room = size - below.sum(-1, keepdim=True)  # how many of the tied slots still fit, the lower slots first
    return below | (tied & (tied.cumsum(-1) <= room))


@pytest.mark.parametrize("R, H, T", [(1, 1, 1), (3, 2, 17), (8, 3, 130), (240, 3, 790)])
@pytest.mark.parametrize("statistics", ["continuous", "tied"])
def test_roco_score_with_float_masks_is_the_replaced_code(R, H, T, statistics):
    """RoCo's score with float masks: bit for bit the replaced code's (bool masks, ``masked_fill``), on statistics
    with dead slots (padding, evicted), rows of different budgets (one scope of none, some wider than a row's live
    slots), per-row sinks, and statistics that tie often (the scope's boundary among ties)."""
    from learnkv.policies.roco import RoCo

    g = torch.Generator().manual_seed(R * 10 + T)
    pos = torch.arange(T).expand(R, H, T).clone()
    pos[0, :, : T // 3] = -1
    pos[1 % R, :, 2::7] = -1
    mixed = []
    for trial in range(4):
        quantised = (lambda x: (x * 4).floor() / 4) if statistics == "tied" else (lambda x: x)  # noqa: E731
        count = (torch.rand(R, H, T, generator=g) * 40).floor() + 1
        s1 = quantised(torch.rand(R, H, T, generator=g) * count / T)
        state = {"s1": s1, "s2": quantised(s1 * s1 / count + torch.rand(R, H, T, generator=g) / T), "count": count}
        keep = [int(x) for x in torch.randint(0, T + 2, (R,), generator=g)]
        view = LayerView(layer=0, step=9, keys=None, values=None, positions=pos, n_new=1, attn=None, attn_sum=None,
                         attn_sq_sum=None, keep=keep, state=state)
        policy = RoCo(n_sink=[0, 4, 1][trial % 3], n_recent=[10, 0, 3, T][trial])
        ours, theirs = policy.score(view), roco_score_with_bool_masks(policy, view)
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), f"trial {trial}"
        mixed.append(bool((ours == float("inf")).any() and (ours < float("inf")).any()))
    assert any(mixed) or T == 1  # some trial had slots in scope and out of it


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (3, 2, 17), (8, 3, 130), (240, 3, 790)])
@pytest.mark.parametrize("statistics", ["continuous", "tied", "nan"])
def test_roco_victim_scores_drop_the_victim_of_the_full_scores(B, H, T, statistics):
    """RoCo's scores where the cache reads one victim a row (`LayerView.victims_only`, `roco.victim_scores`): the
    cache's selection keeps the same slots as with its full scores (`roco.scope_means`), by its one-drop marking and
    by its general selection, on rows with dead slots anywhere, each over its budget by one or not at all, with
    protected slots, statistics that tie (the scope's boundary and the lowest mean among ties) and NaN statistics.
    Rows whose lowest mean is out of scope are scored in full (bit for bit); the others hold the victim's mean alone;
    both kinds occur."""
    g = torch.Generator().manual_seed(B * 10 + T)
    kinds = set()
    for trial in range(4):
        _, pos, keep, live = one_drop_case(B, H, T, g, "random")
        count = (torch.rand(B, H, T, generator=g) * 40).floor() + 1
        if statistics == "tied":  # means and stds of three values each, exactly (sums of quarters)
            mean, std = (torch.randint(0, 3, (B, H, T), generator=g) / 4 for _ in range(2))
            s1, s2 = mean * count, (std * std + mean * mean) * count
        else:
            s1 = torch.rand(B, H, T, generator=g) * count / T
            s2 = s1 * s1 / count + torch.rand(B, H, T, generator=g) / T
        if statistics == "nan":  # the same slots of both sums, as a NaN attention makes them
            bad = torch.rand(B, H, T, generator=g) < 0.001
            s1[bad], s2[bad] = float("nan"), float("nan")
        policy = roco.RoCo(n_sink=[0, 4, 1, 0][trial], n_recent=[10, 0, 3, T][trial])
        views = [LayerView(layer=0, step=9, keys=None, values=None, positions=pos, n_new=1, keep=keep,
                           state={"s1": s1, "s2": s2, "count": count}, live=live, victims_only=alone)
                 for alone in (False, True)]
        full, alone = (policy.score(v) for v in views)
        kept = [kernels.select_keep(s, pos, keep, policy.n_sink, policy.n_recent, 1, live=live) for s in (full, alone)]
        assert torch.equal(*kept), f"trial {trial}: other slots kept"
        marked = [pos.clone(), pos.clone()]
        done = [kernels.mark_one_drop(s, p, keep, policy.n_sink, policy.n_recent, live)
                for s, p in zip((full, alone), marked)]
        assert done[0] == done[1] and torch.equal(*marked), f"trial {trial}: other victims marked"
        for f, a in zip(full.flatten(0, 1), alone.flatten(0, 1)):
            if torch.equal(f.view(torch.int32), a.view(torch.int32)):
                kinds.add("in full")
            else:
                assert int(a.isfinite().sum()) == 1 and float(a.min()) == float(f.min()), f"trial {trial}"
                kinds.add("the victim alone")
    assert kinds == {"in full", "the victim alone"} or B < 240


def lazy_update_with_bool_mask(self, view):
    """`LazyEviction.update` before its float mask (commit 4aac568), verbatim."""
    st, t = view.state, view.step
    if "ts" not in st:  # prompt tokens start at TS = 0, MRI = 0 (the code creates the state zero-filled)
        zeros = torch.zeros(view.positions.shape, dtype=torch.float32, device=view.positions.device)
        st["ts"], st["mri"] = zeros, zeros.clone()
    if t == 0:  # the prefill observes nothing
        return
    if view.n_new == 1 and kernels.use_triton(st["ts"], view.attn):
        # a decode step on the kernel path: TS and MRI in one fused in-place launch
        kernels.update_token_state(None, view.attn[:, :, -1, :], view.positions, t, 1, self.alpha,
                                   ts=st["ts"], mri=st["mri"])  # fmt: skip
        return
    # in place, so the cache's buffers stay the state's (no copy at the next append)
    ts = st["ts"]
    ts[..., -view.n_new :] = t - 1  # a new token starts as if last seen one step ago
    prev = ts.clone()
    ts.masked_fill_(view.attn[:, :, -1, :] >= self.alpha, float(t))
    torch.maximum(st["mri"], ts - prev, out=st["mri"])


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (2, 3, 17), (240, 3, 790)])
@pytest.mark.parametrize("alpha", [0.0, 1e-4, 0.25])
def test_lazy_update_with_a_float_mask_is_the_replaced_code(B, H, T, alpha):
    """LazyEviction's update with a float mask: bit for bit the replaced code's TS and MRI over 12 steps of 1-3 new
    slots each, with attention exactly at alpha, NaN on dead slots, and zeros; the state after both is checked."""
    from learnkv.policies.lazy import LazyEviction

    g = torch.Generator().manual_seed(B * 100 + T)
    policy = LazyEviction(alpha=alpha)
    ours, theirs = {}, {}
    for step in range(12):
        n_new = 1 + step % 3 if step else T
        positions = torch.arange(T).expand(B, H, T).clone()
        positions[..., : T // 4] = -1  # dead and padding slots
        attn = torch.rand(B, H, 2, T, generator=g) * 2 * max(alpha, 1e-3)
        attn[..., ::5] = alpha  # exactly at the threshold
        attn[..., 1::7] = 0.0
        attn = attn.masked_fill((positions < 0)[:, :, None, :], float("nan"))
        for state, update in ((ours, LazyEviction.update), (theirs, lazy_update_with_bool_mask)):
            update(policy, LayerView(layer=0, step=step, keys=None, values=None, positions=positions,
                                     n_new=min(n_new, T), attn=attn, attn_sum=None, attn_sq_sum=None, keep=T,
                                     state=state))
        assert torch.equal(ours["ts"].view(torch.int32), theirs["ts"].view(torch.int32)), f"step {step}"
        assert torch.equal(ours["mri"].view(torch.int32), theirs["mri"].view(torch.int32)), f"step {step}"
    assert bool((ours["mri"] > 0).any()) or T == 1  # some slot's recurrence interval grew


def snapkv_score_before(window_attn, window, k):
    """`SnapKV._score` before it pooled live slots only (commit 27bd051), verbatim, with ``avg_pool``'s pooling."""
    s = window_attn.mean(dim=2)  # [B, H, T]
    B, H, T = s.shape
    n_prefix = T - min(window, T)  # the window's own keys are kept, and not pooled into neighbours
    pooled = snapkv.avg_pool(s[..., :n_prefix], k)
    # like kvpress, the window gets the highest prefix score (it is protected by the cache anyway)
    top = pooled.amax(dim=-1, keepdim=True) if n_prefix else s.new_zeros(B, H, 1)
    return torch.cat([pooled, top.expand(B, H, T - n_prefix)], dim=-1)


def one_drop_victims_before(scores, positions, keep, n_sink, n_recent, live):
    """`learnkv.kernels.cpu.one_drop_victims` before its two-comparison mask and one-pass minimum (commit 39f22f0),
    verbatim (docstring aside)."""
    B, H, T = scores.shape
    drops = one_drop_rows(keep, live, B, H, T)
    if drops is None:
        return None
    valid = positions >= 0
    # the reference's priorities on live slots (protected ones +inf; a protected slot is never dead), dead ones +inf
    # here so that the argmin finds the lowest live one
    live_prio = scores.float().masked_fill(protected_slots(positions, n_sink, n_recent) | ~valid, float("inf"))
    victim = live_prio.argmin(dim=-1, keepdim=True)  # [B, H, 1]: the lowest live priority, the oldest among ties
    # one synchronisation for every case the argmin would not reproduce (NaN > -inf is False too): a NaN or -inf
    # priority on a live slot, or a row whose every live slot is +inf (the argmin then lands on a dead slot)
    if bool((~(live_prio > float("-inf"))).any() | (~valid.gather(-1, victim)).any()):
        return None
    return victim, drops


def window_std_before(win):
    """`learnkv.features.window_std` before its fused ``addcdiv_`` and ``addcmul_`` (commit 1d4955a), verbatim
    (docstring and device check aside)."""
    x = win.double()
    mean = torch.zeros(x[:, :, 0].shape, dtype=torch.float64, device=x.device)
    m2, d, e = torch.zeros_like(mean), torch.empty_like(mean), torch.empty_like(mean)
    for i in range(x.shape[2]):  # WelfordOps.reduce: delta, mean + delta / n, m2 + delta * (x - new mean)
        torch.sub(x[:, :, i], mean, out=d)
        mean.add_(d / (i + 1))
        torch.sub(x[:, :, i], mean, out=e)
        m2.add_(d.mul_(e))
    return m2.div_(x.shape[2]).sqrt_().float()


@pytest.mark.parametrize("B, H, W, T", [(1, 1, 1, 1), (2, 3, 16, 17), (8, 3, 16, 790), (40, 3, 16, 790)])
@pytest.mark.parametrize("kind", ["attention", "wide", "signed-zeros"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "among spare rows"])
def test_window_std_is_the_replaced_code(B, H, W, T, kind, threads, layout):
    """`learnkv.features.window_std` with ``addcdiv_`` and ``addcmul_``, each row read into float64 alone: the
    values of the replaced code bit for bit (each rounds its division, product and sum as the separate ops did: no
    fused multiply-add), one thread and two, at one layer's rows and at the learned refresh's few layers at once
    (`READ_OUT_SLOTS`), on a contiguous window and on the learned policy's own (its rows a view among spare rows of
    a buffer with room past the slots in use, `learnkv.sliding_rows.window_view`)."""
    from learnkv.features import SPARE_ROWS, window_std
    from learnkv.sliding_rows import window_view

    g = torch.Generator().manual_seed(B * 100 + W + T)
    win = torch.rand(B, H, W, T, generator=g) ** 4 / T
    if kind == "wide":
        win = win * 10.0 ** torch.randint(-30, 30, win.shape, generator=g)
    elif kind == "signed-zeros":
        win[..., ::2] = 0.0
        win[..., 1::3] = -0.0
    if layout == "among spare rows":
        step = 5  # the window starts at row 5 of W + SPARE_ROWS
        buf = torch.rand(B, H, W + SPARE_ROWS, T + 9, generator=g)  # rows and slots outside the window: not read
        buf[:, :, step : step + W, :T] = win
        win = window_view(buf[..., :T], W, SPARE_ROWS, step)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert same_bits(window_std(win), window_std_before(win))
    finally:
        torch.set_num_threads(old)


def redundancy_by_head(keys: Tensor, valid: Tensor, threshold: float, block: int = 64) -> Tensor:
    """`learnkv.policies.rkv.redundancy` before its KV heads were folded into the batch (commit d68a139), verbatim
    but for its docstring."""
    B, H, T, D = keys.shape
    k = keys.float()
    norm = k.norm(dim=-1, keepdim=True)
    k = k / (norm + 1e-8)
    square = (norm / (norm + 1e-8))[..., 0].double() ** 2  # each unit key's own cosine (0 for a zero key)
    first = valid.int().argmax(dim=-1)  # [B, H] the oldest cached slot (the source's fallback index 0)
    n_valid = valid.sum(dim=-1).clamp_min(1)
    padded = not bool(valid.all())  # one synchronisation per call; without padding the masks change nothing
    out = torch.empty(B, H, T, device=keys.device)
    for h in range(H):
        kh, v = k[:, h], valid[:, h]
        last, value = newest_near_before(kh, v if padded else None, threshold, block, first[:, h])
        k64 = kh.double()
        total = v.double()[:, None, :] @ k64  # [B, 1, D] the sum of the valid keys
        col = (k64 @ total.transpose(-1, -2))[..., 0] - square[:, h]  # the column sums, diagonal excluded
        col.scatter_add_(-1, last, -(value.double() * v))  # less each valid row's zeroed entry
        mean = (col / n_valid[:, h, None]).float()
        out[:, h] = mean.masked_fill(~v, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return out


def newest_near_before(k: Tensor, valid: Tensor | None, threshold: float, block: int,
                       first: Tensor) -> tuple[Tensor, Tensor]:
    """`learnkv.policies.rkv._newest_near` before the first block compared every row by its diagonal and
    each block took its newest near slot by a maximum (commit d68a139), verbatim but for its docstring."""
    B, T, D = k.shape
    rows = torch.arange(T, device=k.device).expand(B, T)  # the rows compared with the next block
    last, value = torch.zeros(B, T, dtype=torch.long, device=k.device), torch.zeros(B, T, device=k.device)
    left = torch.ones(B, T, dtype=torch.bool, device=k.device) if valid is None else valid.clone()
    c1, size = T, block
    while c1 > 0:
        c0 = max(c1 - size, 0)
        q = k if c1 == T else k.gather(1, rows[..., None].expand(*rows.shape, D))
        cos = q @ k[:, c0:c1].transpose(-1, -2)  # [B, rows, c1 - c0]
        own = (rows - c0).clamp(0, c1 - c0 - 1)[..., None]
        cos.scatter_(-1, own, cos.gather(-1, own) * ((rows < c0) | (rows >= c1))[..., None])  # the diagonal: 0
        if valid is not None:
            cos.masked_fill_(~valid[:, None, c0:c1], 0.0)  # padding: 0, never near (threshold >= 0)
        near = (cos > threshold).flip(-1)  # newest slot first
        found = near.view(torch.uint8).argmax(dim=-1, keepdim=True)  # the first True, or 0 if the row has none
        hit = near.gather(-1, found)[..., 0] & left.gather(1, rows)  # rows no longer looking were gathered as padding
        col = c1 - c0 - 1 - found
        last.scatter_(1, rows, torch.where(hit, col[..., 0] + c0, last.gather(1, rows)))
        value.scatter_(1, rows, torch.where(hit, cos.gather(-1, col)[..., 0], value.gather(1, rows)))
        left.scatter_(1, rows, left.gather(1, rows) & ~hit)
        c1, size = c0, size * 2
        n = int(left.sum(dim=-1).max()) if c1 > 0 else 0  # one synchronisation per block
        if n == 0:
            break
        rows = torch.sort((~left).to(torch.uint8), dim=-1, stable=True).indices[:, :n]  # the rows left first
    # no near-duplicate anywhere: the oldest valid slot (the diagonal's 0 for that slot itself)
    nobody = left if valid is None else left & valid
    fallback = (k @ k.gather(1, first[:, None, None].expand(B, 1, D)).transpose(-1, -2))[..., 0]  # [B, T]
    fallback[torch.arange(B, device=k.device), first] = 0.0
    return torch.where(nobody, first[:, None], last), torch.where(nobody, fallback, value)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def dense_zeroed(keys, valid, threshold):
    """``[B, H, T]`` the column `redundancy_dense` zeroes in each row (the newest near-duplicate, else the oldest
    valid slot), as it computes it."""
    B, H, T, _ = keys.shape
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    cos = k @ k.transpose(-1, -2)
    cos.diagonal(dim1=-2, dim2=-1).zero_()
    cos.masked_fill_(~valid[..., None], 0.0).masked_fill_(~valid[..., None, :], 0.0)
    near = (cos > threshold).flip(-1)
    found = near.view(torch.uint8).argmax(dim=-1, keepdim=True)
    first = valid.int().argmax(dim=-1, keepdim=True).expand(B, H, T)
    return torch.where(near.gather(-1, found)[..., 0], T - 1 - found[..., 0], first)


def near_keys(B, H, T, D, g, shared):
    """Random keys plus ``shared`` times a common direction per head (real keys are anisotropic: with 2, most rows
    have a near-duplicate among the newest slots; with 0, few have one anywhere)."""
    keys = torch.randn(B, H, T, D, generator=g) + shared * torch.randn(1, H, 1, D, generator=g)
    keys[:, :, T // 2] = keys[:, :, 0] * 2  # an exact duplicate (cosine 1, or just above by rounding)
    return keys


def redundancy_case(B, H, T, D, pad, shared):
    """Keys (`near_keys`, seeded by the shape) and their validity for the redundancy's tests: ``pad`` slots of left
    padding in the first row only, the third row (if any) with nothing cached."""
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + D)
    keys = near_keys(B, H, T, D, g, shared)
    valid = torch.ones(B, H, T, dtype=torch.bool)
    valid[0, :, : min(pad, T - 1)] = False  # left padding in the first row only (others unpadded)
    if B > 2:
        valid[2] = False  # a row with nothing cached
    return keys, valid


@pytest.mark.parametrize("B,H,T,D", [(1, 1, 1, 4), (1, 1, 2, 4), (2, 3, 9, 4), (3, 2, 130, 8), (1, 3, 257, 64),
                                     (2, 2, 300, 64)])
@pytest.mark.parametrize("pad", [0, 1, 5])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("block,shared", [(1, 0.0), (4, 2.0), (64, 0.0), (64, 2.0)])
def test_redundancy_matches_the_dense_code(B, H, T, D, pad, threshold, block, shared):
    """The blockwise redundancy zeroes the dense code's entries (the same fp32 cosines decide "near"), and its scores
    differ from the dense code's by the column sums' rounding only: relative < 1e-6 (~3e-7 seen)."""
    keys, valid = redundancy_case(B, H, T, D, pad, shared)
    new, dense = rkv.redundancy(keys, valid, threshold, block=block), redundancy_dense(keys, valid, threshold)
    torch.testing.assert_close(new, dense, rtol=1e-6, atol=0.0)
    assert same_bits(redundancy_dense(keys, valid, threshold), redundancy_before(keys, valid, threshold))
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    want, first = dense_zeroed(keys, valid, threshold), valid.int().argmax(dim=-1)
    padded = not bool(valid.all())
    for h in range(H):
        got, _ = rkv._newest_near(k[:, h], valid[:, h] if padded else None, threshold, block, first[:, h])
        v = valid[:, h]
        assert torch.equal(got[v], want[:, h][v]), f"head {h}"


@pytest.mark.parametrize("B,H,T,D", [(1, 1, 1, 4), (2, 3, 9, 4), (3, 2, 130, 8), (2, 3, 300, 64), (2, 3, 1100, 64)])
@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("block,shared", [(1, 0.0), (4, 2.0), (64, 0.0), (64, 2.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_redundancy_is_the_code_before(B, H, T, D, pad, threshold, block, shared, threads):
    """The redundancy with its KV heads folded into the batch and each block's newest near slot taken by a maximum:
    the same bits as head by head with a flip and an ``argmax`` (kept above), at one and two threads, with
    left padding, a row with nothing cached, keys with and without near-duplicates and an exact duplicate."""
    keys, valid = redundancy_case(B, H, T, D, pad, shared)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        new = rkv.redundancy(keys, valid, threshold, block=block)
        before = redundancy_by_head(keys, valid, threshold, block=block)
        sliced = rkv.redundancy(torch.cat([keys, keys], dim=2)[:, :, :T], valid, threshold, block=block)  # strided
    finally:
        torch.set_num_threads(old)
    assert same_bits(new, before) and same_bits(sliced, before)


@pytest.mark.parametrize("C", [1, 64, 2**15 - 1, 2**15, 40_000])  # int16 column numbers below 2**15, int32 from it
def test_newest_above_is_the_last_near_column(C):
    """`rkv._newest_above`: each row's newest valid column with cosine above the threshold, the brute-force answer,
    in blocks as wide as a long cache's (the column numbers change dtype at 2**15)."""
    g = torch.Generator().manual_seed(C)
    cos = torch.rand(2, 3, C, generator=g) * 2 - 1
    cos[1, 2] = -1.0  # a row with none
    valid = torch.rand(2, C + 5, generator=g) > 0.3
    for v in (None, valid):
        col, hit = rkv._newest_above(cos, 0.5, v, 5)
        near = (cos > 0.5) & (True if v is None else v[:, None, 5:])
        want = torch.tensor([[max((i for i in range(C) if near[b, r, i]), default=-1) for r in range(3)]
                             for b in range(2)])
        assert torch.equal(hit, want >= 0) and torch.equal(col, want.clamp_min(0))


@pytest.mark.parametrize("T,D", [(40, 8), (300, 64), (700, 64)])
@pytest.mark.parametrize("shared", [0.0, 0.7, 2.0])
@pytest.mark.parametrize("window", [1, 8])
def test_rkv_keeps_the_dense_codes_slots(monkeypatch, T, D, shared, window):
    """R-KV's scores with the blockwise and the dense redundancy keep the same slots: batch rows with different
    budgets, one left-padded, a shared direction in the keys of 0 (few near-duplicates), 0.7 or 2 (most rows have
    one among the newest slots)."""
    B, H = 3, 2
    g = torch.Generator().manual_seed(T + D + window)
    keys = near_keys(B, H, T, D, g, shared)
    pos = torch.arange(T).expand(B, H, T).clone()
    pos[0, :, : T // 5] = -1
    rows = torch.rand(B, H, window, T, generator=g) ** 4 * (pos >= 0)[:, :, None]
    policy = rkv.RKV(window=window, buffer=window)

    def kept(redundancy):
        monkeypatch.setattr(rkv, "redundancy", redundancy)
        view = LayerView(layer=0, step=1, keys=keys, values=keys, positions=pos, n_new=1, attn=rows,
                         attn_sum=rows.sum(2), state={"obs_attn": rows})
        scores = policy.score(view)
        return scores, kernels.select_keep(scores, pos, [T // 2, T // 3, T - 10], 0, window)

    (new, kept_new), (dense, kept_dense) = kept(rkv.redundancy), kept(redundancy_dense)
    assert torch.equal(kept_new, kept_dense)
    # a score is lambda * importance - (1 - lambda) * redundancy: the redundancy's relative 1e-6, as an absolute error
    torch.testing.assert_close(new, dense, rtol=0.0, atol=1e-6 * float(dense.abs().max()))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 37, 600])
def test_snapkv_pool_bits_unchanged(k, n):
    g = torch.Generator().manual_seed(k * 1000 + n)
    x = torch.rand(2, 3, n, generator=g) ** 4 / 50  # attention-like: small, many near zero
    x[..., ::3] = -0.0  # the pooling call's sum starts at +0.0: a signed zero must not survive
    x[1, 2] = 0.0
    assert same_bits(snapkv.avg_pool(x, k), avg_pool_before(x, k))


def kept_slots(model, policy, budget, eviction=None, **params):
    """Every layer's slot positions after every step of a batch-2 left-padded decode (``eviction``: more of
    `generate`'s eviction fields, e.g. ``slack``)."""
    ids = torch.cat([random_ids(60, seed=5), random_ids(60, seed=6)])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # a left-padded row: the padding masks of R-KV's redundancy are exercised
    seen = []
    generate(model, input_ids=ids, attention_mask=mask, policy=policy, budget=budget, max_new_tokens=70,
             stop_at_eos=False, policy_params=params, **(eviction or {}),
             observer=lambda cache: seen.append([layer.positions.clone() for layer in cache.layers]))
    return seen


@pytest.mark.parametrize("policy,params,eviction", [
    ("rkv", {}, {}), ("rkv", {"buffer": 8, "window": 4}, {}),
    ("rkv", {"buffer": 6, "window": 3}, {"slack": 4}),  # dead slots between compactions
    ("rkv", {"buffer": 10, "window": 10}, {"prefill_policy": "h2o"}),  # the window fills during the decode
    ("snapkv", {}, {}), ("snapkv", {"window": 5, "kernel_size": 7}, {}),
    ("snapkv", {"window": 5}, {"slack": 4}),  # dead slots between compactions
    ("snapkv", {}, {"budget": [48, 36]}),  # rows with windows of their own (12 and 9 rows), layer by layer
    ("snapkv", {"window": 5, "interval": 3}, {}),  # lagged: scored every third step, updated at every one
    ("snapkv", {"window": 20}, {"prefill_policy": "h2o"}),  # the window fills during the decode
    ("roco", {}, {}), ("roco", {"n_recent": 4}, {"slack": 4}),  # dead slots between compactions
    ("roco", {}, {"budget": [48, 36]}),  # rows of budgets of their own
    ("lazy", {}, {"prefill_policy": "snapkv"}),
    ("lazy", {"window": 4, "alpha": 0.02}, {"prefill_policy": "snapkv", "slack": 4}),  # dead slots, compactions
])
def test_decode_keeps_the_same_slots(tiny, monkeypatch, policy, params, eviction):
    """The optimised paths keep the slots of the code before them, bit for bit, over 69 decode steps: R-KV's
    blockwise redundancy, SnapKV's pooling, RoCo's and LazyEviction's float masks, and both windows kept among
    spare rows (SnapKV's wraps to the top four times, R-KV's every ninth step)."""
    eviction = dict(eviction)
    budget = eviction.pop("budget", 48)
    fast = kept_slots(tiny, policy, budget, eviction, **params)
    monkeypatch.setattr(rkv, "redundancy", redundancy_before)
    monkeypatch.setattr(snapkv, "avg_pool", avg_pool_before)
    monkeypatch.setattr(snapkv.SnapKV, "update", snapkv_update_before)
    monkeypatch.setattr(rkv.RKV, "update", rkv_update_before)
    monkeypatch.setattr(roco.RoCo, "score", roco_score_with_bool_masks)
    monkeypatch.setattr(lazy.LazyEviction, "update", lazy_update_with_bool_mask)
    before = kept_slots(tiny, policy, budget, eviction, **params)
    assert len(fast) == len(before) == 70  # the prefill and 69 decode steps
    assert all(torch.equal(a, b) for step_a, step_b in zip(fast, before) for a, b in zip(step_a, step_b))
    assert any(layer.shape[-1] < 60 + 70 for layer in fast[-1])  # it did evict


def compacted(x, positions):
    """``x [B, H, T]`` as a compacted cache holds it: each row's live slots in order at the right of the widest row's
    count, +0.0 before them (filler slots); and the compacted positions."""
    B, H, T = x.shape
    K = int((positions >= 0).sum(-1).max())
    out = torch.zeros(B, H, K, dtype=x.dtype)
    pos = torch.full((B, H, K), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            live = (positions[b, h] >= 0).nonzero().view(-1)
            out[b, h, K - len(live) :] = x[b, h, live]
            pos[b, h, K - len(live) :] = positions[b, h, live]
    return out, pos


@pytest.mark.parametrize("B,H,T", [(1, 1, 16), (2, 3, 40), (3, 2, 129)])
@pytest.mark.parametrize("window,k", [(1, 5), (4, 5), (8, 7), (30, 3), (128, 5)])
@pytest.mark.parametrize("dead", [0.0, 0.2, 0.6, "oldest"])
def test_snapkv_scores_live_slots_as_in_the_compacted_cache(B, H, T, window, k, dead):
    """SnapKV pools each live slot with its live neighbours (`snapkv.live_order`): with dead slots anywhere, every
    live slot's score is bit for bit the one it gets in the compacted cache; without dead slots between live ones
    the scores are the replaced code's, every slot's."""
    g = torch.Generator().manual_seed(B * 100 + T + window)
    window = min(window, T // 4)  # SnapKV scores a row over its budget, which is over its window
    policy = snapkv.SnapKV(kernel_size=k, window=window)
    attn = torch.rand(B, H, 6, T, generator=g) ** 4 / 30
    pos = torch.arange(T).expand(B, H, T).clone()
    pos[0, :, : T // 4] = -1  # left padding
    attn[0, :, :, : T // 4] = 0.0  # as the cache holds it: no attention to a padding slot
    assert same_bits(policy._score(attn.mean(dim=2), window, pos), snapkv_score_before(attn, window, k))
    # the GPU's path (no dense shortcut, whose check would sync): the same scores for every live slot
    dense, dest = snapkv.live_order(attn.mean(dim=2), pos, shortcut=False)
    live0 = pos >= 0
    assert same_bits(dense.gather(-1, dest.clamp(max=T - 1))[live0], attn.mean(dim=2).masked_fill(~live0, 0)[live0])
    # dead slots anywhere before each row's newest `window` (never among them: those are protected)
    if dead == "oldest":  # the oldest live slots die: the live ones still sit together at the right
        die = (pos >= 0) & (pos < 3)
    else:
        die = (torch.rand(B, H, T, generator=g) < dead) & (pos >= 0)
    die[..., max(T - window, 0) :] = False
    pos = pos.masked_fill(die, -1)
    attn = attn.masked_fill(die[:, :, None], 0.5)  # a dead slot's old attention must not reach its neighbours
    ours = policy._score(attn.mean(dim=2), window, pos)
    packed, packed_pos = compacted(attn.mean(dim=2), pos)
    if packed.shape[-1] <= window:  # no row over its window: SnapKV would not score it
        return
    expected = policy._score(packed, window, packed_pos)  # the compacted cache's window means
    live = pos >= 0
    for b in range(B):
        for h in range(H):
            got = ours[b, h, live[b, h]]
            want = expected[b, h, packed_pos[b, h] >= 0]
            assert same_bits(got, want), f"row {b}, head {h}"


@pytest.mark.parametrize("params", [{}, {"window": 5, "kernel_size": 7}])
@pytest.mark.parametrize("slack", [1, 5])
def test_snapkv_with_dead_slots_keeps_the_compacted_tokens(tiny, params, slack):
    """What pooling live slots only buys: SnapKV lets evicted slots stay dead (``slack``) instead of compacting at
    every eviction, and a padded batch-2 decode keeps the same live positions in every layer after every step as the
    compacting cache."""
    ids = torch.cat([random_ids(60, seed=5), random_ids(60, seed=6)])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0

    dead = []

    def run(slack):
        live = []

        def observe(cache):
            live.append([[sorted(p[p >= 0].tolist()) for p in layer.positions.flatten(0, 1)] for layer in cache.layers])
            dead.append(max(layer.n_dead for layer in cache.layers))

        out = generate(tiny, input_ids=ids, attention_mask=mask, policy="snapkv", budget=48, max_new_tokens=40,
                       stop_at_eos=False, policy_params=params, slack=slack, observer=observe)
        return out.tokens.tolist(), live

    compacting = run(0)
    dead.clear()
    dead_slots = run(slack)
    assert not snapkv.SnapKV.needs_dense_slots and max(dead) > 0  # slots did stay dead between compactions
    assert dead_slots[0] == compacting[0]
    assert dead_slots[1] == compacting[1]


@pytest.mark.parametrize("window, slack, prefill, budget", [(3, 0, None, 24), (8, 0, None, 24), (3, 4, None, 24),
                                                             (8, 4, None, 24), (3, 3, "snapkv", 24),
                                                             (8, 3, "snapkv", 24), (44, 2, None, 44)])
def test_snapkv_running_sum_is_the_window_mean(tiny, monkeypatch, window, slack, prefill, budget):
    """`SnapKV(running_sum=True)`: after every decode step each slot's kept sum (`snapkv.WINDOW_SUM`, float64) is its
    window rows' sum within float64 rounding (a slot's rows summed exactly would differ by ~1e-16 of the largest
    row), every score within float32 rounding of averaging the rows, and the decode keeps the same tokens in every
    layer at every step (padded batch, slack 0 and 4; a prefill policy, whose state is dropped, so the window fills
    from empty while the policy evicts; a window of 44 over a 40-token prompt within the budget, so the sum starts
    from the prompt's 40 rows laid out among zero rows)."""
    ids = torch.cat([random_ids(40, seed=21), random_ids(40, seed=22)])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    runs, scores, real_score = {}, {False: [], True: []}, snapkv.SnapKV.score
    for running in (False, True):
        kept, sums = [], []
        monkeypatch.setattr(snapkv.SnapKV, "score",
                            lambda self, view: scores[running].append(real_score(self, view)) or scores[running][-1])

        def observe(cache):
            kept.append([layer.positions.clone() for layer in cache.layers])
            for layer in cache.layers:
                total = layer.state.get(snapkv.WINDOW_SUM)
                if total is not None:
                    rows = snapkv.window_view(layer.state["window_attn"], window, snapkv.SPARE_ROWS, cache.step)
                    sums.append((total.clone(), rows.double().sum(dim=2), layer.positions >= 0))  # updated in place

        generate(tiny, input_ids=ids, attention_mask=mask, policy="snapkv", budget=budget, max_new_tokens=40,
                 stop_at_eos=False, slack=slack, prefill_policy=prefill, observer=observe,
                 policy_params={"window": window, "running_sum": running})  # fmt: skip
        runs[running] = kept
        if running:
            assert len(sums) >= 20 * len(tiny.model.layers), "the sum must be kept over most of the decode"
            for total, exact, live in sums:
                assert total.dtype == torch.float64
                assert torch.allclose(total[live], exact[live], rtol=0, atol=1e-12)
        else:
            assert not sums
    assert len(runs[True]) == len(runs[False]) == 40
    assert len(scores[True]) == len(scores[False]) >= 20
    for a, b in zip(scores[True], scores[False]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-12)
    for step, (a, b) in enumerate(zip(runs[True], runs[False])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: other slots kept"


def snapkv_update_growing_window(self, view):
    """`SnapKV.update` before a filling decode window was laid out at its full size (commit 324fc9d), verbatim: the
    exact mean's window grew a row a step, a new tensor each step, until it held its ``W`` rows."""
    rows = view.attn  # [B, H, W, T]; the cache zero-padded old rows for new slots (causally exact)
    W, buf = self.obs_window, view.state.get("window_attn")
    if self.running_sum and not self.row_windows and rows.shape[2] == 1 and view.step >= 1:
        self._running_update(view, buf, rows[:, :, 0])
        return
    window = snapkv.slid(buf, rows, W, snapkv.SPARE_ROWS, view.step)
    if window is not buf:
        view.state.pop(snapkv.WINDOW_SUM, None)  # a window laid out anew: averaged from its rows
        view.state["window_attn"] = window


@pytest.mark.parametrize("window, slack, prefill, budget", [(8, 0, "snapkv", 24), (8, 4, "snapkv", 24),
                                                             (44, 2, None, 44), (None, 3, "snapkv", 0.5),
                                                             (None, 0, "snapkv", 0.5)])
def test_snapkv_filling_window_at_full_size_is_the_growing_window(tiny, monkeypatch, window, slack, prefill, budget):
    """SnapKV's exact mean with its decode window laid out at its full size while it fills (zero rows before the
    rows seen, the rows seen averaged) scores every slot and keeps every slot, in every layer at every step, bit
    for bit as the window that grew a row a step (`snapkv_update_growing_window`): a prefill policy whose state is
    dropped (the window fills from empty while the policy evicts), a window of 44 over a 40-token prompt within the
    budget (it fills from the prompt's 40 rows), and a budget fraction, whose rows of different lengths get windows
    of their own (`row_windows`: each row's last rows seen, up to its window); padded batch, slack 0 to 4."""
    ids = torch.cat([random_ids(40, seed=21), random_ids(40, seed=22)])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    params = {} if window is None else {"window": window}
    runs, real_score, real_update = {}, snapkv.SnapKV.score, snapkv.SnapKV.update
    for growing in (True, False):
        kept, scores, shapes = [], [], set()
        monkeypatch.setattr(snapkv.SnapKV, "update", snapkv_update_growing_window if growing else real_update)
        monkeypatch.setattr(snapkv.SnapKV, "score",
                            lambda self, view: scores.append(real_score(self, view)) or scores[-1])

        def observe(cache):
            kept.append([layer.positions.clone() for layer in cache.layers])
            shapes.update(tuple(layer.state["window_attn"].shape[:3]) for layer in cache.layers
                          if "window_attn" in layer.state)

        generate(tiny, input_ids=ids, attention_mask=mask, policy="snapkv", budget=budget, max_new_tokens=40,
                 stop_at_eos=False, slack=slack, prefill_policy=prefill, observer=observe, policy_params=params)
        runs[growing] = kept, scores, shapes
    (kept_before, scores_before, shapes_before), (kept_now, scores_now, shapes_now) = runs[True], runs[False]
    assert len(shapes_before) > 2 and len(shapes_now) <= 2  # the window grew before; now it holds one row count
    assert len(scores_now) == len(scores_before) >= 20
    assert all(same_bits(a, b) for a, b in zip(scores_now, scores_before))
    assert len(kept_now) == len(kept_before) == 40
    for step, (a, b) in enumerate(zip(kept_now, kept_before)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: other slots kept"


def test_snapkv_params_hold_its_settings_not_its_decode_state():
    """The records' parameters (`Policy.params`) name `running_sum`, not the divisor SnapKV keeps while it decodes."""
    params = snapkv.SnapKV(running_sum=True).params()
    assert params["running_sum"] is True and "_window_rows" not in params


@pytest.mark.parametrize("B, H, T", [(1, 1, 1), (2, 3, 17), (8, 3, 130), (30, 3, 40)])
@pytest.mark.parametrize("kind", ["randn", "ties", "special", "over"])
def test_one_drop_victims_are_the_argmins_before(B, H, T, kind):
    """`kernels.cpu.one_drop_victims` (the protected and dead slots in two comparisons, the victims and the row
    minima from one ``min``) finds the victims the code before it found, and leaves the same cases (NaN, -inf,
    a row of +inf, a row dropping two) to the reference; sinks and windows of 0, per row and wide."""
    g = torch.Generator().manual_seed(B * 10 + T)
    for trial in range(20):
        scores, pos, keeps, lives = one_drop_case(B, H, T, g, kind)
        n_sink = trial % 3 if trial % 2 else [int(x) for x in torch.randint(0, 3, (B,), generator=g)]
        n_recent = trial % 4 if trial % 3 else [int(x) for x in torch.randint(0, T + 2, (B,), generator=g)]
        before = one_drop_victims_before(scores, pos, keeps, n_sink, n_recent, lives)
        after = one_drop_victims(scores, pos, keeps, n_sink, n_recent, lives)
        assert (before is None) == (after is None), f"trial {trial}"
        if before is not None:
            assert torch.equal(before[0], after[0]) and before[1] == after[1], f"trial {trial}"
