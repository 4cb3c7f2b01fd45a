"""The decode loop: prefill, one step at a time, with a budgeted cache and explicit positions.

`generate` is the one function users call (`generate_steps` is the same decode one step at a time, for a caller
that runs several in turns in one thread). It knows nothing about any particular policy: it builds a
`BudgetCache` for the named policy, runs the model with the "learnkv" attention function and reports what
the cache held. Positions are threaded explicitly (transformers 5.x ignores `cache_position` and would
derive positions from the physical cache length, which is wrong after eviction).

The loop itself is a few plain functions over one `DecodeState`, as gpt-fast and nanochat write theirs: `prefill`
(the prompts into the cache, the first token chosen), `decode_step` (one token for the batch) and `decode_loop`
(`decode_steps` one step at a time); `forward` is the one forward pass with the cache, which on-policy collection's
branches call too, and `call_model` the model call itself, which the serving simulator's own paged cache calls.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator, Sequence

import torch
from torch import Tensor

from learnkv import attention
from learnkv.model import cache_kwargs
from learnkv.cache import BudgetCache, kept_per_step, max_kept
from learnkv.capture import step_attention
from learnkv.fisher import step_fisher
from learnkv.memory import TRIM_EVERY, HeapTrim, frozen_objects
from learnkv.policies import Policy, make_policy
from learnkv.settings import Eviction, resolve_budget


@dataclass
class GenerationResult:
    """What `generate` returns. Per-row fields have one entry per prompt of the batch.

    Attributes
    ----------
    tokens : Tensor
        ``[B, N]`` generated token ids (a row that hit EOS is padded with the pad id after it).
    texts : list[str] or None
        Decoded continuations, if a tokenizer was given.
    policy : str
        Policy name; ``params`` its resolved hyperparameters (of the first row; rows differ at most in their
        protected windows and lagged headroom, see `learnkv.policies.base.resolve_rows`).
    budgets : list[int] or None
        Per row: token budget per layer and KV head (None for a policy that never evicts).
    prompt_lengths : list[int]
        Per row: prompt tokens (without padding).
    new_tokens : list[int]
        Per row: tokens generated up to and including its first EOS (N if it never stopped).
    kept_rows : list
        ``[step][layer][row]`` live tokens each layer held for each row after each forward pass (prefill first).
    peak_kv_bytes_rows : list[int]
        Per row: the high-water mark of its K/V bytes over all layers (the slots attended to in a step, before
        eviction: at most ``budget + 1`` per layer once decoding, or the prompt if it is longer than the budget), as
        learnkv's padded buffers hold them: every KV head of a layer as wide as the row's widest head there.
    live_kv_bytes_rows : list[int]
        Per row: the same high-water mark of the live K/V only, summed over layers and KV heads: what a paged
        per-head layout would hold. Equal to ``peak_kv_bytes_rows`` under the ``uniform`` and ``pyramid``
        allocations; under ``head`` and ``global`` (heads of a layer hold different counts) it is what "equal
        bytes" compares, and ``peak_kv_bytes_rows`` is up to ``H`` or ``L x H`` times more.
    full_kv_bytes_rows : list[int]
        Per row: the same high-water mark for a full cache over that row's generation (the prompt at the prefill, or
        every layer's tokens at the row's last step; a sliding-window layer holds at most ``window - 1`` of them,
        as transformers' own cache does).
    tokens_per_s : float
        Generated tokens (every row, up to its EOS) per second of wall time, prefill included.
    eviction_share : float
        Share of that wall time spent in policy updates, scoring, selection and compaction.
    eviction_s : float
        Those seconds (`BudgetCache.eviction_s`): a caller that times the decode itself (`bench/turns.py`) divides
        them by its own time.
    """

    tokens: Tensor
    texts: list[str] | None
    policy: str
    budgets: list[int] | None
    params: dict
    prompt_lengths: list[int]
    new_tokens: list[int]
    kept_rows: list
    peak_kv_bytes_rows: list[int]
    full_kv_bytes_rows: list[int]
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    eviction_share: float = 0.0
    eviction_s: float = 0.0
    prefill_policy: str | None = None
    extra: dict = field(default_factory=dict)
    layer_windows: list[int | None] | None = None  # per layer, its sliding window (None: full attention)
    live_kv_bytes_rows: list[int] | None = None  # None: equal to peak_kv_bytes_rows

    @property
    def live_kv_bytes(self) -> int:
        return sum(self.live_kv_bytes_rows or self.peak_kv_bytes_rows)

    @property
    def budget(self) -> int | list[int] | None:
        """The budget, or the per-row list when rows differ."""
        if self.budgets is None:
            return None
        return self.budgets[0] if len(set(self.budgets)) == 1 else list(self.budgets)

    @property
    def prompt_tokens(self) -> int:
        """The longest prompt of the batch."""
        return max(self.prompt_lengths)

    @property
    def kept_per_step(self) -> list[list[int]]:
        """Per forward pass and layer, the most live tokens any row held."""
        return kept_per_step(self.kept_rows)

    @property
    def max_kept_tokens(self) -> int:
        """The most live tokens any layer held for any row after any forward pass."""
        return max_kept(self.kept_rows)

    @property
    def peak_kv_bytes(self) -> int:
        return sum(self.peak_kv_bytes_rows)

    @property
    def full_kv_bytes(self) -> int:
        return sum(self.full_kv_bytes_rows)

    def kept_share(self, row: int = 0) -> float:
        """A row's mean over layers and forward passes (until its EOS) of the tokens held after the pass, over what a
        full cache holds then (prompt + tokens fed so far)."""
        steps = self.kept_rows[: max(self.new_tokens[row], 1)]
        windows = self.layer_windows or [None] * len(steps[0])
        if any(w is not None for w in windows):
            held = [sum(layer[row] / full_cache_held(self.prompt_lengths[row] + s, w) for layer, w in zip(step, windows))
                    / len(step) for s, step in enumerate(steps)]
        else:
            held = [sum(layer[row] for layer in step) / len(step) / (self.prompt_lengths[row] + s)
                    for s, step in enumerate(steps)]
        return sum(held) / len(held)

    def summary(self) -> dict:
        """One JSON-able record (what the CLI prints as its last line)."""
        return {
            "policy": self.policy,
            "prefill_policy": self.prefill_policy,
            "budget": self.budget,
            "max_kept_tokens": self.max_kept_tokens,
            "peak_kv_bytes": self.peak_kv_bytes,
            "live_kv_bytes": self.live_kv_bytes,
            "full_kv_bytes": self.full_kv_bytes,
            "kv_share": round(self.peak_kv_bytes / max(self.full_kv_bytes, 1), 4),
            "prompt_tokens": self.prompt_lengths if len(self.prompt_lengths) > 1 else self.prompt_lengths[0],
            "new_tokens": self.new_tokens if len(self.new_tokens) > 1 else self.new_tokens[0],
            "tokens_per_s": round(self.tokens_per_s, 2),
            "eviction_share": round(self.eviction_share, 4),
            "params": self.params,
        }


def full_cache_held(fed: int, window: int | None) -> int:
    """Tokens a full cache's layer holds after ``fed`` tokens: all of them, or the newest ``window - 1`` of a
    sliding-window layer (at the prefill it holds the whole prompt while attending, see `full_cache_peak`)."""
    return fed if window is None else min(fed, window - 1)


def full_cache_peak(prompt_len: int, n_new: int, windows: Sequence[int | None]) -> int:
    """`peak_attended` of a full cache: the prompt in every layer at the prefill, then at the row's last decode step
    what each layer held after the step before plus the step's token."""
    last = (sum(full_cache_held(prompt_len + n_new - 2, w) for w in windows) + len(windows)) if n_new > 1 else 0
    return max(len(windows) * prompt_len, last)


def peak_attended(kept_rows: list, row: int, prompt_len: int, n_new: int, heads: int = 1) -> int:
    """The most live slots a row's attention read in one forward pass, summed over layers, up to its own end: the
    prompt at the prefill, then what each layer kept after pass ``s - 1`` plus the token appended in pass ``s``.
    ``heads``: the KV heads ``kept_rows`` counts summed over (`BudgetCache.kept_slots`), else 1 (one head's)."""
    n_layers = len(kept_rows[0]) * heads
    decode = (sum(layer[row] for layer in kept_rows[s - 1]) + n_layers for s in range(1, min(n_new, len(kept_rows))))
    return max([n_layers * prompt_len, *decode])


def _special_texts(tokenizer) -> list[str]:
    """The texts the tokenizer reads as special (control) tokens: ``<|im_end|>``, ``<|im_start|>``, ..."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted({t.content for t in added.values() if getattr(t, "special", False)}
                  | set(getattr(tokenizer, "all_special_tokens", ())))


def _as_text(tokenizer, prompts: list[str], chat: bool, prefixes: list) -> tuple[Tensor, Tensor]:
    """`encode_prompts` for prompts that hold the text of a special token, read as plain text: each prompt is
    tokenized on its own with special tokens split, between the chat template's tokens (which stay special)."""
    sentinel = "\x00learnkv-prompt\x00"
    rows = []
    for p, pre in zip(prompts, prefixes):
        if chat and getattr(tokenizer, "chat_template", None):
            frame = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], add_generation_prompt=True,
                                                  tokenize=False)
            if frame.count(sentinel) != 1:
                raise ValueError("this tokenizer's chat template does not hold a prompt verbatim, so special tokens "
                                 "typed in it cannot be kept as text: pass special_tokens=True (CLI --special-tokens) "
                                 "or chat=False (--no-chat)")
            head, tail = frame.split(sentinel)
            ids = (tokenizer(head, add_special_tokens=False)["input_ids"]
                   + tokenizer(p, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                   + tokenizer(tail + (pre or ""), add_special_tokens=False)["input_ids"])
        else:
            text = p if pre is None else f"{p}\n\n{pre}"
            ids = tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]
        rows.append(ids)
    width = max(map(len, rows))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return input_ids, mask


def encode_prompts(tokenizer, prompts: str | Sequence[str], chat: bool = True,
                   reply_prefixes: Sequence[str | None] | None = None,
                   special_tokens: bool = False) -> tuple[Tensor, Tensor]:
    """Tokenize prompts with left padding; ``chat`` applies the tokenizer's chat template if it has one.

    ``reply_prefixes`` (one per prompt, None for none) start the reply after the assistant header, so the model goes
    on from them: the chain prompts' solved first problems (`learnkv.chains.ChainProblem.reply_prefix`, carried as
    ``Prompt.meta["response_prefix"]``).

    The text of a special token typed in a prompt (``<|im_end|>``) is plain text by default, as chat front-ends
    treat what a user types: it cannot end the turn or inject template structure. ``special_tokens=True`` reads
    it as the control token instead.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("no prompt given: give at least one non-empty prompt")
    for i, p in enumerate(prompts):
        which = "prompt" if len(prompts) == 1 else f"prompt {i + 1} of {len(prompts)}"
        if p is not None and not isinstance(p, str):
            raise TypeError(f"{which} must be a string, got {type(p).__name__}")
        try:
            (p or "").encode("utf-8")
        except UnicodeEncodeError as e:  # a command line's invalid UTF-8 arrives as lone surrogates
            raise ValueError(f"{which} is not valid UTF-8 text (undecodable byte at character {e.start}); give the "
                             "prompt in UTF-8") from None
    empty = [i + 1 for i, p in enumerate(prompts) if not isinstance(p, str) or not p.strip()]
    if empty:
        which = "prompt is" if len(prompts) == 1 else f"prompt {', '.join(map(str, empty))} of {len(prompts)} is"
        raise ValueError(f"{which} empty: every prompt needs text")
    prefixes = [None] * len(prompts) if reply_prefixes is None else list(reply_prefixes)
    if len(prefixes) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(prefixes)} reply prefixes: give one per prompt (None for none)")
    if not special_tokens and any(t in p for t in _special_texts(tokenizer) for p in prompts):
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return _as_text(tokenizer, list(prompts), chat, prefixes)
    if chat and getattr(tokenizer, "chat_template", None):
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            + (pre or "")
            for p, pre in zip(prompts, prefixes)
        ]
        add_special = False
    else:
        prompts = [p if pre is None else f"{p}\n\n{pre}" for p, pre in zip(prompts, prefixes)]
        add_special = True
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=add_special)
    return enc["input_ids"], enc["attention_mask"]


def check_positions(model, prompt_lengths: Sequence[int], max_new_tokens: int,
                    names: Sequence[str] | None = None) -> None:
    """Refuse, before the first forward, a decode that would run past the positions the model was trained for
    (``config.max_position_embeddings``): a prompt over them, or one whose decode of ``max_new_tokens`` reaches
    past them (the last generated token is not fed, so the last position is prompt + max_new_tokens - 2).
    ``names``: how the error names each prompt (default: by its place in the batch)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    for i, n in enumerate(prompt_lengths):
        which = names[i] if names else "the prompt" if len(prompt_lengths) == 1 else \
            f"prompt {i + 1} of {len(prompt_lengths)}"
        if n > limit:
            raise ValueError(f"{which} has {n} tokens, more than the model's {limit} positions "
                             "(config.max_position_embeddings): shorten it")
        if n + max_new_tokens - 1 > limit:
            raise ValueError(f"{which} has {n} tokens: {max_new_tokens} new tokens would run past the model's {limit} "
                             f"positions (config.max_position_embeddings); lower max_new_tokens to at most "
                             f"{limit - n + 1}")


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def stop_tokens(model, tokenizer, stop_at_eos: bool = True) -> tuple[Tensor, int]:
    """(the token ids that end a row, empty when ``stop_at_eos`` is False; the id a row holds after its end): the
    tokenizer's pad token, else the first EOS id, else 0."""
    device = next(model.parameters()).device
    eos = torch.tensor(_eos_ids(model, tokenizer) if stop_at_eos else [], device=device, dtype=torch.long)
    pad_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    return eos, pad_id if pad_id is not None else (int(eos[0]) if len(eos) else 0)


def _next_token(logits: Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float, gen) -> Tensor:
    """``logits [B, V]`` -> ``[B]``: greedy, or sampled with temperature / top-k / top-p."""
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / max(temperature, 1e-6)
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


def sampler(do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
            forced: Tensor | None = None) -> Callable[[Tensor, int], Tensor]:
    """The next-token choice ``(logits [B, V], step) -> [B]``: ``forced[:, step]`` (teacher forcing), else greedy, or
    sampled with temperature / top-k / top-p from its own generator seeded with ``seed``."""
    if forced is not None:
        return lambda logits, step: forced[:, step]
    gen = torch.Generator().manual_seed(seed)
    return lambda logits, step: _next_token(logits, do_sample, temperature, top_k, top_p, gen)


@dataclass
class DecodeState:
    """What the decode loop carries from one step to the next, for one batch (`prefill` fills the per-row fields)."""

    cache: BudgetCache
    choose: Callable[[Tensor, int], Tensor]  # (logits [B, V], step) -> the next tokens [B] (`sampler`)
    eos: Tensor  # token ids that end a row (empty: rows run to the end)
    pad_id: int  # what a row holds, and is fed, after its end
    observer: Callable[[BudgetCache], None] | None = None  # called with the cache after every forward pass
    next_pos: Tensor | None = None  # [B] the position of the next token fed
    finished: Tensor | None = None  # [B] rows past their end
    ends: Tensor | None = None  # [B] tokens up to and including a row's first EOS (0 until it has one)
    tokens: list[Tensor] = field(default_factory=list)  # per step, the [B] tokens chosen

    @property
    def new_tokens(self) -> list[int]:
        """Per row: tokens generated up to and including its first EOS (every step's, if it has none)."""
        return torch.where(self.finished, self.ends, len(self.tokens)).tolist()


def call_model(model, cache, ids: Tensor, positions: Tensor) -> Tensor:
    """One forward pass of ``ids [B, q]`` at ``positions [B, q]`` (explicit: transformers 5.x would derive them from
    the evicted cache's length) with ``cache`` as the model's cache and the learnkv attention's; the last position's
    logits ``[B, V]``. What the decode loop and the serving simulator run."""
    with attention.active_cache(cache):
        out = model(input_ids=ids, position_ids=positions, **cache_kwargs(model, cache), use_cache=True,
                    logits_to_keep=1, learnkv_cache=cache)
    return out.logits[:, -1, :]


def forward(model, cache: BudgetCache, ids: Tensor, positions: Tensor, valid: Sequence[int],
            observer: Callable[[BudgetCache], None] | None = None) -> Tensor:
    """`call_model` as one step of ``cache``: ``positions`` -1 marks padding, ``valid`` the tokens each row feeds;
    the cache evicts after the pass (`BudgetCache.end_step`), then ``observer`` sees it."""
    cache.begin_step(positions, valid)
    logits = call_model(model, cache, ids, positions.clamp(min=0))
    cache.end_step()
    if observer is not None:
        observer(cache)
    return logits


def _take(state: DecodeState, logits: Tensor) -> Tensor:
    """Choose the next tokens from ``logits`` and do the bookkeeping: a row past its end gets the pad id; a row that
    chose an EOS ends."""
    tok = state.choose(logits, len(state.tokens))
    tok = torch.where(state.finished, torch.full_like(tok, state.pad_id), tok)
    state.tokens.append(tok)
    if len(state.eos):
        stops = torch.isin(tok, state.eos) & ~state.finished
        state.ends = torch.where(stops, len(state.tokens), state.ends)
        state.finished |= stops
    return tok


@torch.no_grad()
def prefill(model, state: DecodeState, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Run the left-padded prompts ``[B, L]`` through the model into the cache (which may compress them to the
    budget) and choose each row's first token ``[B]``. Refuses a model whose attention bypasses learnkv's."""
    positions = attention_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(attention_mask == 0, -1)  # -1 marks padding slots in the cache
    logits = forward(model, state.cache, input_ids, positions, attention_mask.sum(dim=-1).tolist(), state.observer)
    if ungoverned := state.cache.ungoverned_layers():  # structural: every layer that caches must attend through learnkv
        raise ValueError(ungoverned_error(model, ungoverned))
    state.next_pos = positions.max(dim=-1).values + 1
    state.finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    state.ends = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    return _take(state, logits)


@torch.no_grad()
def decode_step(model, state: DecodeState) -> Tensor:
    """One token for the batch: feed the last chosen tokens at each row's next position, the cache evicts, choose the
    next tokens ``[B]``."""
    logits = forward(model, state.cache, state.tokens[-1][:, None], state.next_pos[:, None],
                     [1] * len(state.next_pos), state.observer)
    state.next_pos = state.next_pos + 1
    return _take(state, logits)


def decode_loop(model, state: DecodeState, max_new_tokens: int, on_step: Callable[[int], None] | None = None,
                progress: str | None = None) -> None:
    """After `prefill`: `decode_step` until every row has ``max_new_tokens`` tokens or has ended. ``on_step`` is told,
    per step, how many rows generated a token at it; ``progress``: a progress bar's label."""
    for active in decode_steps(model, state, max_new_tokens, progress):
        if on_step is not None:
            on_step(active)


def decode_steps(model, state: DecodeState, max_new_tokens: int, progress: str | None = None) -> Iterator[int]:
    """`decode_loop` one step at a time: yields, right after `prefill` and after each `decode_step`, how many rows
    generated a token at it; the next step runs when the caller asks for the next value."""
    B, active = len(state.next_pos), len(state.next_pos)
    steps = range(max_new_tokens)
    if progress:
        from tqdm.auto import tqdm  # only when a progress bar is asked for

        steps = tqdm(steps, desc=progress, unit="tok", leave=False)
    trim = HeapTrim()
    with frozen_objects():  # no collection walks the model's objects mid-decode (learnkv.memory)
        for i in steps:
            if i:
                if (i - 1) % TRIM_EVERY == 0:
                    trim()  # a long decode's memory stays near what is live (learnkv.memory)
                decode_step(model, state)
            yield active
            if len(state.eos):  # without an EOS no row ends: nothing to read back (on a GPU, a synchronisation)
                active = B - int(state.finished.sum())  # once per step: the rows going on, for the next step, the stop
                if not active:
                    break


@torch.no_grad()
def observe(model, *, input_ids: Tensor, attention_mask: Tensor, policy: Policy, max_new_tokens: int = 1) -> None:
    """One prefill under a non-evicting ``policy`` that records what it sees (`learnkv.capture`'s callable, with
    `generate`'s keywords)."""
    rows = [make_policy(policy)] * input_ids.shape[0]
    with attention.installed(model):
        cache = BudgetCache(model.config.num_hidden_layers, rows, None, last_step=max_new_tokens - 1)
        prefill(model, DecodeState(cache, sampler(), *stop_tokens(model, None)), input_ids, attention_mask)


def _with_future(model, rows: list[Policy], input_ids: Tensor, attention_mask: Tensor, forced: Tensor | None,
                 future, max_new_tokens: int, sampling: dict, stop_at_eos: bool) -> tuple[list[Policy], Tensor]:
    """(the rows of a look-ahead policy given the future, the tokens they replay): without ``forced``, the full-cache
    continuation of the same prompts and sampling; without ``future``, each row's full-cache attention over it, or
    the other kind of future the policy reads (``future_kind``: the Fisher utility), once per distinct row."""
    if forced is None:  # the future is the full-cache continuation of this very call
        cache = BudgetCache(model.config.num_hidden_layers, [make_policy("full")] * len(rows), None,
                            last_step=max_new_tokens - 1)
        full = DecodeState(cache, sampler(**sampling), *stop_tokens(model, None, stop_at_eos))
        prefill(model, full, input_ids, attention_mask)
        decode_loop(model, full, max_new_tokens)
        forced, lengths = torch.stack(full.tokens, dim=1).cpu(), full.new_tokens
    else:  # the caller's forced rows: a row's own end is not known, the whole row is its continuation
        lengths = [forced.shape[1]] * len(rows)
    kind = rows[0].future_kind
    if future is None:  # a caller's future is already of the policy's kind
        seen: list[tuple[Tensor, Tensor, list]] = []  # rows of one prompt and continuation (several budgets): once
        future = []
        for b, n in enumerate(lengths):
            prompt, continuation = input_ids[b : b + 1, attention_mask[b].bool()], forced[b : b + 1, :n]
            known = next((f for p, c, f in seen if torch.equal(p, prompt) and torch.equal(c, continuation)), None)
            if known is None:
                known = (step_attention(model, prompt, continuation, observe) if kind == "attention"
                         else step_fisher(model, prompt, continuation))
                seen.append((prompt, continuation, known))
            future.append(known)
    seer = rows[0].with_future(future, model)
    return [dataclasses.replace(seer, **{k: getattr(r, k) for k in r.per_row_fields}) for r in rows], forced


@torch.inference_mode()
def generate(model, tokenizer=None, prompts: str | Sequence[str] | None = None, eviction: Eviction | None = None, *,
             max_new_tokens: int = 64, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
             chat: bool = True, reply_prefixes: Sequence[str | None] | None = None, special_tokens: bool = False,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_at_eos: bool = True, forced_tokens: Tensor | None = None, future: Sequence | None = None,
             observer: Callable[[BudgetCache], None] | None = None, progress: bool = False,
             on_step: Callable[[int], None] | None = None, **eviction_fields) -> GenerationResult:
    """Decode with a KV cache that never holds more than the budget's tokens per layer and KV head: `prefill`, then
    `decode_loop`, under the learnkv attention (`learnkv.attention.installed`).

    ``eviction`` (`learnkv.settings.Eviction`: policy, parameters, budget, granularity, slack, prefill policy) says
    what is kept; the full cache by default. Its fields may be given as keywords instead (``policy="h2o",
    budget=64``, with ``policy_params`` and ``prefill_policy`` for its ``params`` and ``prefill``). A budget is
    tokens per layer and KV head or a fraction of each row's full length (its prompt + ``max_new_tokens``), one for
    every row or one per row; every row decodes as it would alone, its own budget, its own eviction steps.

    Prompts are strings (left-padded into a batch; ``chat``, ``reply_prefixes`` and ``special_tokens`` are
    `encode_prompts`'s: a special token's text typed in a prompt is plain text unless ``special_tokens``), or pass
    ``input_ids`` ``[B, L]`` (+ ``attention_mask``). Greedy by default; ``do_sample`` samples with ``temperature``,
    ``top_k``, ``top_p``, seeded by ``seed``. ``forced_tokens`` ``[B, N]`` are fed (and returned) instead of the
    model's choices (teacher forcing). ``future``: for a policy that looks ahead (the oracle), per row the full-cache
    run's attention of the continuation it replays (`learnkv.capture.step_attention`), where the caller holds it;
    computed here otherwise. ``observer`` sees the cache after every forward pass (after eviction); ``on_step``
    gets, after the prefill and after every decode step, the number of rows that generated a token at it.
    `generate_steps` is the same decode one step at a time.

    It runs under ``torch.inference_mode`` (no autograd bookkeeping: ~5% faster at batch 1 than ``no_grad``, the
    same tokens), so the tensors it returns are inference tensors: clone one before writing into it or using it in
    autograd outside inference mode.
    """
    given = {k: v for k, v in locals().items() if k not in ("on_step", "eviction_fields")}  # first: the arguments
    steps = generate_steps.__wrapped__(**given, **eviction_fields)  # in this call's mode (`__wrapped__`: the caller's)
    while True:
        try:
            rows = next(steps)
        except StopIteration as end:
            return end.value
        if on_step is not None:
            on_step(rows)


@torch.inference_mode()
def generate_steps(model, tokenizer=None, prompts: str | Sequence[str] | None = None, eviction: Eviction | None = None,
                   *, max_new_tokens: int = 64, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                   chat: bool = True, reply_prefixes: Sequence[str | None] | None = None, special_tokens: bool = False,
                   do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   seed: int = 0, stop_at_eos: bool = True, forced_tokens: Tensor | None = None,
                   future: Sequence | None = None, observer: Callable[[BudgetCache], None] | None = None,
                   progress: bool = False, **eviction_fields) -> Generator[int, None, GenerationResult]:
    """`generate` one step at a time, for a caller that runs several decodes in turns in one thread
    (`bench/turns.py`): `generate`'s arguments (``on_step`` aside). The arguments are checked and the prompts encoded
    now; the returned generator then runs the prefill and yields, after it and after each decode step, how many
    rows generated a token at it (what `generate` tells ``on_step``), the next step running at the next request;
    its end's value (``StopIteration.value``, or ``yield from``'s) is the `GenerationResult`, whose ``prefill_s``
    and ``decode_s`` are wall time (the caller's time between steps included)."""
    eviction = _eviction(eviction, eviction_fields)
    policy_obj = _checked_policy(eviction, max_new_tokens, seed, top_k)
    input_ids, attention_mask = _batch(model, tokenizer, prompts, input_ids, attention_mask, max_new_tokens, chat=chat,
                                       reply_prefixes=reply_prefixes, special_tokens=special_tokens)
    prompt_lengths = attention_mask.sum(dim=-1).tolist()
    check_positions(model, prompt_lengths, max_new_tokens if forced_tokens is None else
                    min(max_new_tokens, forced_tokens.shape[1]))
    budgets, rows, prefill_rows = _policy_rows(model, policy_obj, eviction, prompt_lengths, max_new_tokens)
    sampling = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    @torch.inference_mode(torch.is_inference_mode_enabled())  # each step, when resumed: in the mode of this call
    def decoding() -> Generator[int, None, GenerationResult]:
        nonlocal rows, forced_tokens, max_new_tokens
        with attention.installed(model):
            if policy_obj.needs_future:
                rows, forced_tokens = _with_future(model, rows, input_ids, attention_mask, forced_tokens, future,
                                                   max_new_tokens, sampling, stop_at_eos)
            if forced_tokens is not None:
                forced_tokens = forced_tokens.to(input_ids.device)
                max_new_tokens = min(max_new_tokens, forced_tokens.shape[1])
            shared = eviction.block_size if eviction.granularity == "block" and policy_obj.evicts else None
            cache = BudgetCache(model.config.num_hidden_layers, rows, budgets, last_step=max_new_tokens - 1,
                                shared_block=shared, slack=eviction.slack, prefill_policy=prefill_rows,
                                allocation=eviction.allocation)
            state = DecodeState(cache, sampler(**sampling, forced=forced_tokens),
                                *stop_tokens(model, tokenizer, stop_at_eos), observer)
            t0 = _settled_clock(input_ids.device)
            prefill(model, state, input_ids, attention_mask)
            t1 = _settled_clock(input_ids.device)
            yield from decode_steps(model, state, max_new_tokens, f"decode [{policy_obj.name}]" if progress else None)
            t2 = _settled_clock(input_ids.device)
        return _result(state, tokenizer, policy_obj, budgets, rows, prefill_rows, prompt_lengths, (t0, t1, t2))

    return decoding()


def _settled_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device has run what was queued: a GPU runs kernels after the host launched
    them, and the decode loop no longer waits on it between steps, so the prefill's and decode's times are read here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


#: generate's keywords for `Eviction`'s fields (the two earlier names kept, so callers read as before)
_EVICTION_KEYWORDS = {"policy": "policy", "budget": "budget", "policy_params": "params", "params": "params",
                      "granularity": "granularity", "block_size": "block_size", "slack": "slack",
                      "prefill_policy": "prefill", "prefill": "prefill", "prefill_params": "prefill_params",
                      "scorer": "scorer", "allocation": "allocation"}


def _eviction(eviction: Eviction | None, fields: dict) -> Eviction:
    """``eviction``, or one built from generate's eviction keywords (never both)."""
    if unknown := [k for k in fields if k not in _EVICTION_KEYWORDS]:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    if eviction is not None:
        if fields:
            raise TypeError(f"generate() takes an Eviction or its fields as keywords, not both ({', '.join(fields)})")
        if not isinstance(eviction, Eviction):
            raise TypeError(f"generate()'s eviction is a learnkv.Eviction, got {type(eviction).__name__}")
        return eviction
    named = {_EVICTION_KEYWORDS[k]: v for k, v in fields.items()}
    for key in ("params", "prefill_params"):
        if key in named and named[key] is None:
            named[key] = {}
    return Eviction(**named)


def _checked_policy(eviction: Eviction, max_new_tokens, seed, top_k) -> Policy:
    for name, value, low in (("max_new_tokens", max_new_tokens, 1), ("seed", seed, 0), ("top_k", top_k, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer >= {low}, got {value!r}")
    return eviction.make()  # granularity and block size: checked when the Eviction was made


def _batch(model, tokenizer, prompts, input_ids, attention_mask, max_new_tokens, **encode) -> tuple[Tensor, Tensor]:
    """The left-padded batch ``[B, L]`` and its mask on the model's device, from prompts or token ids."""
    if input_ids is None:
        if tokenizer is None or prompts is None:
            raise ValueError("give prompts and a tokenizer, or input_ids")
        input_ids, attention_mask = encode_prompts(tokenizer, prompts, **encode)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.numel() == 0 or input_ids.shape[1] == 0:
        raise ValueError("prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    return input_ids, (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(device)


def _policy_rows(model, policy_obj: Policy, eviction: Eviction, prompt_lengths: list[int],
                 max_new_tokens: int) -> tuple[list[int] | None, list[Policy], list | None]:
    """(per row: the budget in tokens, the decode policy resolved for it, the prefill policy resolved for it)."""
    B, budgets = len(prompt_lengths), None
    if policy_obj.evicts:
        budget = eviction.budget
        per_row = list(budget) if isinstance(budget, Sequence) and not isinstance(budget, str) else [budget] * B
        if len(per_row) != B:
            raise ValueError(f"{len(per_row)} budgets for a batch of {B} prompts")
        budgets = [resolve_budget(b, n + max_new_tokens) for b, n in zip(per_row, prompt_lengths)]
        if any(b is None for b in budgets):
            raise ValueError(f"policy {policy_obj.name!r} needs a budget (tokens, or a fraction of the full length)")
    built = dataclasses.replace(eviction, policy=policy_obj, params={})  # the parameters are in the built policy
    rows, prefill_rows = built.resolve(budgets or [None] * B, prompt_lengths)
    rows[0].check_model(model)  # a policy bound to one model (learned) refuses another
    return budgets, rows, prefill_rows


def _result(state: DecodeState, tokenizer, policy_obj: Policy, budgets, rows, prefill_rows, prompt_lengths,
            times: tuple[float, float, float]) -> GenerationResult:
    cache, (t0, t1, t2) = state.cache, times
    tokens = torch.stack(state.tokens, dim=1).cpu()
    new_tokens = state.new_tokens
    per_token = cache.bytes_per_token()
    heads = cache.layers[0].keys.shape[1]
    windows = cache.layer_windows()
    return GenerationResult(
        tokens=tokens,
        texts=tokenizer.batch_decode(tokens, skip_special_tokens=True) if tokenizer is not None else None,
        policy=policy_obj.name,
        budgets=budgets,
        params=rows[0].params(),
        prompt_lengths=prompt_lengths,
        new_tokens=new_tokens,
        kept_rows=cache.kept_rows,
        peak_kv_bytes_rows=[peak_attended(cache.kept_rows, b, n, k) * per_token
                            for b, (n, k) in enumerate(zip(prompt_lengths, new_tokens))],
        full_kv_bytes_rows=[full_cache_peak(n, k, windows) * per_token for n, k in zip(prompt_lengths, new_tokens)],
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        tokens_per_s=sum(new_tokens) / max(t2 - t0, 1e-9),
        eviction_share=cache.eviction_s / max(t2 - t0, 1e-9),
        eviction_s=cache.eviction_s,
        prefill_policy=prefill_rows[0].name if prefill_rows else None,
        layer_windows=windows,
        live_kv_bytes_rows=[peak_attended(cache.kept_slots, b, n, k, heads) * (per_token // heads)
                            for b, (n, k) in enumerate(zip(prompt_lengths, new_tokens))] if cache.kept_slots else None,
    )


def ungoverned_error(model, layers: list[int]) -> str:
    """The one-line refusal for a model whose attention does not reach learnkv in ``layers``."""
    which = "any layer" if len(layers) == model.config.num_hidden_layers else f"layer(s) {', '.join(map(str, layers))}"
    return (f"{type(model).__name__} cannot decode under a learnkv budget: learnkv's attention never ran with the "
            f"cache in {which} at the prefill (its attention bypasses transformers' attention interface), so no eviction "
            "would reach them")
