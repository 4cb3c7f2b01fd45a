"""The exported scorer: a directory with ``scorer.safetensors`` and ``manifest.json``. Needs only torch and
safetensors to load, so the `learned` policy and the serving runtime use it without any training code.

The manifest holds the format version, the feature list and version, the model the scorer was trained for, its
layer and KV-head counts, the training-config digest, metrics, and the sha256 of the weights file. Loading refuses
another format, feature version or pooling rule, a weights file whose checksum differs, tensors whose shapes
disagree with the manifest, or non-finite weights, with a message naming both sides. `check_binding` is the one
check of an artifact against the model it would run on (name, layers, KV heads): the `learned` policy and the
serving runtime both call it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from learnkv.atomic import read_json_object, sha256_file
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
                  metrics: dict | None = None, extra: dict | None = None, allocation: str = "uniform") -> Path:
    """Write the artifact directory atomically (a temporary directory renamed into place). ``allocation`` is the
    budget allocation the scorer was trained for (`trained_allocation`; issue 42)."""
    bad = _non_finite(scorer.state_dict())
    if bad:
        raise ArtifactError(f"refusing to export a scorer with non-finite weights ({bad}): training diverged; "
                            "lower train.lr and train again")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    tensors = {k: v.detach().cpu().contiguous() for k, v in scorer.state_dict().items()}
    # one metadata key: safetensors writes its metadata in hash order, so two keys made the file's bytes (and so
    # ``weights_sha256``) differ between two writes of the same weights; the manifest holds the format checked on load
    save_file(tensors, tmp / WEIGHTS, metadata={"format": f"{FORMAT}/{FORMAT_VERSION}"})
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "feature_version": FEATURE_VERSION,
        "features": list(FEATURES),
        "model": model,
        "n_layers": scorer.n_layers,
        "n_kv_heads": n_kv_heads,
        "pooling": POOLING,  # how layers and heads share one block decision in serving (`learnkv.pooling`)
        "allocation": allocation,
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

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def read_artifact_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise ArtifactError(f"no scorer artifact at {path} (expected {MANIFEST} and {WEIGHTS}; `python train.py` writes one)")
    manifest = read_json_object(path / MANIFEST, "a scorer manifest", ArtifactError)
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
    pooling = manifest.get("pooling", POOLING)  # artifacts predating the field only had this rule
    if pooling != POOLING:
        raise ArtifactError(f"{path}: pooling rule {pooling!r}; this learnkv pools with {POOLING!r}")
    return manifest


def same_model(bound: str, model: str) -> bool:
    """Whether an artifact bound to ``bound`` (the name it was trained with: a bundled alias, a hub id or a path)
    belongs to ``model`` (the id or folder a model was loaded from): the same name, or ``model``'s folder name
    (bundled models live in folders named by their alias), or, for a local path, the same folder name."""
    bound_name, model_name = bound.rstrip("/"), model.rstrip("/")
    if bound_name in (model_name, model_name.rsplit("/", 1)[-1]):
        return True
    return bound_name.startswith((".", "/", "~")) and Path(bound_name).name == Path(model_name).name


def caches_latent(config) -> bool:
    """Whether a model config is multi-head latent attention (DeepSeek-V2/V3): its cache holds one compressed latent
    per token as the "keys" and the latent's rotary key part as the "values", not per-head keys and values."""
    return bool(getattr(config, "kv_lora_rank", None))


def cached_kv_heads(config) -> int:
    """KV heads a layer's cache holds per token: the config's KV heads (all query heads without GQA), or one for
    multi-head latent attention (DeepSeek-V2/V3 cache one latent per token, shared by every head)."""
    if caches_latent(config):
        return 1
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


# what each allocation compares scores across (`learnkv.allocation`): a scorer serves the allocations that compare
# its scores across what it was trained to rank together. ``uniform`` and ``pyramid`` rank within one head (pyramid
# only sizes each layer's budget), ``head`` across a layer's heads, ``global`` across every layer and head.
COMPARES_ACROSS = {"uniform": "a head", "pyramid": "a head", "head": "a layer's heads",
                   "global": "every layer and head"}


def trained_allocation(manifest: dict) -> str:
    """The budget allocation a scorer was trained for (`learnkv.allocation.ALLOCATIONS`): ``uniform`` for a scorer
    whose scores rank tokens within one head (every artifact before the field), ``global`` for one trained to rank
    every layer's and head's tokens on one scale."""
    return str(manifest.get("allocation", "uniform"))


def check_binding(manifest: dict, path: str | Path, *, model: str | None = None, n_layers: int | None = None,
                  n_kv_heads: int | None = None, allocation: str | None = None) -> None:
    """Refuse (`ArtifactError`) an artifact trained for another model (another name, layer or KV-head count) or,
    where ``allocation`` is given, for another budget allocation than the one asked for.

    Each given fact is checked; None skips it (a model without a name, such as a test model, cannot be bound by
    name, but its shape still is; the decode loop may run a scorer under any allocation as an experiment, serving
    may not)."""
    if model and not same_model(str(manifest.get("model")), model):
        raise ArtifactError(f"{path}: scorer was trained for model {manifest.get('model')!r}, not {model!r}")
    if n_layers is not None and manifest.get("n_layers") != n_layers:
        raise ArtifactError(f"{path}: scorer has {manifest.get('n_layers')} layers, the model has {n_layers}")
    if n_kv_heads is not None and manifest.get("n_kv_heads") != n_kv_heads:
        raise ArtifactError(f"{path}: scorer has {manifest.get('n_kv_heads')} KV heads, the model has {n_kv_heads}")
    trained = trained_allocation(manifest)
    if allocation is not None and COMPARES_ACROSS.get(trained, trained) != COMPARES_ACROSS.get(allocation, allocation):
        raise ArtifactError(f"{path}: scorer was trained for allocation {trained!r}, not {allocation!r} (its scores "
                            f"rank tokens within {COMPARES_ACROSS.get(trained, trained)}, {allocation!r} compares them "
                            f"across {COMPARES_ACROSS.get(allocation, allocation)}); export one trained for it or use "
                            f"allocation={trained!r}")


def _non_finite(tensors: dict) -> str:
    """Names of the tensors holding NaN or infinity, comma-separated ('' if none)."""
    return ", ".join(k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))


def load_scorer(path: str | Path, expect_model: str | None = None, expect_layers: int | None = None,
                expect_kv_heads: int | None = None, expect_allocation: str | None = None) -> tuple[Scorer, dict]:
    """(scorer in eval mode, manifest); refuses a wrong version, a tampered or inconsistent weights file, non-finite
    weights, or another model (`check_binding`)."""
    path = Path(path)
    manifest = read_artifact_manifest(path)
    weights = path / manifest.get("weights", WEIGHTS)
    if not weights.is_file():
        raise ArtifactError(f"{path}: weights file {weights.name} is missing")
    digest = sha256_file(weights)
    if digest != manifest.get("weights_sha256"):
        raise ArtifactError(f"{weights}: sha256 {digest[:12]}… does not match the manifest's {str(manifest.get('weights_sha256'))[:12]}…; the file was altered")
    check_binding(manifest, path, model=expect_model, n_layers=expect_layers, n_kv_heads=expect_kv_heads,
                  allocation=expect_allocation)
    arch = manifest.get("architecture")
    try:
        scorer = Scorer(int(arch["n_layers"]), int(arch["n_features"]), int(arch["hidden"]),
                        int(arch.get("content_dim", 0)), int(arch.get("n_heads", 0)),
                        bool(arch.get("head_bias", False)))
    except (TypeError, KeyError, ValueError, RuntimeError):
        raise ArtifactError(
            f"{path}: manifest 'architecture' {arch!r} is not n_layers, n_features, hidden >= 1") from None
    declared = {"n_layers": manifest.get("n_layers"), "n_features": len(manifest["features"])}
    for key, value in declared.items():
        if arch[key] != value:
            raise ArtifactError(f"{path}: architecture says {key}={arch[key]}, the manifest {value}; "
                                "the artifact is inconsistent")
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{weights}: cannot be read as safetensors ({e})") from None
    expected = {k: tuple(v.shape) for k, v in scorer.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in tensors.items()}
    if found != expected:
        diff = sorted(f"{k} {found.get(k, 'missing')} (expected {expected.get(k, 'none')})"
                      for k in set(found) | set(expected) if found.get(k) != expected.get(k))
        raise ArtifactError(f"{weights}: tensor shapes disagree with the manifest: {'; '.join(diff)}")
    bad = _non_finite(tensors)
    if bad:
        raise ArtifactError(f"{weights}: non-finite weights in {bad} (a diverged training run); "
                            "retrain with a lower train.lr")
    scorer.load_state_dict(tensors)
    return scorer.eval(), manifest
