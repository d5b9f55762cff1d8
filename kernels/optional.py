"""Checks shared by the candidates of optional packages (FlashAttention-4,
DeepGEMM): each is written for one exact release and one GPU generation, and
when either is missing it is not registered; the reason is recorded instead
(`registry.unavailable`), so asking for it says what to install."""
from __future__ import annotations

import importlib.metadata
from typing import Callable

import torch


def version_problem(dist: str, version: str, candidate: str, install: str) -> str | None:
    """Why `dist == version` is not what is installed, or None."""
    try:
        have = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} is not installed: {install}"
    if have != version:
        return f"{dist} {have} is installed; the {candidate} candidate is written for {version}: {install}"
    return None


def gpu_problem(needs: str, fits: Callable[[int, int], bool]) -> str | None:
    """Why this machine's GPU is not one `fits(major, minor)` accepts ("... needs ..."), or None."""
    if not torch.cuda.is_available():
        return f"{needs}; there is none here"
    major, minor = torch.cuda.get_device_capability()
    if not fits(major, minor):
        return f"{needs}; this GPU is sm{major}{minor}"
    return None
