import contextlib
import os

# before anything imports triton or wandb or touches the hub
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Property tests draw the same examples on every run (CI and a local run fail alike);
# HYPOTHESIS_PROFILE=explore draws new ones.
from hypothesis import settings  # noqa: E402

settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(scope="session")
def tiny():
    """Random-init GQA Llama (2 layers, 4 query heads, 2 KV heads), learnkv attention."""
    from learnkv.model import tiny_model

    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def smollm2():
    """The bundled real model (converted once into the cache directory)."""
    from learnkv.model import load_model

    return load_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The bundled model's tokenizer alone (no weights loaded)."""
    from transformers import AutoTokenizer

    from learnkv.model import prepare_smollm2

    return AutoTokenizer.from_pretrained(prepare_smollm2())


@pytest.fixture(scope="session")
def small(smollm2_tokenizer):
    """A random-init GQA Llama with SmolLM2's vocabulary (2 layers), and SmolLM2's tokenizer: real text, fast
    decoding."""
    from learnkv.model import tiny_model

    return tiny_model(seed=1, vocab_size=len(smollm2_tokenizer), num_layers=2), smollm2_tokenizer


def random_ids(length: int, batch: int = 1, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def eos_token(model, token: int):
    """Make ``token`` the model's EOS for the block (the tiny model has none), so a row stops where it writes it."""
    model.generation_config.eos_token_id = token
    try:
        yield
    finally:
        model.generation_config.eos_token_id = None


_SCORERS: dict[tuple, str] = {}


def scorer_for(n_layers: int, n_kv_heads: int = 2, model: str = "test", content_dim: int = 0) -> str:
    """A random-init scorer exported for a model with ``n_layers`` layers and ``n_kv_heads`` KV heads, bound to
    ``model`` (what `learned` needs in policy matrices; the unnamed tiny model is bound by shape only); with
    ``content_dim`` (the model's head dimension), content features with random weights (they start at zero)."""
    key = (n_layers, n_kv_heads, model, content_dim)
    if key not in _SCORERS:
        import tempfile

        from learnkv.scorer.artifact import export_scorer
        from learnkv.scorer.model import Scorer

        torch.manual_seed(n_layers)
        scorer = Scorer(n_layers, content_dim=content_dim, n_heads=n_kv_heads if content_dim else 0)
        if content_dim:
            torch.nn.init.normal_(scorer.wc)
        path = export_scorer(scorer, tempfile.mkdtemp(prefix="learnkv-test-scorer-") + "/scorer",
                             model=model, n_kv_heads=n_kv_heads)
        _SCORERS[key] = str(path)
    return _SCORERS[key]


def params_for(policy: str, n_layers: int, **binding) -> dict:
    """Extra parameters a registered policy needs to run in a test matrix (``binding``: see `scorer_for`)."""
    return {"scorer": scorer_for(n_layers, **binding)} if policy == "learned" else {}


def prefill_for(policy: str) -> dict:
    """`generate` arguments a policy needs when the test's prompt is over the budget: a prefill policy for one that
    observes nothing at the prefill (LazyEviction), which otherwise refuses to decide there."""
    from learnkv.policies import POLICIES

    return {} if POLICIES[policy].scores_prefill else {"prefill_policy": "snapkv"}
