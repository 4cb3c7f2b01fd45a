"""Token importance recurrence (LazyEviction's observation), from collected traces or from a live decode.

For every layer: the share of cached tokens that came back to high (above-uniform) attention after a gap of at
least k decode steps, among tokens observed for more than k decode steps. LazyEviction reports that most tokens in
long reasoning recur and that their maximum recurrence interval (MRI) is far below the output length; this
table and plot show how that holds for a model and prompt set. The MRI distribution (LazyEviction's Figure 2:
share of tokens by maximum recurrence interval) is the second plot.

Two ways in, one definition (`learnkv.features.FeatureTracker`: "high" is above-uniform attention from any query
head of the KV head's group; the MRI is the longest gap between a token's high steps, counted from its creation):

* ``python -m learnkv recurrence traces/``: the tokens cached at the sampled decision steps of collected traces;
* ``python -m learnkv recurrence --source chain --prompts 4 --max-new-tokens 2048``: a full-cache greedy decode of
  each prompt under `RecurrenceObserver`, a non-evicting policy that keeps only the tracker's per-token state (no
  trace shards: 1,000+ decode steps cost a few MB), read once at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from learnkv.decode import generate
from learnkv.features import N_FEATURES, FeatureTracker, feature_index
from learnkv.policies.base import LayerView, Policy
from learnkv.traces.store import load_traces

GAPS = (2, 4, 8, 16, 32, 64)
LONG_GAPS = (2, 4, 8, 16, 32, 64, 128, 256, 512)
#: MRI histogram bins: [lo, hi) in decode steps; 0 = never regained high attention after it was created
MRI_BINS = ((0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 512),
            (512, 1024), (1024, 1 << 30))


@dataclass
class RecurrenceObserver(Policy):
    """A non-evicting policy that tracks each token's high-attention steps during a full-cache decode.

    It folds every step's attention into `FeatureTracker`'s per-token state (the same definition the trace
    features use) and remembers, per layer, the cache's state dict, so `tokens` can read every token's MRI and how
    long it was observed once the decode ends. Batch of one: rows that stop early would keep counting steps.
    """

    name = "recurrence-observer"
    evicts = False
    needs_attention = True
    group_reduce = "mean+max"  # the feature tracker's input
    n_layers: int = 1
    states: dict = field(default_factory=dict, repr=False)
    positions: dict = field(default_factory=dict, repr=False)
    last_step: int = 0

    def __post_init__(self):
        self.tracker = FeatureTracker(self.n_layers)

    def params(self) -> dict:
        return {}

    def update(self, view: LayerView) -> None:
        if view.positions.shape[0] != 1:
            raise ValueError("RecurrenceObserver tracks one prompt at a time (batch of 1)")
        self.tracker.update(view.attn, view.positions, view.n_new, view.step, view.state)
        self.states[view.layer], self.positions[view.layer] = view.state, view.positions
        self.last_step = view.step

    def tokens(self, prompt_len: int) -> dict[str, np.ndarray]:
        """Per layer, per KV head and token: ``mri`` and ``span`` (decode steps it was observed over, ``[L, H, T]``),
        and ``output`` (``[T]``, True for generated tokens)."""
        layers = sorted(self.states)
        pos = self.positions[layers[0]][0, 0].cpu()
        current = int(pos.max())
        mri = np.stack([self.states[i]["f.max_interval"][0].cpu().numpy() for i in layers])
        span = np.minimum(current - pos.numpy(), self.last_step)
        return {"mri": mri.round(), "span": np.broadcast_to(span, mri.shape), "output": (pos >= prompt_len).numpy()}


def observe_recurrence(model, tokenizer, inputs: list[torch.Tensor], max_new_tokens: int,
                       progress: bool = False) -> list[dict]:
    """Decode each prompt (``[1, L]`` token ids) greedily with the full cache under `RecurrenceObserver`; one
    `tokens` dict per prompt (plus ``generated``, its output length)."""
    runs = []
    for ids in inputs:
        obs = RecurrenceObserver(n_layers=model.config.num_hidden_layers)
        result = generate(model, tokenizer, input_ids=ids, policy=obs, max_new_tokens=max_new_tokens,
                          stop_at_eos=True, progress=progress)
        run = obs.tokens(result.prompt_tokens)
        run["generated"] = int(result.new_tokens[0])
        runs.append(run)
    return runs


def table_of_runs(runs: list[dict], gaps=LONG_GAPS) -> tuple[list[int], np.ndarray, np.ndarray]:
    """`recurrence_table` over live runs: one snapshot per prompt, at its last decode step."""
    n_layers = runs[0]["mri"].shape[0]
    hits, counts = np.zeros((n_layers, len(gaps))), np.zeros((n_layers, len(gaps)))
    for run in runs:
        for g, k in enumerate(gaps):
            eligible = run["span"] > k
            counts[:, g] += eligible.sum(axis=(1, 2))
            hits[:, g] += (eligible & (run["mri"] >= k)).sum(axis=(1, 2))
    return list(range(n_layers)), hits / np.maximum(counts, 1), counts


def mri_distribution(runs: list[dict], bins=MRI_BINS) -> dict[str, np.ndarray]:
    """Share of (layer, KV head, token) entries per MRI bin, for the generated tokens and for the prompt's."""
    out = {}
    for part, want in (("output", True), ("prompt", False)):
        values = np.concatenate([r["mri"][:, :, r["output"] == want].ravel() for r in runs])
        counts = np.array([((values >= lo) & (values < hi)).sum() for lo, hi in bins], dtype=float)
        out[part] = counts / max(counts.sum(), 1)
    return out


def _bin_label(lo: int, hi: int) -> str:
    if hi - lo == 1:
        return "never" if lo == 0 else str(lo)
    return f">={lo}" if hi >= 1 << 30 else f"{lo}-{hi - 1}"


def format_mri(dist: dict[str, np.ndarray], bins=MRI_BINS) -> str:
    lines = ["| MRI (decode steps) | " + " | ".join(_bin_label(lo, hi) for lo, hi in bins) + " |",
             "|---" * (len(bins) + 1) + "|"]
    for part, share in dist.items():
        lines.append(f"| {part} tokens | " + " | ".join(f"{x:.1%}" for x in share) + " |")
    return "\n".join(lines)


def plot_mri(dist: dict[str, np.ndarray], path: str | Path, generated: list[int] | None = None,
             bins=MRI_BINS) -> Path:
    """Bar chart of the MRI distribution (share of tokens per bin), generated and prompt tokens side by side."""
    # matplotlib (~0.9 s, Agg backend set first) only when a plot is written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(bins))
    width = 0.4
    for i, (part, share) in enumerate(dist.items()):
        ax.bar(x + (i - 0.5) * width, share, width, label=f"{part} tokens")
    ax.set_xticks(x, [_bin_label(lo, hi) for lo, hi in bins], fontsize=8)
    ax.set_xlabel("maximum recurrence interval (decode steps)")
    ax.set_ylabel("share of tokens (all layers and KV heads)")
    title = "MRI distribution"
    if generated:
        title += f" ({len(generated)} prompts, median output {int(np.median(generated))} tokens)"
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def recurrence_table(trace_dir: str | Path, gaps=GAPS) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(layers, share [L, len(gaps)], tokens counted [L, len(gaps)])."""
    ds = load_traces(trace_dir).with_format("numpy", columns=["layer", "step", "n_heads", "n_tokens", "features"])
    mri, age = feature_index("max_interval"), feature_index("age")
    hits: dict[int, np.ndarray] = {}
    counts: dict[int, np.ndarray] = {}
    for row in ds:
        f = row["features"].reshape(int(row["n_heads"]), int(row["n_tokens"]), N_FEATURES)
        interval = np.expm1(f[..., mri]).round()
        # recurrence is tracked over decode steps, so a prompt token can only show gaps up to the decision step
        span = np.minimum(np.expm1(f[..., age]).round(), int(row["step"]))
        layer = int(row["layer"])
        h = hits.setdefault(layer, np.zeros(len(gaps)))
        c = counts.setdefault(layer, np.zeros(len(gaps)))
        for g, k in enumerate(gaps):
            eligible = span > k  # only tokens observed long enough to show a k-step gap
            c[g] += eligible.sum()
            h[g] += (eligible & (interval >= k)).sum()
    layers = sorted(hits)
    count = np.stack([counts[layer] for layer in layers])
    share = np.stack([hits[layer] for layer in layers]) / np.maximum(count, 1)
    return layers, share, count


def format_table(layers, share, count, gaps=GAPS) -> str:
    """Markdown: share per layer and gap, and the token-weighted share over all layers."""
    head = "| layer | " + " | ".join(f"gap >= {k}" for k in gaps) + " |"
    lines = [head, "|---" * (len(gaps) + 1) + "|"]
    for i, layer in enumerate(layers):
        lines.append(f"| {layer} | " + " | ".join(f"{share[i, g]:.1%}" for g in range(len(gaps))) + " |")
    total = (share * count).sum(0) / np.maximum(count.sum(0), 1)
    lines.append("| all | " + " | ".join(f"{t:.1%}" for t in total) + " |")
    return "\n".join(lines)


def plot(layers, share, path: str | Path, gaps=GAPS, title: str | None = None) -> Path:
    """Heat map (layer x gap) and one line per layer of the share of tokens regaining high attention."""
    # matplotlib (~0.9 s, Agg backend set first) only when a plot is written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    im = ax1.imshow(share.T, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1)
    ax1.set_xlabel("layer")
    ax1.set_yticks(range(len(gaps)), [str(k) for k in gaps])
    ax1.set_ylabel("gap k (decode steps)")
    ax1.set_xticks(range(len(layers)), [str(x) for x in layers], fontsize=6)
    ax1.set_title(title or "share of tokens regaining high attention after >= k steps", fontsize=9)
    fig.colorbar(im, ax=ax1)
    for i, layer in enumerate(layers):
        ax2.plot(gaps, share[i], color=plt.cm.viridis(i / max(len(layers) - 1, 1)), alpha=0.6)
    ax2.plot(gaps, share.mean(0), color="black", lw=2.5, label="mean over layers")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("gap k (decode steps)")
    ax2.set_ylabel("share of tokens")
    ax2.set_ylim(0, 1)
    ax2.legend()
    ax2.set_title("per layer (light = deeper)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(trace_dir: str | Path, out_png: str | Path | None = None) -> tuple[str, Path]:
    """From collected traces: the markdown table and the recurrence plot."""
    layers, share, count = recurrence_table(trace_dir)
    png = plot(layers, share, out_png or Path(trace_dir) / "recurrence.png")
    return format_table(layers, share, count), png


def live_report(runs: list[dict], out_png: str | Path, mri_png: str | Path, gaps=LONG_GAPS) -> tuple[str, Path, Path]:
    """From live runs (`observe_recurrence`): the recurrence table, the MRI table, and both plots."""
    layers, share, count = table_of_runs(runs, gaps)
    generated = [r["generated"] for r in runs]
    title = (f"share of tokens regaining high attention after >= k steps\n({len(runs)} prompts, median output "
             f"{int(np.median(generated))} tokens)")
    png = plot(layers, share, out_png, gaps, title=title)
    dist = mri_distribution(runs)
    mri = plot_mri(dist, mri_png, generated)
    text = (f"prompts: {len(runs)}, generated tokens: {generated} (median {int(np.median(generated))})\n\n"
            + format_table(layers, share, count, gaps) + "\n\n" + format_mri(dist))
    return text, png, mri
