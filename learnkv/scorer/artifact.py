"""The exported scorer: a directory with ``scorer.safetensors`` and ``manifest.json``. Needs only torch and
safetensors to load, so the `learned` policy and the serving runtime use it without any training code.

The manifest holds the format version, the feature list and version, the model the scorer was trained for, its
layer and KV-head counts, the training-config digest, metrics, and the sha256 of the weights file. Loading refuses
another format or feature version, or a weights file whose checksum differs, with a message naming both sides.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from learnkv.atomic import sha256_file
from learnkv.features import FEATURE_VERSION, FEATURES
from learnkv.pooling import POOLING
from learnkv.scorer.model import Scorer

FORMAT = "learnkv-scorer"
FORMAT_VERSION = 1
WEIGHTS = "scorer.safetensors"
MANIFEST = "manifest.json"


class ArtifactError(ValueError):
    """An exported scorer that cannot be used; the message says what and why."""


def export_scorer(scorer: Scorer, out: str | Path, *, model: str, n_kv_heads: int, config_digest: str = "",
                  metrics: dict | None = None, extra: dict | None = None) -> Path:
    """Write the artifact directory atomically (a temporary directory renamed into place)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    tensors = {k: v.detach().cpu().contiguous() for k, v in scorer.state_dict().items()}
    save_file(tensors, tmp / WEIGHTS, metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "feature_version": FEATURE_VERSION,
        "features": list(FEATURES),
        "model": model,
        "n_layers": scorer.n_layers,
        "n_kv_heads": n_kv_heads,
        "pooling": POOLING,  # how layers and heads share one block decision in serving (`learnkv.pooling`)
        "architecture": scorer.config(),
        "normalization": {"mean": scorer.mean.tolist(), "std": scorer.std.tolist()},
        "config_digest": config_digest,
        "metrics": metrics or {},
        "weights": WEIGHTS,
        "weights_sha256": sha256_file(tmp / WEIGHTS),
        **(extra or {}),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        old = out.with_name(out.name + f".old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def read_artifact_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise ArtifactError(f"no scorer artifact at {path} (expected {MANIFEST} and {WEIGHTS}; `python train.py` writes one)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path / MANIFEST} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format {manifest.get('format')!r} version {manifest.get('format_version')}, "
            f"this learnkv reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    if manifest.get("feature_version") != FEATURE_VERSION or manifest.get("features") != list(FEATURES):
        raise ArtifactError(
            f"{path}: scorer was trained on feature version {manifest.get('feature_version')}, this learnkv computes "
            f"version {FEATURE_VERSION}; retrain it"
        )
    return manifest


def load_scorer(path: str | Path, expect_model: str | None = None, expect_layers: int | None = None) -> tuple[Scorer, dict]:
    """(scorer in eval mode, manifest); refuses a wrong version, a tampered weights file or another model."""
    from safetensors.torch import load_file

    path = Path(path)
    manifest = read_artifact_manifest(path)
    weights = path / manifest.get("weights", WEIGHTS)
    if not weights.is_file():
        raise ArtifactError(f"{path}: weights file {weights.name} is missing")
    digest = sha256_file(weights)
    if digest != manifest.get("weights_sha256"):
        raise ArtifactError(f"{weights}: sha256 {digest[:12]}… does not match the manifest's {str(manifest.get('weights_sha256'))[:12]}…; the file was altered")
    if expect_model is not None and manifest.get("model") != expect_model:
        raise ArtifactError(f"{path}: scorer was trained for model {manifest.get('model')!r}, not {expect_model!r}")
    if expect_layers is not None and manifest.get("n_layers") != expect_layers:
        raise ArtifactError(f"{path}: scorer has {manifest.get('n_layers')} layers, the model has {expect_layers}")
    arch = manifest["architecture"]
    scorer = Scorer(arch["n_layers"], arch["n_features"], arch["hidden"])
    scorer.load_state_dict(load_file(weights))
    return scorer.eval(), manifest
