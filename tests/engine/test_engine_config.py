"""EngineConfig checks the user's choices once, against the lists of the floors that use them."""
from types import SimpleNamespace

import pytest
import torch

from detent.engine.config import SELECTION_MODES, EngineConfig
from detent.models.loader import DTYPES, LOAD_FORMATS


def test_every_name_the_loader_takes_is_accepted_and_resolves_alike():
    mc = SimpleNamespace(dtype="float32")  # a ModelConfig's checkpoint dtype
    for name, dtype in DTYPES.items():  # "bf16", "fp16", "fp32" were refused here, taken by load_model
        assert EngineConfig(dtype=name).resolve_dtype(mc, torch.device("cpu")) == dtype
    cuda = torch.device("cuda")  # "auto": the checkpoint's dtype on GPU, bfloat16 if it names none we know
    assert EngineConfig().resolve_dtype(mc, cuda) == torch.float32
    assert EngineConfig().resolve_dtype(SimpleNamespace(dtype="int8"), cuda) == torch.bfloat16
    assert EngineConfig().resolve_dtype(mc, torch.device("cpu")) == torch.float32
    for fmt in LOAD_FORMATS:
        EngineConfig(load_format=fmt)
    for mode in SELECTION_MODES:
        EngineConfig(selection=mode)


@pytest.mark.parametrize("field,value,listed", [("dtype", "int8", "bfloat16"), ("load_format", "pt", "gguf"),
                                                ("selection", "fast", "conservative")])
def test_a_bad_choice_names_the_field_and_the_choices(field, value, listed):
    with pytest.raises(ValueError, match=f"{field} must be one of .*{listed}.*got '{value}'"):
        EngineConfig(**{field: value})
