"""`resolve_model`: what `model=` names, turned into a config and the files
to load.

Accepted, in this order: None (the embedded SmolLM2 GGUF), a local
directory with config.json, a local .gguf file, a preset name
(`detent.models.presets`), or a Hugging Face repo id "ORG/NAME" found in the
offline HF cache (`$HF_HUB_CACHE` / `$HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else
~/.cache/huggingface/hub). Nothing is downloaded. `resolve_tokenizer` finds
a tokenizer given apart from its model (`tokenizer=`) the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from detent.models.config import ModelConfig
from detent.models.presets import DEFAULT_PRESET, PRESETS, preset


class ModelNotFound(FileNotFoundError):
    pass


@dataclass(frozen=True)
class ResolvedModel:
    config: ModelConfig
    path: str | None  # weights directory for load_model (None: dummy weights)
    tokenizer_source: str | None  # directory with tokenizer.json (None: no tokenizer)
    load_format: str  # "safetensors" or "dummy": what to pass to load_model
    name: str  # the served model name
    source: str  # "embedded", "local", "hf-cache", "preset"
    directory: str | None = None  # the directory of its config.json (None: a preset's dummy weights)


def hf_hub_cache() -> str:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.environ[var]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def find_in_hf_cache(repo_id: str) -> str | None:
    """The snapshot directory of `repo_id` (refs/main first, else the newest
    snapshot that has a config.json), or None."""
    base = os.path.join(hf_hub_cache(), "models--" + repo_id.replace("/", "--"))
    snaps = os.path.join(base, "snapshots")
    if not os.path.isdir(snaps):
        return None
    ref = os.path.join(base, "refs", "main")
    if os.path.isfile(ref):
        with open(ref) as f:
            d = os.path.join(snaps, f.read().strip())
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
    cands = [os.path.join(snaps, s) for s in os.listdir(snaps)]
    cands = [d for d in cands if os.path.isfile(os.path.join(d, "config.json"))]
    return max(cands, key=os.path.getmtime) if cands else None


def _has_tokenizer(d: str | None) -> bool:
    return d is not None and os.path.isfile(os.path.join(d, "tokenizer.json"))


def _check_format(load_format: str) -> None:
    from detent.models.loader import LOAD_FORMATS
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")


def _from_dir(d: str, load_format: str, name: str, source: str) -> ResolvedModel:
    cfg = ModelConfig.from_hf(d)
    fmt = "dummy" if load_format == "dummy" else "safetensors"
    return ResolvedModel(cfg, d if fmt == "safetensors" else None, d if _has_tokenizer(d) else None,
                         fmt, name, source, d)


def _from_gguf(gguf_path: str, load_format: str, name: str, source: str) -> ResolvedModel:
    from detent.models.gguf import convert_gguf
    return _from_dir(convert_gguf(gguf_path), load_format, name, source)


def resolve_model(name_or_path: str | os.PathLike | None = None, load_format: str = "auto") -> ResolvedModel:
    _check_format(load_format)
    if name_or_path is None:
        from detent.models.gguf import EmbeddedModelMissing, embedded_gguf_path
        try:
            gguf_path = embedded_gguf_path()
        except EmbeddedModelMissing:
            if load_format == "dummy":  # shapes need no files
                return _preset_dummy(DEFAULT_PRESET, None)
            raise
        return _from_gguf(gguf_path, load_format, DEFAULT_PRESET, "embedded")

    spec = os.fspath(name_or_path)
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFound(f"model directory {os.path.abspath(path)} has no config.json")
        return _from_dir(path, load_format, spec, "local")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return _from_gguf(path, load_format, os.path.basename(path).removesuffix(".gguf"), "local")
        raise ModelNotFound(f"model path {path} is a file; pass a directory with config.json or a .gguf file")

    p = preset(spec)
    repos = p["repos"] if p else ((spec,) if spec.count("/") == 1 else ())
    for repo in repos:
        snap = find_in_hf_cache(repo)
        if snap is not None:
            return _from_dir(snap, load_format, spec, "hf-cache")
    if p is not None:
        if load_format == "dummy":
            return _preset_dummy(spec.strip().lower(), None)
        if spec.strip().lower() == DEFAULT_PRESET:
            return resolve_model(None, load_format)
    raise ModelNotFound(_not_found_message(spec, path, repos))


def resolve_tokenizer(name_or_path: str | os.PathLike) -> str:
    """The directory of the tokenizer `name_or_path` names, as `resolve_model` finds a model's:
    a local directory, or a Hugging Face repo id "ORG/NAME" in the offline cache; it must
    hold tokenizer.json."""
    spec = os.fspath(name_or_path)
    path = os.path.expanduser(spec)
    d = path if os.path.isdir(path) else find_in_hf_cache(spec) if spec.count("/") == 1 else None
    if d is None:
        where = f" nor a Hugging Face repo in {hf_hub_cache()}" if spec.count("/") == 1 else ""
        raise ModelNotFound(f"tokenizer {spec!r}: not a directory ({os.path.abspath(path)}){where}")
    if not _has_tokenizer(d):
        raise ModelNotFound(f"tokenizer {spec!r}: no tokenizer.json in {d} (Detent reads fast-tokenizer files; "
                            f"save one with transformers' tokenizer.save_pretrained)")
    return d


def _preset_dummy(name: str, tokenizer: str | None) -> ResolvedModel:
    cfg = ModelConfig.from_hf(PRESETS[name]["config"])
    return ResolvedModel(cfg, None, tokenizer, "dummy", name, "preset")


def _not_found_message(spec: str, path: str, repos: tuple[str, ...]) -> str:
    cache = hf_hub_cache()
    lines = [f"cannot resolve model {spec!r}. Looked for:",
             f"  a local directory or .gguf file: {os.path.abspath(path)} (does not exist)"]
    if repos:
        for r in repos:
            lines.append(f"  Hugging Face cache: {os.path.join(cache, 'models--' + r.replace('/', '--'))} "
                         f"(not there)")
    else:
        lines.append(f"  a preset name: not one of {', '.join(sorted(PRESETS))}")
    repo = repos[0] if repos else "ORG/NAME"
    local = f"models/{repo.split('/')[-1]}"
    lines += [f"Get the weights with huggingface_hub's `hf` command (pip install -U huggingface_hub):",
              f"    hf download {repo}    # into the Hugging Face cache (honours HF_HOME); then pass {spec!r} again",
              f"    hf download {repo} --local-dir {local}    # then pass {local}",
              "or pass a local directory with config.json + *.safetensors + tokenizer.json, or use "
              "load_format='dummy' with a preset for random weights at the real shapes."]
    return "\n".join(lines)
