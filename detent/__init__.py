"""Detent: a batch-invariant LLM inference engine.

The installable namespace is ``detent.*``; each top-level folder of the
repository (engine/, scheduler/, models/, selection/, kernels/, sampling/,
server/) installs as ``detent.<folder>`` (see pyproject.toml).

    from detent import LLM, SamplingParams      # as `from vllm import LLM, SamplingParams`

The offline API's names are imported on first use, so `import detent`
(and the CLI's startup) stays light.
"""

__version__ = "0.1.0"

_OFFLINE = ("LLM", "SamplingParams", "TokensPrompt", "TextPrompt", "RequestOutput", "CompletionOutput")


def __getattr__(name: str):
    if name in _OFFLINE:
        from detent import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'detent' has no attribute {name!r}")


__all__ = ["__version__", *_OFFLINE]
