"""A tuple made for another max_model_len is refused with the command that makes a matching one;
that command's tuple then starts the engine."""
from __future__ import annotations

import re
import shlex

import pytest

from detent.engine import LLM
from detent.selection import FactMismatch
from detent.selection_cli import main as selection_main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from detent.models.tiny import write_tiny_llama
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "m"))


def test_max_model_len_mismatch_says_how_to_make_a_matching_tuple(tiny, tmp_path):
    old = tmp_path / "old.json"
    assert selection_main(["tuple", "default", "--model", tiny, "--max-model-len", "64", "-o", str(old)]) == 0
    with pytest.raises(FactMismatch) as e:
        LLM(model=tiny, tuple=str(old), max_model_len=128, device="cpu")
    msg = str(e.value)
    assert "deployment fact 'max_context' differs: the tuple was made for 64, this deployment has 128" in msg
    assert "or run with the tuple's value: --max-model-len 64 (LLM(..., max_model_len=64))" in msg
    [cmd] = re.findall(r"^    (detent tuple default .*)$", msg, flags=re.M)
    assert "--max-model-len 128" in cmd and f"--model {shlex.quote(tiny)}" in cmd

    new = tmp_path / "t.json"  # run the command as printed (its -o names t.json; write it here)
    argv = shlex.split(cmd)[1:]
    argv[argv.index("-o") + 1] = str(new)
    assert selection_main(argv) == 0
    llm = LLM(model=tiny, tuple=str(new), max_model_len=128, device="cpu")
    try:
        assert llm.llm_engine.limits().max_model_len == 128
    finally:
        llm.shutdown()


def test_a_page_size_mismatch_gets_the_command_and_the_block_size_flag(tiny, tmp_path):
    t = tmp_path / "t.json"
    assert selection_main(["tuple", "default", "--model", tiny, "--max-model-len", "128", "--page-size", "32",
                           "-o", str(t)]) == 0
    with pytest.raises(FactMismatch, match=r"(?s)'page_size' differs.*--page-size 16 .*or run with the "
                                           r"tuple's value: --block-size 32 \(LLM\(\.\.\., block_size=32\)\)"):
        LLM(model=tiny, tuple=str(t), max_model_len=128, device="cpu")
