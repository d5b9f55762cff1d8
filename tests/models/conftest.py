import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded GGUF converted to safetensors (cached on disk across runs)."""
    from detent.models.gguf import EmbeddedModelMissing, convert_gguf, embedded_gguf_path
    try:
        path = embedded_gguf_path()
    except EmbeddedModelMissing as e:
        pytest.skip(str(e))
    return convert_gguf(path)


@pytest.fixture(scope="session")
def embedded_model(embedded_dir):
    from detent.models import ModelConfig, load_model
    return load_model(ModelConfig.from_hf(embedded_dir), path=embedded_dir, dtype=torch.float32,
                      progress=False)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_dir):
    from detent.models import Tokenizer
    return Tokenizer(embedded_dir)
