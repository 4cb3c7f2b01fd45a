"""Token importance recurrence (LazyEviction's observation), measured on collected traces.

For every layer: the share of cached tokens that came back to high (above-uniform) attention after a gap of at
least k decode steps, among tokens observed for more than k decode steps. LazyEviction reports that most tokens in
long reasoning recur and that their maximum recurrence interval (MRI) is far below the output length; this
table and plot show how that holds for a model and prompt set.

    python -m learnkv recurrence traces/
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from learnkv.features import N_FEATURES, feature_index
from learnkv.traces.store import load_traces

GAPS = (2, 4, 8, 16, 32, 64)


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
    head = "| layer | " + " | ".join(f"gap >= {k}" for k in gaps) + " |"
    lines = [head, "|---" * (len(gaps) + 1) + "|"]
    for i, layer in enumerate(layers):
        lines.append(f"| {layer} | " + " | ".join(f"{share[i, g]:.1%}" for g in range(len(gaps))) + " |")
    total = (share * count).sum(0) / np.maximum(count.sum(0), 1)
    lines.append("| all | " + " | ".join(f"{t:.1%}" for t in total) + " |")
    return "\n".join(lines)


def plot(layers, share, path: str | Path, gaps=GAPS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    im = ax1.imshow(share.T, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1)
    ax1.set_xlabel("layer")
    ax1.set_yticks(range(len(gaps)), [str(k) for k in gaps])
    ax1.set_ylabel("gap k (decode steps)")
    ax1.set_xticks(range(len(layers)), [str(x) for x in layers], fontsize=6)
    ax1.set_title("share of tokens regaining high attention after >= k steps")
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
    layers, share, count = recurrence_table(trace_dir)
    png = plot(layers, share, out_png or Path(trace_dir) / "recurrence.png")
    return format_table(layers, share, count), png
