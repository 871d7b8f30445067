"""rotary's RoPE inside a Hugging Face transformers model: :func:`patch_model`.

HF's decoder models compute RoPE in two places: the model's ``rotary_emb`` module turns ``position_ids`` into
cos/sin tables (float32 angles ``position_ids.float() * inv_freq``, times the rope type's attention scaling), and
each attention layer calls its modeling module's ``apply_rotary_pos_emb(q, k, cos, sin)`` (``rotate_half``).
:func:`patch_model` swaps both for rotary:

- the model's ``rotary_emb`` returns ``(position_ids, RotaryPositions)`` instead of ``(cos, sin)``: the ids pass
  through the decoder layers untouched, and :class:`RotaryPositions` (the second item) carries the spec of that
  layer type, read from the model's config with :meth:`rotary.RopeSpec.from_hf_config`, and the backend;
- the modeling module's ``apply_rotary_pos_emb`` becomes a function that calls :func:`rotary.apply_qk` on q and
  k at those positions when its ``sin`` is a :class:`RotaryPositions`, and HF's own function otherwise (so
  other models of the same family, patched or not, in the process are unaffected).

The rotation is then rotary's: exact angles at every position (float64 two-product, double-double reduction),
the spec's attention factor (YaRN, LongRoPE), the Numba / CUDA kernels, and under ``torch.compile`` one custom
op per layer (``fullgraph=True`` traces the model; see docs/interop.md). HF's ``(1, seq)`` position_ids with a
batch > 1 broadcast over the batch. Gemma 3's per-layer-type RoPE (``rotary_emb(x, position_ids, layer_type)``)
gets one spec per layer type. Not handled (an error says so): multi-axis M-RoPE (Qwen2-VL's
``apply_multimodal_rotary_pos_emb``), models whose modeling module has no ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import inspect
import sys

from ..spec.rope_spec import RopeSpec

_ORIGINAL = "_rotary_original_forward"


class RotaryPositions:
    """What a patched ``rotary_emb`` returns in place of ``sin``: the spec and backend of
    :func:`rotary.apply_qk` for the layers that receive it (one object per model and layer type)."""

    __slots__ = ("spec", "backend")

    def __init__(self, spec, backend):
        self.spec, self.backend = spec, backend

    def rotate(self, q, k, position_ids, unsqueeze_dim=1):
        """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` with rotary: q and k of shape
        (batch, heads, seq, head_dim) (``unsqueeze_dim=1``, HF's default) or (batch, seq, heads, head_dim) (2)."""
        from ..frontend.rotate import apply_qk

        seq_axis = {1: 2, 2: 1}.get(unsqueeze_dim % q.ndim if q.ndim == 4 else None)
        if seq_axis is None:
            raise ValueError(f"apply_rotary_pos_emb with rotary takes 4-D q and k with unsqueeze_dim 1 (batch, heads, "
                             f"seq, head_dim) or 2 (batch, seq, heads, head_dim); got q {tuple(q.shape)}, "
                             f"unsqueeze_dim={unsqueeze_dim}")
        return apply_qk(q, k, position_ids, spec=self.spec, seq_axis=seq_axis, backend=self.backend)

    def __repr__(self):
        return f"RotaryPositions({self.spec!r}, backend={self.backend!r})"


def _rotary_apply(original):
    """The modeling module's ``apply_rotary_pos_emb``: rotary for a patched model's positions, HF's otherwise."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if isinstance(sin, RotaryPositions):
            return sin.rotate(q, k, cos, *args, **kwargs)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._rotary_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _rotary_embedding(model):
    inner = getattr(model, "model", model)
    rope = getattr(inner, "rotary_emb", None)
    if rope is None or not callable(rope):
        raise TypeError(f"patch_model needs a Hugging Face decoder model with a rotary_emb module (model.rotary_emb or "
                        f"model.model.rotary_emb, e.g. LlamaForCausalLM); got {type(model).__name__}")
    return rope


def _modeling_modules(model):
    """The modules defining the model's attention classes (where ``apply_rotary_pos_emb`` is looked up)."""
    names = []
    for module in model.modules():
        name = type(module).__module__
        if type(module).__name__.endswith("Attention") and name not in names:
            names.append(name)
    return [sys.modules[name] for name in names]


def model_spec(model, layer_type: str | None = None) -> RopeSpec:
    """The :class:`rotary.RopeSpec` of an HF model (its config, as :func:`patch_model` reads it)."""
    config = getattr(model, "config", model)
    return RopeSpec.from_hf_config(config, layer_type=layer_type) if layer_type else RopeSpec.from_hf_config(config)


def patch_model(model, *, backend: str = "auto"):
    """Put rotary's RoPE into a Hugging Face transformers model, in place; returns the model.

    ``backend``: rotary's backend ("auto": Numba for CPU tensors, CUDA kernels for CUDA tensors). Patching twice
    changes the backend only; :func:`unpatch_model` restores HF's rotary embedding. See the module docstring and
    docs/interop.md ("Hugging Face transformers").
    """
    from .. import backends as _backends

    rope = _rotary_embedding(model)
    if not isinstance(backend, str) or (backend != "auto" and backend not in _backends.available_backends()):
        raise ValueError(f"backend must be 'auto' or one of {sorted(_backends.available_backends())}, got {backend!r}")
    modules = [m for m in _modeling_modules(model) if callable(getattr(m, "apply_rotary_pos_emb", None))]
    if not modules:
        raise TypeError(f"{type(model).__name__}: no modeling module with an apply_rotary_pos_emb function to patch "
                        "(rotary's HF patch covers models whose attention calls apply_rotary_pos_emb(q, k, cos, sin))")
    config = model.config
    layer_types = sorted(set(getattr(config, "layer_types", None) or ()))
    if layer_types and "layer_type" in inspect.signature(type(rope).forward).parameters:   # Gemma 3: one per type
        handles = {t: RotaryPositions(model_spec(config, t), backend) for t in layer_types}
    else:
        handles = {None: RotaryPositions(model_spec(config), backend)}
    for handle in handles.values():
        if handle.spec.multi_axis:
            raise NotImplementedError(f"{type(model).__name__} uses multi-axis RoPE ({handle.spec!r}): its attention "
                                      "calls apply_multimodal_rotary_pos_emb, which patch_model does not replace; "
                                      "call rotary.apply_qk with (batch, seq, n_axes) positions instead")

    def forward(x, position_ids, layer_type=None):
        return position_ids, handles[layer_type if len(handles) > 1 else None]

    if _ORIGINAL not in rope.__dict__:   # the rotary embedding's own forward (an instance one, if it had one)
        rope.__dict__[_ORIGINAL] = rope.__dict__.get("forward")
    rope.forward = forward
    for module in modules:
        if not hasattr(module.apply_rotary_pos_emb, "_rotary_original"):
            module.apply_rotary_pos_emb = _rotary_apply(module.apply_rotary_pos_emb)
    return model


def unpatch_model(model):
    """Give a patched model its own rotary embedding back (HF's cos/sin); returns the model. The modeling
    module's ``apply_rotary_pos_emb`` stays rotary's wrapper, which passes HF's cos/sin to HF's function."""
    rope = _rotary_embedding(model)
    if _ORIGINAL in rope.__dict__:
        original = rope.__dict__.pop(_ORIGINAL)
        if original is None:
            del rope.__dict__["forward"]
        else:
            rope.__dict__["forward"] = original
    return model
