"""Helpers for formats whose config files transformers owns: the families' ``from_config`` and
``to_config`` read and make transformers' own config objects through these, so every default,
every release's serialisation (legacy ``rope_theta``/``rope_scaling`` beside transformers 5's
``rope_parameters``, non-finite floats) and every validation is transformers'."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zoo.errors import UsageError


def library_config(config: Any) -> Any:
    """transformers' config object for ``config``: returned as it is when it already is one; a
    document (``config.json``'s dict) is handed to ``AutoConfig.for_model`` by its ``model_type``."""
    from transformers import PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if not isinstance(config, Mapping) or not isinstance(config.get("model_type"), str):
        raise UsageError(f"expected a transformers config or a config document with a model_type, got "
                         f"{type(config).__name__}")
    doc = dict(config)
    return _made(doc.pop("model_type"), doc)


def make_config(model_type: str, **fields: Any) -> Any:
    """transformers' config of ``model_type`` with ``fields``, validated by transformers (RoPE is
    given by `rope_fields`, which knows the release's form). Fields the class does not declare stay
    attributes its model reads (Qwen3-MoE's ``head_dim``), as they do when read from a file."""
    return _made(model_type, fields)


def _made(model_type: str, fields: Mapping[str, Any]) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # (transformers' validators raise huggingface_hub's own error types too)
        reason = " ".join(str(e).split())
        raise UsageError(f"transformers' {model_type} config refuses these values: {reason[:400]}") from None


def rope_fields(model_type: str, theta: float, scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    """The RoPE fields of ``model_type``'s installed config class: transformers 5's
    ``rope_parameters``, or 4.x's ``rope_theta`` and ``rope_scaling``."""
    from transformers import AutoConfig

    from zoo.checkpoint.fields import class_fields

    names = set(class_fields(type(AutoConfig.for_model(model_type)), own=False))
    if "rope_parameters" in names:
        return {"rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None}


# RoPE variants zoo computes (`zoo.nn.rope_inv_freq`), and the keys each reads.
_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}


def rope_of(config: Any, *, what: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of a transformers config in either release's form, or of one RoPE table
    (a mapping: Gemma 3's per-layer-kind ``rope_parameters``); a RoPE type zoo does not compute, or
    a key its type does not read (an attention factor, a partial rotary fraction), is refused
    naming it."""
    if isinstance(config, Mapping):
        params = config
    else:
        params = getattr(config, "rope_parameters", None)
        if params is None:  # (4.x)
            params = {**(getattr(config, "rope_scaling", None) or {}), "rope_theta": getattr(config, "rope_theta", 10000.0)}
    params = dict(params)
    theta = float(params.pop("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KEYS:
        raise UsageError(f"{what}: rope_parameters.rope_type={kind!r} is not computed by zoo (supported: "
                         f"{', '.join(_ROPE_KEYS)})")
    extra = sorted(k for k, v in params.items() if k not in _ROPE_KEYS[kind] | {"rope_type", "type"} and v is not None)
    if extra:
        raise UsageError(f"{what}: rope_parameters.{extra[0]}={params[extra[0]]!r} with rope_type {kind!r} has no "
                         "equivalent in zoo")
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **{k: params[k] for k in sorted(_ROPE_KEYS[kind]) if k in params}}
