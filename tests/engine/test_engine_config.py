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


def test_attention_backend_sets_the_default_tuples_attention():
    """By Detent's name or vLLM's; refused where it would not be the running tuple's choice."""
    from detent.engine.config import ATTENTION_BACKENDS
    for name, impl in ATTENTION_BACKENDS.items():
        assert EngineConfig(attention_backend=name).tuple_knobs() == {"attention": {"impl": impl}}
    assert EngineConfig().tuple_knobs() is None
    assert ATTENTION_BACKENDS["FLASH_ATTN"] == "fa4" and ATTENTION_BACKENDS["TRITON_ATTN"] == "triton_paged"
    with pytest.raises(ValueError, match="attention_backend must be one of .*FLASH_ATTN.*got 'FLASHINFER'"):
        EngineConfig(attention_backend="FLASHINFER")
    with pytest.raises(ValueError, match="names its own"):
        EngineConfig(attention_backend="fa4", tuple="t.json")
    with pytest.raises(ValueError, match="needs selection 'pinned'"):
        EngineConfig(attention_backend="fa4", selection="stock")


def test_the_attention_backend_is_the_dispatchers_tuple_and_its_fingerprint():
    """make_dispatcher builds the default tuple with the knob, and the fingerprint (which a TP engine
    computes without the ranks' dispatcher) hashes that same tuple: not the plain default's."""
    from detent.engine.fingerprint import fingerprint
    from detent.selection import active_tuple_hash, default_tuple, make_dispatcher, tuple_hash
    from detent.selection.compiler.commitment import TupleError
    from tests.selection.conftest import GPU
    facts = dict(GPU, fa4="4.0.0b36")
    knobs = EngineConfig(attention_backend="FLASH_ATTN").tuple_knobs()
    d = make_dispatcher(facts, "pinned", None, knobs)
    assert d.tuple.families["attention"]["knobs"]["impl"] == "fa4"
    plain = tuple_hash(default_tuple(facts))
    assert active_tuple_hash(d) != plain
    fp = fingerprint(facts, selection="pinned", tuple_path=None, knobs=knobs)
    assert fp.tuple_hash == active_tuple_hash(d)
    assert fingerprint(facts, selection="pinned", tuple_path=None).tuple_hash == plain
    with pytest.raises(ValueError, match="does not run"):
        make_dispatcher(facts, "stock", None, knobs)
    with pytest.raises(TupleError, match="detent\\[fa4\\]"):  # fa4 not installed here: its install line
        make_dispatcher(dict(GPU, fa4=""), "pinned", None, knobs)


def test_attention_backend_on_a_cpu_deployment_says_it_is_a_cuda_choice():
    from detent.engine import LLM
    with pytest.raises(ValueError, match="a choice of CUDA deployments"):
        LLM(attention_backend="triton_paged")
