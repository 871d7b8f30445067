"""Adapters between rotary's conformance cases and the RoPE signatures other code has.

A case is one rotation of seeded data laid out (batch, seq, heads, head_dim) at given positions with a
:class:`~rotary.RopeSpec`. An adapter turns it into the call an implementation takes, runs it and
returns the results as float64 NumPy arrays in the same layout:

- ``plain``: ``f(x, positions, spec) -> y``. x (batch, seq, heads, head_dim); positions an integer array
  of shape (seq,) or (batch, seq) in x's array library (a scalar offset arrives as
  ``offset + arange(seq)``); ``inverse=True`` is passed to the inverse cases when f accepts it.
- ``hf``: HF's ``apply_rotary_pos_emb(q, k, cos, sin) -> (q, k)`` on (batch, heads, seq, head_dim)
  torch tensors; cos/sin (batch, seq, rotary_dim) in q's dtype, each frequency written twice in the
  spec's layout (``cat(c, c)`` for "half", ``repeat_interleave(c, 2)`` for "interleaved") and times the
  attention factor, as HF's rotary modules return them. ``cos_sin(spec, q, position_ids) -> (cos, sin)``
  replaces them with the implementation's own (e.g. an HF ``...RotaryEmbedding`` module's forward).
- ``flash_attn``: ``apply_rotary_emb(x, cos, sin, interleaved=..., seqlen_offsets=...)`` on
  (batch, seq, heads, head_dim) torch tensors; cos/sin (rows, rotary_dim / 2) tables in x's dtype,
  times the attention factor; offsets as an int or a (batch,) int32 tensor; per-token positions as the
  table's rows. ``cos_sin(spec, rows, x)`` replaces the tables.
- ``vllm``: ``factory(spec) -> module`` (or ``factory(spec, max_position=n)``), then
  ``module.forward_native(positions, query, key) -> (query, key)`` on flattened tokens: positions
  (tokens,), query (tokens, heads * head_dim).
- ``mlx``: ``rope(x, dims, traditional=..., base=..., scale=..., offset=...)`` (``mx.fast.rope``'s
  signature) on (batch, heads, seq, head_dim) arrays; offsets only, no scaling rule but linear
  (``scale = 1 / factor``), no attention factor.

A case an adapter cannot express (mlx and a YaRN spec, flash-attn and per-batch positions, an inverse
rotation through a signature without one) raises :class:`NotApplicable`; so may an implementation
for a case it does not implement. Arrays: :class:`Arrays` moves NumPy data into NumPy (bfloat16 via
ml_dtypes), torch, JAX, CuPy or MLX and back; each library's facts are one :class:`ArrayLibrary` of
:data:`ARRAY_LIBRARIES`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import numpy as np

from ..spec.rope_spec import RopeSpec

#: the dtypes of the cases
DTYPES = ("float32", "float16", "bfloat16", "float64")
#: cos/sin table rows an adapter builds at most (flash-attn tables, a vLLM module's cache)
TABLE_ROWS = 1 << 17


class NotApplicable(Exception):
    """A case the signature cannot express or the implementation does not implement ("not applicable")."""


# -- array libraries ---------------------------------------------------------------------------------
class ArrayLibrary:
    """The facts of one array library, an entry of :data:`ARRAY_LIBRARIES`: the module to import, its
    dtypes, how it makes float and integer arrays from host (NumPy) data, its array type and a float64
    host copy. Stateless: the methods take the imported module ``lib``. The defaults are the common case."""

    name = "?"
    #: the module to import (its first part is what to install)
    module = "?"
    #: the attribute of the module that is its array type
    array_type = "?"

    def load(self):
        """The imported module; ImportError saying what to install when it is missing."""
        try:
            return importlib.import_module(self.module)
        except ImportError as exc:
            raise ImportError(f"arrays={self.name!r} needs {self.module.split('.')[0]}, which is not installed here "
                              f"({exc})") from None

    def dtype(self, lib, name: str):
        """The library's dtype called ``name``; NotApplicable when it has none."""
        return getattr(lib, name)

    def array(self, lib, host: np.ndarray, dtype: str, device):
        """``host`` rounded to ``dtype`` (a name) as the library's array."""
        raise NotImplementedError

    def ints(self, lib, host: np.ndarray, device):
        """The int64 array ``host`` as the library's integer array."""
        raise NotImplementedError

    def is_array(self, lib, a) -> bool:
        """Whether ``a`` is the library's array."""
        return isinstance(a, getattr(lib, self.array_type))

    def host(self, lib, a) -> np.ndarray:
        """A float64 NumPy copy."""
        from ..testing import to_numpy64

        return to_numpy64(a)


def _float32_unless_float64(host: np.ndarray, dtype: str) -> np.ndarray:
    """``host`` as float64 for a float64 array, else float32: what a library whose floats are 32-bit by
    default (JAX, MLX) takes before rounding it to ``dtype``."""
    return np.asarray(host, np.float64 if dtype == "float64" else np.float32)


class _NumPy(ArrayLibrary):
    """NumPy, bfloat16 from ml_dtypes."""

    name = module = "numpy"
    array_type = "ndarray"

    def dtype(self, lib, name):
        if name == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                raise NotApplicable("NumPy has no bfloat16 without ml_dtypes") from None
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(name)

    def array(self, lib, host, dtype, device):
        dt = self.dtype(lib, dtype)
        return lib.asarray(np.asarray(host).astype(dt))

    def ints(self, lib, host, device):
        return lib.asarray(host)


class _CuPy(_NumPy):
    """NumPy's interface on the GPU (the copy from host in ``lib.asarray``), without bfloat16."""

    name = module = "cupy"

    def dtype(self, lib, name):
        if name == "bfloat16":
            raise NotApplicable("CuPy has no bfloat16")
        return np.dtype(name)


class _Torch(ArrayLibrary):
    """Tensors on ``device`` (the CPU by default)."""

    name = module = "torch"
    array_type = "Tensor"

    def array(self, lib, host, dtype, device):
        dt = self.dtype(lib, dtype)
        return lib.from_numpy(np.ascontiguousarray(host, dtype=np.float64)).to(device=device or "cpu", dtype=dt)

    def ints(self, lib, host, device):
        return lib.from_numpy(host.copy()).to(device=device or "cpu")


class _JAX(ArrayLibrary):
    """64-bit dtypes (float64, int64) only with ``jax_enable_x64``: no float64 case without it, int32 integers."""

    name = module = "jax"
    array_type = "Array"

    def load(self):
        lib = super().load()
        importlib.import_module("jax.numpy")   # lib.numpy
        return lib

    def dtype(self, lib, name):
        if name == "float64" and not lib.config.jax_enable_x64:
            raise NotApplicable("JAX has no float64 unless jax_enable_x64 is set")
        return getattr(lib.numpy, name)

    def array(self, lib, host, dtype, device):
        dt = self.dtype(lib, dtype)
        return lib.numpy.asarray(_float32_unless_float64(host, dtype)).astype(dt)

    def ints(self, lib, host, device):
        return lib.numpy.asarray(host if lib.config.jax_enable_x64 else host.astype(np.int32))


class _MLX(ArrayLibrary):
    """``mlx.core``; a host copy goes through float32 unless the array is float64 (NumPy takes no bfloat16
    from MLX)."""

    name = "mlx"
    module = "mlx.core"
    array_type = "array"

    def array(self, lib, host, dtype, device):
        dt = self.dtype(lib, dtype)
        return lib.array(_float32_unless_float64(host, dtype)).astype(dt)

    def ints(self, lib, host, device):
        return lib.array(host)

    def host(self, lib, a):
        if isinstance(a, lib.array):
            return np.array(a.astype(lib.float64 if a.dtype == lib.float64 else lib.float32), dtype=np.float64)
        return super().host(lib, a)


#: each array library's facts, by the name ``Arrays`` takes
ARRAY_LIBRARIES = {lib.name: lib for lib in (_NumPy(), _Torch(), _JAX(), _CuPy(), _MLX())}
#: array libraries a check can run in
ARRAYS = tuple(ARRAY_LIBRARIES)


class Arrays:
    """One array library (its :data:`ARRAY_LIBRARIES` entry): NumPy data in (``array``, ``ints``) and
    float64 NumPy out (``host``)."""

    def __init__(self, name: str = "numpy", device=None):
        if name not in ARRAYS:
            raise ValueError(f"arrays must be one of {ARRAYS}, got {name!r}")
        self.name, self.device = name, device
        self._library = ARRAY_LIBRARIES[name]
        self.lib = self._library.load()

    def __repr__(self):
        return f"Arrays({self.name!r})"

    def dtype(self, name: str):
        """The library's dtype called ``name``; NotApplicable when it has none."""
        return self._library.dtype(self.lib, name)

    def array(self, host: np.ndarray, dtype: str):
        """``host`` rounded to ``dtype`` as this library's array."""
        return self._library.array(self.lib, host, dtype, self.device)

    def ints(self, host: np.ndarray):
        """An integer array (int64; int32 where the library has no int64 here)."""
        return self._library.ints(self.lib, np.asarray(host, dtype=np.int64), self.device)

    def host(self, a) -> np.ndarray:
        """A float64 NumPy copy."""
        return self._library.host(self.lib, a)

    def is_array(self, a) -> bool:
        return self._library.is_array(self.lib, a)

    def dtype_name(self, a) -> str:
        return str(a.dtype).split(".")[-1]


# -- one call ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Call:
    """What an adapter gets for one case: the spec, the inputs in the library's arrays, and the positions.

    ``positions`` are per token, (seq,) or (batch, seq); ``offsets`` the same as the caller-side form when
    there is one: an int (every sequence from that position on) or a (batch,) array of per-sequence
    offsets, None for arbitrary per-token positions."""

    spec: RopeSpec
    x: Any
    k: Any
    positions: np.ndarray
    offsets: Any
    inverse: bool
    arrays: Arrays

    @property
    def seq_len(self) -> int:
        """HF's ``max(position_ids) + 1`` (the length dynamic NTK and LongRoPE read)."""
        return int(np.max(self.positions)) + 1

    def batch_positions(self, batch: int) -> np.ndarray:
        """Positions as (batch, seq)."""
        p = np.asarray(self.positions, dtype=np.int64)
        return np.broadcast_to(p, (batch, p.shape[-1])).copy()

    def tables(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """float64 (cos, sin) of the spec at ``rows`` (any shape + (rotary_dim / 2,)), times the attention factor."""
        return self.spec.cos_sin(np.asarray(rows, dtype=np.int64), seq_len=self.seq_len, dtype=np.float64)


def accepts(fn, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (True when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _layout_twice(c: np.ndarray, layout: str) -> np.ndarray:
    """Each frequency's value written twice, in the coordinates its pair occupies."""
    return np.concatenate([c, c], axis=-1) if layout == "half" else np.repeat(c, 2, axis=-1)


class Adapter:
    """Base: ``name``, the default array library, and ``run(impl, call) -> [y (and k)]`` as host arrays."""

    name = "?"
    default_arrays = "numpy"
    arrays_allowed: tuple = ARRAYS

    def __init__(self, cos_sin=None):
        self.cos_sin = cos_sin

    def check_arrays(self, arrays: Arrays) -> None:
        if arrays.name not in self.arrays_allowed:
            raise ValueError(f"signature {self.name!r} takes {' or '.join(self.arrays_allowed)} arrays, "
                             f"not {arrays.name}")

    def applicable(self, spec: RopeSpec, form: str, inverse: bool) -> None:
        """Raise NotApplicable for a spec / positions form ("scalar", "vector", "tokens", "batch") /
        inverse this signature cannot express."""


class _ForwardOnly(Adapter):
    """A peer's signature: rotation from coordinate 0, 1-D positions, no inverse (``what`` names the call)."""

    what = "?"
    default_arrays = "torch"
    arrays_allowed = ("torch",)

    def applicable(self, spec, form, inverse):
        if spec.rotary_offset:
            raise NotApplicable(f"{self.what} rotates from coordinate 0 (the spec has rotary_offset="
                                f"{spec.rotary_offset})")
        if spec.multi_axis:
            raise NotApplicable(f"{self.what} has no multi-axis positions")
        if inverse:
            raise NotApplicable(f"{self.what} has no inverse rotation")

    def run(self, impl, call: Call) -> list:
        raise NotImplementedError

    def hint(self, spec: RopeSpec) -> str:
        """What to add to "no known convention matches" for this signature ("" for nothing)."""
        return ""


class PlainAdapter(Adapter):
    name = "plain"

    def applicable(self, spec, form, inverse):
        if spec.multi_axis:
            raise NotApplicable("the plain signature takes 1-D positions")

    def run(self, impl, call):
        kwargs = {}
        if call.inverse:
            if not accepts(impl, "inverse"):
                raise NotApplicable("f takes no inverse= argument")
            kwargs["inverse"] = True
        pos = call.arrays.ints(call.positions)
        return [impl(a, pos, call.spec, **kwargs) for a in (call.x, call.k) if a is not None]


class HFAdapter(_ForwardOnly):
    name = "hf"
    what = "apply_rotary_pos_emb"

    def run(self, impl, call):
        torch = call.arrays.lib
        q = call.x.permute(0, 2, 1, 3)
        k = (call.k if call.k is not None else call.x.clone()).permute(0, 2, 1, 3)
        ids = call.batch_positions(q.shape[0])
        position_ids = call.arrays.ints(ids)
        if self.cos_sin is not None:
            cos, sin = self.cos_sin(call.spec, q, position_ids)
        else:
            c, s = call.tables(ids)
            cos, sin = (torch.from_numpy(_layout_twice(t, call.spec.layout)).to(device=q.device, dtype=q.dtype)
                        for t in (c, s))
        qo, ko = impl(q, k, cos, sin)[:2]
        outs = [qo.permute(0, 2, 1, 3)]
        return outs + ([ko.permute(0, 2, 1, 3)] if call.k is not None else [])

    def hint(self, spec):
        if spec.layout == "interleaved" and self.cos_sin is None:
            return ("cos/sin were given for pairs (2i, 2i+1), each value twice in a row (repeat_interleave); "
                    "rotate_half pairs (i, i+d/2) and reads them wrongly: no rotation of either layout")
        return ""


class FlashAttnAdapter(_ForwardOnly):
    name = "flash_attn"
    what = "apply_rotary_emb"

    def applicable(self, spec, form, inverse):
        super().applicable(spec, form, inverse)
        if form == "batch":
            raise NotApplicable("apply_rotary_emb takes one table row per token for every sequence, or offsets "
                                "(not per-sequence positions)")

    def run(self, impl, call):
        torch = call.arrays.lib
        seq = call.x.shape[1]
        if isinstance(call.offsets, np.ndarray):            # (batch,) per-sequence offsets
            rows = np.arange(int(call.offsets.max()) + seq)
            offsets = torch.from_numpy(call.offsets.astype(np.int32)).to(call.x.device)
        elif call.offsets is not None and int(call.offsets) + seq <= TABLE_ROWS:
            rows, offsets = np.arange(int(call.offsets) + seq), int(call.offsets)
        else:                                               # per-token positions (or an offset past TABLE_ROWS)
            rows, offsets = np.asarray(call.positions).reshape(-1), 0
        if self.cos_sin is not None:
            cos, sin = self.cos_sin(call.spec, call.arrays.ints(rows), call.x)
        else:
            cos, sin = (torch.from_numpy(t).to(device=call.x.device, dtype=call.x.dtype) for t in call.tables(rows))
        interleaved = call.spec.layout == "interleaved"
        return [impl(a, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
                for a in (call.x, call.k) if a is not None]


class VLLMAdapter(_ForwardOnly):
    """``impl`` is a factory ``spec -> module`` (``max_position=`` passed when it takes it)."""

    name = "vllm"
    what = "forward_native"

    def run(self, impl, call):
        need = call.seq_len
        if need > TABLE_ROWS:
            raise NotApplicable(f"positions up to {need - 1}: beyond a cos_sin_cache of {TABLE_ROWS} rows")
        module = impl(call.spec, max_position=need) if accepts(impl, "max_position") else impl(call.spec)
        limit = getattr(module, "max_position_embeddings", None)
        if isinstance(limit, int) and need > limit:
            raise NotApplicable(f"positions up to {need - 1}: beyond the module's max_position_embeddings={limit}")
        b, s, h, d = call.x.shape
        k = call.k if call.k is not None else call.x.clone()
        positions = call.arrays.ints(call.batch_positions(b).reshape(-1))
        qo, ko = module.forward_native(positions, call.x.reshape(b * s, h * d), k.reshape(b * s, -1))[:2]
        outs = [qo.reshape(call.x.shape)]
        return outs + ([ko.reshape(call.k.shape)] if call.k is not None else [])


class MLXAdapter(_ForwardOnly):
    name = "mlx"
    what = "mlx rope"
    default_arrays = "mlx"
    arrays_allowed = ("mlx",)

    def applicable(self, spec, form, inverse):
        super().applicable(spec, form, inverse)
        if form not in ("scalar", "vector"):
            raise NotApplicable("mlx rope takes offsets, not per-token "
                                "positions")
        if spec.frequencies is not None:
            raise NotApplicable("mlx rope has no custom frequencies")
        if spec.scaling is not None and spec.rope_type != "linear":
            raise NotApplicable(f"mlx rope has no {spec.rope_type!r} "
                                "scaling rule (only linear, as scale = 1/factor)")

    def run(self, impl, call):
        mx = call.arrays.lib
        spec = call.spec
        scale = 1.0 / spec.scaling_dict["factor"] if spec.scaling is not None else 1.0
        offset = mx.array(call.offsets.astype(np.int32)) if isinstance(call.offsets, np.ndarray) else int(call.offsets)
        outs = []
        for a in (call.x, call.k):
            if a is not None:
                y = impl(mx.transpose(a, (0, 2, 1, 3)), spec.rotary_dim, traditional=spec.layout == "interleaved",
                         base=spec.base, scale=scale, offset=offset)
                outs.append(mx.transpose(y, (0, 2, 1, 3)))
        return outs


ADAPTERS = {a.name: a for a in (PlainAdapter, HFAdapter, FlashAttnAdapter, VLLMAdapter, MLXAdapter)}
#: the signatures ``check`` takes
SIGNATURES = tuple(ADAPTERS)


def adapter(signature, cos_sin=None) -> Adapter:
    """The adapter of ``signature`` (a name of :data:`SIGNATURES` or an :class:`Adapter`)."""
    if isinstance(signature, Adapter):
        return signature
    if signature not in ADAPTERS:
        raise ValueError(f"signature must be one of {SIGNATURES}, got {signature!r}")
    if cos_sin is not None and signature not in ("hf", "flash_attn"):
        raise ValueError(f"cos_sin= goes with signature 'hf' or 'flash_attn', not {signature!r}")
    return ADAPTERS[signature](cos_sin=cos_sin)


def hf_rope_parameters(spec: RopeSpec) -> dict:
    """The HF ``rope_parameters`` of a spec (``rope_type``, ``rope_theta``, the rule's keys and
    ``partial_rotary_factor``, 1.0 included), for building an implementation's own rotary module (an HF
    ``...RotaryEmbedding(config)``) from a case's spec."""
    if spec.frequencies is not None or spec.multi_axis or spec.rotary_offset:
        raise NotApplicable("this spec has no HF rope_parameters (custom frequencies, multi-axis or rotary_offset)")
    params = spec.scaling_dict or {"rope_type": "default"}
    params["rope_theta"] = spec.base
    params["partial_rotary_factor"] = spec.rotary_dim / spec.head_dim   # always: GPT-NeoX's default is 0.25
    return params
