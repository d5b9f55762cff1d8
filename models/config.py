"""`ModelConfig`: a Hugging Face `config.json` (+ `generation_config.json`)
normalized once, at the boundary, into one frozen dataclass.

Reads both config dialects: transformers 4 (`rope_theta`, `rope_scaling`)
and transformers 5 (`rope_parameters`); Mixtral/Qwen names for MoE fields
(`num_experts` / `num_local_experts`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# torch dtype names a config may carry ("torch_dtype" in transformers 4, "dtype" in 5)
_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
           "bfloat16": "bfloat16"}


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF architecture name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or a normalized dict: {"rope_type": "linear"|"llama3", "factor": ..., ...}
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "bfloat16"  # the checkpoint's dtype name
    model_type: str = ""

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"ModelConfig.dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok must be in 1..num_experts "
                                 f"({self.num_experts}), got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ValueError("ModelConfig.moe_intermediate_size must be positive for a MoE model")
        rs = self.rope_dict
        if rs is not None and rs.get("rope_type") not in SUPPORTED_ROPE_TYPES[1:]:
            raise ValueError(f"rope_scaling type {rs.get('rope_type')!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    # ------------------------------------------------------------------ views
    @property
    def rope_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_sparse(self, i: int) -> bool:
        """Qwen3-MoE's rule for which decoder layers use experts."""
        return (self.is_moe and i not in self.mlp_only_layers
                and (i + 1) % max(self.decoder_sparse_step, 1) == 0)

    def replace(self, **changes) -> "ModelConfig":
        from dataclasses import replace
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["rope_scaling"] = self.rope_dict
        return d

    # ------------------------------------------------------------ constructor
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict[str, Any],
                generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """Normalize a HF config: a directory holding config.json (and maybe
        generation_config.json), a path to a config.json, or the dict itself."""
        if isinstance(path_or_dict, dict):
            raw = dict(path_or_dict)
            gen = generation_config or {}
            where = "config dict"
        else:
            p = os.fspath(path_or_dict)
            cfg_path = os.path.join(p, "config.json") if os.path.isdir(p) else p
            if not os.path.isfile(cfg_path):
                raise FileNotFoundError(f"no config.json at {cfg_path}")
            where = cfg_path
            try:
                with open(cfg_path) as f:
                    raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
            gen = generation_config
            if gen is None:
                gpath = os.path.join(os.path.dirname(cfg_path), "generation_config.json")
                gen = {}
                if os.path.isfile(gpath):
                    with open(gpath) as f:
                        gen = json.load(f)
        return cls._from_raw(raw, gen, where)

    @classmethod
    def _from_raw(cls, raw: dict[str, Any], gen: dict[str, Any], where: str) -> "ModelConfig":
        if "text_config" in raw and "hidden_size" not in raw:
            raw = {**raw["text_config"], "architectures": raw.get("architectures")}

        def need(key: str, *alts: str):
            for k in (key, *alts):
                if raw.get(k) is not None:
                    return raw[k]
            raise ValueError(f"{where}: missing required field {key!r}")

        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"{where}: missing 'architectures' (e.g. [\"LlamaForCausalLM\"])")
        for flag in ("mlp_bias", "use_sliding_window"):
            if raw.get(flag):
                raise ValueError(f"{where}: {flag}=true is not supported")
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (supported: silu)")
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = raw.get("head_dim") or hidden // heads

        # rope: transformers 5 writes rope_parameters (theta inside); 4 writes rope_theta + rope_scaling
        rp = raw.get("rope_parameters") or {}
        rs = raw.get("rope_scaling") or None
        theta = float(rp.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = None
        src = rs if rs else rp
        rtype = src.get("rope_type", src.get("type", "default")) if src else "default"
        if rtype not in ("default", None):
            scaling = {k: v for k, v in src.items() if k not in ("rope_theta", "type")}
            scaling["rope_type"] = rtype
            if rtype == "linear" and "factor" not in scaling:
                raise ValueError(f"{where}: linear rope scaling needs 'factor'")
            if rtype == "llama3":
                for k in ("factor", "low_freq_factor", "high_freq_factor",
                          "original_max_position_embeddings"):
                    if k not in scaling:
                        raise ValueError(f"{where}: llama3 rope scaling needs {k!r}")

        model_type = raw.get("model_type", "")
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        eos = _ids(gen.get("eos_token_id")) or _ids(raw.get("eos_token_id"))
        bos = gen.get("bos_token_id", raw.get("bos_token_id"))
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16").removeprefix("torch.")
        return cls(
            architecture=archs[0],
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size") or 4 * hidden),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if scaling is None else tuple(sorted(scaling.items())),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe") or archs[0].startswith("Qwen3"),
            attention_bias=bool(raw.get("attention_bias", False)),
            num_experts=num_experts,
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0) if num_experts else 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            eos_token_ids=eos,
            bos_token_id=None if bos is None else int(bos),
            dtype=_DTYPES.get(dtype, dtype),
            model_type=model_type,
        )
