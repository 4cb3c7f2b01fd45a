"""Trace shards -> training batches, for Lightning.

Each trace row is one (prompt, decision step, layer) with H KV heads x T cached tokens; every (row, head) is one
ranking group. Rows are read on demand from the memory-mapped Arrow shards, so traces larger than memory work.
For the global objective (``train.objective=global``) the unit is a whole decision instead (`DecisionRows`): the
n_layers rows of one (prompt, acting policy, budget, step), batched together (`collate_decisions`), so the loss can
rank every resident token of the decision over all layers and KV heads.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from learnkv.features import N_FEATURES, feature_index
from learnkv.traces.store import TraceError, load_traces

#: what the scorer can be trained to rank by (`learnkv.traces.record` defines the recorded ones):
#: ``future_attnv`` is future attention mass times the token's value norm (attention weighted by what the value
#: contributes), computed from ``future_sum`` and the ``value_norm`` feature
LABELS = ("future_sum", "future_max", "future_out", "future_attnv")
DERIVED = {"future_attnv": "future_sum"}


class TraceRows(Dataset):
    """Map-style view of trace rows: features [H, T, F], label [H, T], teachers [K, H, T], layer, and ``live [H, T]``:
    the resident tokens (position >= 0; a head that held fewer than the row's fullest is padded, `resident`)."""

    def __init__(self, ds, label: str = "future_sum", teachers: tuple[str, ...] = (), values: bool = False):
        if label not in LABELS:
            raise ValueError(f"label must be one of {LABELS}, got {label!r}")
        column = DERIVED.get(label, label)
        if column not in ds.column_names:
            raise TraceError(f"traces have no {column!r} column (label {label!r}); collect them again with this learnkv")
        missing = [t for t in teachers if f"teacher_{t}" not in ds.column_names]
        if missing:
            raise TraceError(f"traces have no teacher column for {missing}")
        if values and "values" not in ds.column_names:
            raise TraceError("traces have no value vectors (collect them with collect.record_values=true)")
        cols = ["layer", "n_heads", "n_tokens", "positions", "features", column] + [f"teacher_{t}" for t in teachers]
        cols += ["head_dim", "values"] if values else []
        self.ds = ds.with_format("numpy", columns=cols)
        self.label, self.column, self.teachers, self.values = label, column, teachers, values

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        row = self.ds[int(i)]
        H, T = int(row["n_heads"]), int(row["n_tokens"])
        features = torch.from_numpy(np.asarray(row["features"], dtype=np.float32).reshape(H, T, N_FEATURES))
        label = torch.from_numpy(np.asarray(row[self.column], dtype=np.float32).reshape(H, T))
        if self.label == "future_attnv":
            label = label * features[..., feature_index("value_norm")]
        live = torch.from_numpy(np.asarray(row["positions"]).reshape(H, T) >= 0)
        item = {"features": features, "label": label, "layer": int(row["layer"]), "live": live}
        if self.values:
            item["values"] = torch.from_numpy(np.asarray(row["values"], dtype=np.float32).reshape(H, T, -1))
        if self.teachers:
            item["teachers"] = torch.stack([
                torch.from_numpy(np.asarray(row[f"teacher_{t}"], dtype=np.float32).reshape(H, T)) for t in self.teachers
            ])
        return item


def collate(items: list[dict]) -> dict:
    """Pad the token axis; ``mask [N, H, T]`` marks each head's resident tokens."""
    T = max(it["features"].shape[1] for it in items)
    N, H = len(items), items[0]["features"].shape[0]
    out = {
        "features": torch.zeros(N, H, T, N_FEATURES),
        "label": torch.zeros(N, H, T),
        "mask": torch.zeros(N, H, T, dtype=torch.bool),
        "layer": torch.tensor([it["layer"] for it in items]),
    }
    if "teachers" in items[0]:
        out["teachers"] = torch.zeros(N, items[0]["teachers"].shape[0], H, T)
    if "values" in items[0]:
        out["values"] = torch.zeros(N, H, T, items[0]["values"].shape[-1])
    for n, it in enumerate(items):
        t = it["features"].shape[1]
        out["features"][n, :, :t] = it["features"]
        out["label"][n, :, :t] = it["label"]
        out["mask"][n, :, :t] = it["live"]
        if "teachers" in it:
            out["teachers"][n, :, :, :t] = it["teachers"]
        if "values" in it:
            out["values"][n, :, :t] = it["values"]
    return out


#: the columns that name a decision (those a trace has: traces before on-policy collection lack policy and budget)
DECISION_KEYS = ("prompt_id", "policy", "budget", "step")


class DecisionRows(Dataset):
    """Map-style view of whole decisions: item ``i`` is the list of `TraceRows` items of decision ``i``'s layers,
    in layer order. Decisions are ordered by their first row; a decision that lacks a layer is refused (a collector
    records every layer of a decision, or none)."""

    def __init__(self, rows: TraceRows, n_layers: int):
        raw = rows.ds.with_format(None)
        keys = [c for c in DECISION_KEYS if c in raw.column_names]
        columns = [raw[c] for c in keys] + [raw["layer"]]
        groups: dict[tuple, dict[int, int]] = {}
        for i, values in enumerate(zip(*columns)):
            groups.setdefault(tuple(values[:-1]), {})[int(values[-1])] = i
        self.rows, self.decisions = rows, []
        for key, layers in groups.items():
            if sorted(layers) != list(range(n_layers)):
                raise TraceError(f"decision {dict(zip(keys, key))} has trace rows of layers {sorted(layers)}, not all "
                                 f"{n_layers}: the global objective needs every layer of a decision")
            self.decisions.append([layers[layer] for layer in range(n_layers)])

    def __len__(self) -> int:
        return len(self.decisions)

    def __getitem__(self, i: int) -> list[dict]:
        return [self.rows[j] for j in self.decisions[int(i)]]


def collate_decisions(items: list[list[dict]]) -> dict:
    """`collate` of every layer's row of every decision, decision-major (``[N x L, H, T]``, so a reshape to
    ``[N, L x H x T]`` pools each decision); ``decisions``: N."""
    out = collate([row for decision in items for row in decision])
    out["decisions"] = len(items)
    return out


class EpochSeededSampler(Sampler):
    """A permutation seeded by (seed, epoch): a resumed run sees the same order as an uninterrupted one.
    Lightning calls ``set_epoch`` on samplers that have it."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


def feature_stats(rows: TraceRows, max_rows: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of every feature over the real tokens of (up to ``max_rows``) training rows."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(rows), generator=g)[:max_rows].tolist()
    total = torch.zeros(N_FEATURES, dtype=torch.float64)
    total_sq = torch.zeros(N_FEATURES, dtype=torch.float64)
    count = 0
    for i in pick:
        item = rows[i]
        f = item["features"][item["live"]].double()  # [resident tokens, F]: a head's padding is no token
        total += f.sum(0)
        total_sq += (f * f).sum(0)
        count += f.shape[0]
    mean = total / max(count, 1)
    std = (total_sq / max(count, 1) - mean * mean).clamp(min=0).sqrt()
    return mean.float(), std.float()


def load_union(trace_dirs: list[str], split: str):
    """One split of several trace directories, as one dataset (the union of rounds of collection)."""
    import datasets  # datasets (~1.4 s) only where shards are read: `import learnkv.config` stays quick

    parts = [load_traces(d, split=split) for d in trace_dirs]
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


class TraceDataModule(L.LightningDataModule):
    """Train / validation splits of one or several trace directories (their union; split = the prompt's hashed
    split, stored per row). ``objective="global"``: batches of ``batch_size`` whole decisions of ``n_layers`` rows
    each (`DecisionRows`); ``train_rows`` and ``val_rows`` stay the rows (feature statistics read them)."""

    def __init__(self, trace_dir: str | list[str], label: str = "future_sum", teachers: tuple[str, ...] = (),
                 batch_size: int = 8, seed: int = 0, num_workers: int = 0, values: bool = False,
                 objective: str = "uniform", n_layers: int = 0):
        super().__init__()
        self.values, self.objective, self.n_layers = values, objective, n_layers
        self.trace_dirs = [str(d) for d in trace_dir] if isinstance(trace_dir, (list, tuple)) else [str(trace_dir)]
        self.label, self.teachers = label, tuple(teachers)
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.train_rows = self.val_rows = None
        self.train_set = self.val_set = None  # what the loaders draw from: the rows, or their decisions (global)

    @property
    def trace_dir(self) -> str:
        return ", ".join(map(str, self.trace_dirs))

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        self.train_rows = TraceRows(load_union(self.trace_dirs, "train"), self.label, self.teachers, self.values)
        self.val_rows = TraceRows(load_union(self.trace_dirs, "validation"), self.label, self.teachers, self.values)
        if len(self.train_rows) == 0 or len(self.val_rows) == 0:
            raise TraceError(f"{self.trace_dir}: need rows in both the train ({len(self.train_rows)}) and validation "
                             f"({len(self.val_rows)}) splits; collect more prompts (collect.prompts / collect.val_prompts)")
        if self.objective == "global":
            self.train_set, self.val_set = (DecisionRows(r, self.n_layers) for r in (self.train_rows, self.val_rows))
        else:
            self.train_set, self.val_set = self.train_rows, self.val_rows

    @property
    def _collate(self):
        return collate_decisions if self.objective == "global" else collate

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, collate_fn=self._collate,
                          num_workers=self.num_workers, sampler=EpochSeededSampler(len(self.train_set), self.seed))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=self._collate,
                          num_workers=self.num_workers)
