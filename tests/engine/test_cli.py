"""`detent generate` on the embedded SmolLM2 (the README's main job)."""
import pytest

from detent.cli import build_parser, main


def test_parser_has_generate_and_its_options():
    args = build_parser().parse_args(["generate", "--max-tokens", "3", "--raw", "Hello", "there"])
    assert (args.command, args.max_tokens, args.raw, args.prompt) == ("generate", 3, True, ["Hello", "there"])


def test_bad_model_is_a_clear_error(capsys):
    assert main(["generate", "--model", "/nonexistent/model-dir", "hi"]) == 2
    assert "/nonexistent/model-dir" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_answers_paris(capsys):
    assert main(["generate", "--max-tokens", "12", "--max-model-len", "256", "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out
