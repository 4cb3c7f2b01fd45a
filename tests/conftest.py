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


def random_ids(length: int, batch: int = 1, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
