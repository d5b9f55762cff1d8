"""Detent: a batch-invariant LLM inference engine.

The installable namespace is ``detent.*``; each top-level folder of the
repository (engine/, scheduler/, models/, selection/, kernels/, sampling/,
server/) installs as ``detent.<folder>`` (see pyproject.toml).
"""

__version__ = "0.1.0"
