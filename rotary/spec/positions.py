"""Position ids for multi-axis specs: vision grids and the M-RoPE positions of multimodal LLMs.

Everything here is NumPy on the host and returns int64 (float64 for normalised coordinates)
arrays with the coordinates on a trailing axis, the shape ``apply`` / ``apply_qk`` take for a
multi-axis spec. Argument names follow HF transformers (``spatial_merge_size``, ``image_grid_thw``,
``mm_token_type_ids``, ``second_per_grid_ts``, ``tokens_per_second``, ``attention_mask``).
"""

from __future__ import annotations

import numpy as np

from .packing import _host_int_array, check_cu_seqlens
from .validators import as_int

#: HF ``model_type`` -> how video grids become positions (``get_rope_index`` of each model):
#: "index": temporal id = frame index (Qwen2-VL);
#: "seconds": temporal id = int(frame index * tokens_per_second * second_per_grid_ts) (Qwen2.5-VL);
#: "frames": every frame is its own (1, h, w) grid, separated by timestamp text tokens (Qwen3-VL,
#: Qwen3.5, GLM-4V family).
VIDEO_RULES = {
    "qwen2_vl": "index",
    "qwen2_5_vl": "seconds",
    "qwen3_vl": "frames", "qwen3_vl_moe": "frames", "qwen3_5": "frames", "qwen3_5_moe": "frames",
    "glm4v": "frames", "glm4v_moe": "frames", "glm46v": "frames", "glm_ocr": "frames",
}

TEXT, IMAGE, VIDEO = 0, 1, 2


def grid_positions(h, w, t=None, *, spatial_merge_size=1, normalized=False) -> np.ndarray:
    """Coordinates of the patches of an h x w (or t x h x w) grid, one row per token.

    Returns int64 ``(h*w, 2)`` (row, col) ids, or ``(t*h*w, 3)`` (frame, row, col) ids when ``t`` is
    given, tokens in row-major order (frame-major for ``t``): token ``r*w + c`` is (r, c).

    ``spatial_merge_size=m`` orders the tokens block-major over m x m blocks (the order of the
    Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4V vision towers, whose merger joins each block into one
    LLM token; HF ``transformers.vision_utils.get_vision_position_ids``): blocks in row-major order, the
    m*m patches of a block row-major inside it. ``h`` and ``w`` must be multiples of m.

    ``normalized=True`` returns float64 patch centres in [-1, 1] instead (DINOv3's
    ``get_patches_center_coordinates``): row r -> ``2 (r + 0.5) / h - 1``, col c -> ``2 (c + 0.5) / w - 1``;
    use them with a spec made with ``float_positions=True``.

    (Vision towers that rotate only (row, col) of a video repeat the 2-D grid per frame:
    ``np.tile(grid_positions(h, w), (t, 1))``.)
    """
    h, w = _positive(h, "h"), _positive(w, "w")
    m = _positive(spatial_merge_size, "spatial_merge_size")
    if h % m or w % m:
        raise ValueError(f"h and w must be multiples of spatial_merge_size={m}, got h={h}, w={w}")
    if not isinstance(normalized, (bool, np.bool_)):
        raise TypeError(f"normalized must be a bool, got {type(normalized).__name__}")
    rows, cols = np.meshgrid(np.arange(h, dtype=np.int64), np.arange(w, dtype=np.int64), indexing="ij")
    if m > 1:   # (h/m, m, w/m, m) -> (h/m, w/m, m, m): block-major
        rows = rows.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
        cols = cols.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
    grid = np.stack([rows.reshape(-1), cols.reshape(-1)], axis=-1)
    if normalized:
        if t is not None:
            raise ValueError("normalized=True makes 2-D patch-centre coordinates; pass t=None")
        return 2.0 * (grid + 0.5) / np.array([h, w], dtype=np.float64) - 1.0
    if t is None:
        return grid
    t = _positive(t, "t")
    frames = np.repeat(np.arange(t, dtype=np.int64), h * w)[:, None]
    return np.concatenate([frames, np.tile(grid, (t, 1))], axis=1)


def mrope_positions(input_ids=None, *, mm_token_type_ids=None, image_grid_thw=None, video_grid_thw=None,
                    second_per_grid_ts=None, attention_mask=None, spatial_merge_size=None, tokens_per_second=None,
                    image_token_id=None, video_token_id=None, model_type=None, config=None):
    """M-RoPE (t, h, w) position ids of a multimodal prompt: HF's ``get_rope_index`` without torch.

    Returns ``(positions, rope_deltas)``: int64 ``(batch, seq, 3)`` and ``(batch, 1)`` (``(seq, 3)``
    and ``(1,)`` for 1-D input). HF's own ``position_ids`` are ``(3, batch, seq)``:
    ``positions == np.moveaxis(hf_position_ids, 0, -1)``.

    Rule (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V): the tokens split into runs of one
    modality. A text run of n tokens takes ``p, p+1, ..., p+n-1`` on all three axes and moves p by n. An
    image / video run takes the next grid ``(t, h, w)`` of ``image_grid_thw`` / ``video_grid_thw``
    (patch units, before merging) and holds ``t * (h/m) * (w/m)`` tokens, m = ``spatial_merge_size``,
    frame-major then row-major; token (f, r, c) gets ``(p + T(f), p + r, p + c)`` and p moves by
    ``max(h, w) / m``. ``T(f) = f`` for images and, for videos, by ``model_type`` (:data:`VIDEO_RULES`):
    ``f`` (Qwen2-VL), ``int(f * tokens_per_second * second_per_grid_ts[v])`` in float32 as HF (Qwen2.5-VL),
    or one (1, h, w) grid per frame (Qwen3-VL / Qwen3.5 / GLM-4V, whose frames are separated by
    timestamp text). Grids are consumed in order across the batch. Tokens where ``attention_mask``
    is 0 are skipped and get position 0. ``rope_deltas = max(positions) + 1 - n_valid_tokens`` per row.

    Parameters
    ----------
    input_ids : integer array (batch, seq) or (seq,), optional
        Token ids; with ``image_token_id`` / ``video_token_id`` (or ``config``) they give the modality of
        every token. Not needed when ``mm_token_type_ids`` is given.
    mm_token_type_ids : integer array like input_ids, optional
        HF 5.x's modality of every token: 0 text, 1 image, 2 video.
    image_grid_thw, video_grid_thw : integer arrays (n, 3), optional
        (t, h, w) patch grid of every image / video, in order of appearance.
    second_per_grid_ts : sequence of floats (n_videos,), optional
        Seconds per temporal grid step of every video (Qwen2.5-VL; default 1).
    attention_mask : array like input_ids, optional
        0 for padding tokens.
    spatial_merge_size, tokens_per_second : int, optional
        The vision config's values (default: from ``config``, else 2 and 1).
    image_token_id, video_token_id : int, optional
        Special token ids (default: from ``config``).
    model_type : str, optional
        HF ``model_type`` ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", ...): picks the video rule; required
        when ``video_grid_thw`` is given (unless ``config`` says it).
    config : dict or transformers PretrainedConfig, optional
        The model's config (``config.json`` as a dict works): supplies the defaults above.
    """
    cfg = _ConfigReader(config)
    model_type = model_type if model_type is not None else cfg.get("model_type")
    if spatial_merge_size is None:
        spatial_merge_size = cfg.get("spatial_merge_size", vision=True, default=2)
    m = _positive(spatial_merge_size, "spatial_merge_size")

    types, squeeze = _token_types(input_ids, mm_token_type_ids, image_token_id, video_token_id, cfg)
    batch, seq = types.shape
    if attention_mask is None:
        valid = np.ones((batch, seq), dtype=bool)
    else:
        valid = np.asarray(attention_mask)
        if valid.shape != types.shape and not (squeeze and valid.shape == (seq,)):
            raise ValueError(f"attention_mask of shape {valid.shape} must match the tokens' shape "
                             f"{types.shape[1:] if squeeze else types.shape}")
        valid = valid.reshape(batch, seq).astype(bool)

    images = _grids(image_grid_thw, "image_grid_thw")
    videos = _grids(video_grid_thw, "video_grid_thw")
    time_scales = [1.0] * len(videos)
    if len(videos):
        rule = _video_rule(model_type)
        if rule != "seconds" and second_per_grid_ts is not None:
            raise ValueError(f"second_per_grid_ts is used by Qwen2.5-VL's rule only, not by model_type={model_type!r}")
        if rule == "frames":   # one (1, h, w) grid per frame
            videos = np.repeat(videos, videos[:, 0], axis=0)
            videos[:, 0] = 1
            time_scales = [1.0] * len(videos)
        elif rule == "seconds":
            if tokens_per_second is None:
                tokens_per_second = cfg.get("tokens_per_second", vision=True, default=1)
            time_scales = _time_scales(second_per_grid_ts, tokens_per_second, len(videos))
    for grids, name in ((images, "image_grid_thw"), (videos, "video_grid_thw")):
        if len(grids) and np.any(grids[:, 1:] % m):
            raise ValueError(f"{name} h and w must be multiples of spatial_merge_size={m}, got {grids.tolist()}")

    positions = np.zeros((batch, seq, 3), dtype=np.int64)
    deltas = np.zeros((batch, 1), dtype=np.int64)
    queues = {IMAGE: [images, 0, "image"], VIDEO: [videos, 0, "video"]}
    for b in range(batch):
        kinds = types[b][valid[b]]
        rows, p = [], 0
        for kind, start, stop in _runs(kinds):
            if kind == TEXT:
                rows.append(np.repeat(np.arange(p, p + stop - start, dtype=np.int64)[:, None], 3, axis=1))
                p += stop - start
                continue
            need = stop - start
            while need > 0:   # a run may hold several grids back to back
                grids, i, what = queues[kind]
                if i >= len(grids):
                    raise ValueError(f"row {b} holds more {what} tokens than the {what}_grid_thw grids cover "
                                     f"(spatial_merge_size={m})")
                t, h, w = (int(v) for v in grids[i])
                n = t * (h // m) * (w // m)
                if n > need:
                    raise ValueError(f"row {b}: a run of {stop - start} {what} tokens ends inside {what} grid {i} "
                                     f"{(t, h, w)} ({n} tokens after merging by {m})")
                scale = time_scales[i] if kind == VIDEO else 1.0
                rows.append(_vision_block(p, t, h // m, w // m, scale))
                p += max(h, w) // m
                need -= n
                queues[kind][1] = i + 1
        if rows:
            row = np.concatenate(rows)
            positions[b, valid[b]] = row
            deltas[b, 0] = row.max() + 1 - row.shape[0]
    for grids, used, what in queues.values():
        if used < len(grids):
            raise ValueError(f"{what}_grid_thw has {len(grids)} grids but the tokens hold {used} {what}"
                             f"{' frames' if what == 'video' and _video_rule(model_type) == 'frames' else 's'}")
    if squeeze:
        return positions[0], deltas[0]
    return positions, deltas


def mrope_next_positions(positions, num_tokens=1, *, attention_mask=None) -> np.ndarray:
    """M-RoPE positions of the next ``num_tokens`` generated (text) tokens: every axis continues from
    ``max + 1`` of the positions so far, ``max+1, max+2, ...`` on all three axes.

    ``positions``: the prompt's (or the last step's) ``(batch, seq, 3)`` / ``(seq, 3)`` ids; rows of
    ``attention_mask`` (0 = padding) are left out of the max. Returns ``(batch, num_tokens, 3)`` (or
    ``(num_tokens, 3)``). Equal to HF's decode rule ``past_length + arange(num_tokens) + rope_deltas``.
    """
    p = np.asarray(positions)
    if p.dtype.kind not in "iu":
        raise TypeError(f"positions must be integer M-RoPE ids, got dtype {p.dtype}")
    if p.ndim not in (2, 3) or p.shape[-1] != 3 or p.shape[-2] == 0:
        raise ValueError(f"positions must have shape (seq, 3) or (batch, seq, 3) with seq >= 1, got {p.shape}")
    num_tokens = as_int(num_tokens, "num_tokens")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    p = p.astype(np.int64)
    if attention_mask is not None:
        mask = np.asarray(attention_mask)
        if mask.shape != p.shape[:-1]:
            raise ValueError(f"attention_mask of shape {mask.shape} must match positions.shape[:-1] = {p.shape[:-1]}")
        if not np.all(mask.astype(bool).any(axis=-1)):
            raise ValueError("attention_mask leaves a row with no token")
        p = np.where(mask.astype(bool)[..., None], p, np.iinfo(np.int64).min)
    start = p.max(axis=(-2, -1)) + 1
    steps = start[..., None] + np.arange(num_tokens, dtype=np.int64)
    return np.repeat(steps[..., None], 3, axis=-1)


def context_parallel_positions(seq_len=None, cp_size=None, cp_rank=None, *, cu_seqlens=None):
    """Global positions of the tokens one context-parallel rank holds (TransformerEngine's split).

    Context parallelism (TransformerEngine, Megatron-LM) splits every sequence over ``cp_size`` ranks
    load-balanced for causal attention: a sequence of length L is cut into ``2 * cp_size`` equal chunks
    and rank r holds chunk r followed by chunk ``2 * cp_size - 1 - r``, so its local tokens sit at the
    global positions ``[r*c, (r+1)*c) ++ [(2*cp_size-1-r)*c, (2*cp_size-r)*c)``, ``c = L / (2 * cp_size)``.
    E.g. L = 8, cp_size = 2: rank 0 holds positions [0, 1, 6, 7], rank 1 [2, 3, 4, 5]. Rotating the
    local tokens at these positions is what TE's ``apply_rotary_pos_emb(t, freqs, tensor_format,
    cu_seqlens=..., cp_size=..., cp_rank=...)`` does (``transformer_engine/pytorch/attention/rope.py``:
    ``_get_freqs_on_this_cp_rank`` for bshd/sbhd and unfused thd, the fused kernel alike; the thd
    token split is ``thd_partition_indices_kernel`` in ``transformer_engine/common/fused_attn/``).
    Checked against TE's source; TE itself is not needed or imported.

    Two forms:

    ``context_parallel_positions(seq_len, cp_size, cp_rank)`` (bshd / sbhd: every sequence of the
    batch has length ``seq_len``) returns int64 ``(seq_len // cp_size,)``; pass it as ``positions``
    with the rank's local x, e.g. ``apply(x_local, positions, seq_axis=-3)`` for x_local of shape
    ``(B, seq_len // cp_size, H, D)``. The positions are also the indices of the local tokens in the
    full sequence: ``x_local = x[:, positions]``.

    ``context_parallel_positions(cu_seqlens=cu, cp_size=..., cp_rank=...)`` (packed thd): ``cu`` is the
    global (N+1,) cumulative offsets of the full, unsplit sequences (TE's ``cu_seqlens_padded``),
    each length a multiple of ``2 * cp_size``. Returns ``(positions, local_cu_seqlens)``, int64
    ``(T // cp_size,)`` and ``(N+1,)``: the rank holds the two chunks of sequence 0, then of sequence
    1, ..., ``local_cu_seqlens = cu // cp_size``, and positions restart at every sequence, so
    ``apply(x_local, positions, seq_axis=0)`` / ``apply_qk`` rotate the rank's (T // cp_size, H, D)
    tokens right. The local tokens' indices in the full packed batch are
    ``positions + np.repeat(cu[:-1], np.diff(local_cu_seqlens))``.

    ``cp_size = 1`` gives ``arange`` (any length). For ``cp_size > 1`` every length must be a
    multiple of ``2 * cp_size`` (TE asserts it too); pad the sequences first.
    """
    if cp_size is None or cp_rank is None:
        raise TypeError("context_parallel_positions needs cp_size= and cp_rank=")
    cp_size = as_int(cp_size, "cp_size")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    cp_rank = as_int(cp_rank, "cp_rank")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size) = [0, {cp_size}), got {cp_rank}")
    if (seq_len is None) == (cu_seqlens is None):
        raise TypeError("pass exactly one of seq_len (bshd / sbhd) or cu_seqlens= (packed thd)")
    if cu_seqlens is None:
        seq_len = as_int(seq_len, "seq_len")
        if seq_len < 0:
            raise ValueError(f"seq_len must be >= 0, got {seq_len}")
        if cp_size > 1 and seq_len % (2 * cp_size):
            raise ValueError(f"seq_len must be a multiple of 2 * cp_size = {2 * cp_size} (2 * cp_size equal "
                             f"chunks, as TransformerEngine requires), got {seq_len}")
        return _cp_positions(np.array([seq_len], dtype=np.int64), cp_size, cp_rank)
    cu = _host_int_array(cu_seqlens, "cu_seqlens")
    cu = check_cu_seqlens(cu, int(cu[-1]) if cu.ndim == 1 and cu.shape[0] else 0, "cu_seqlens")
    lengths = np.diff(cu)
    if cp_size > 1:
        bad = np.flatnonzero(lengths % (2 * cp_size))
        if bad.size:
            n = int(bad[0])
            raise ValueError(f"cu_seqlens: every sequence length must be a multiple of 2 * cp_size = {2 * cp_size} "
                             f"(as TransformerEngine requires; pad the sequences), sequence {n} has "
                             f"{int(lengths[n])} tokens (cu_seqlens[{n}:{n + 2}] = {cu[n:n + 2].tolist()})")
    return _cp_positions(lengths, cp_size, cp_rank), cu // cp_size


# -- helpers ---------------------------------------------------------------------------------------
def _positive(value, name):
    value = as_int(value, name)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _cp_positions(lengths, cp_size, cp_rank):
    """int64 positions of rank ``cp_rank``'s tokens of sequences of ``lengths``, concatenated."""
    local = lengths // cp_size                               # tokens of each sequence on this rank
    i = np.arange(int(local.sum()), dtype=np.int64) - np.repeat(np.cumsum(local) - local, local)
    if cp_size == 1:
        return i
    c = np.repeat(local // 2, local)                         # chunk length: L / (2 * cp_size)
    # the first c local tokens are chunk cp_rank, the next c chunk 2 * cp_size - 1 - cp_rank
    return np.where(i < c, cp_rank * c + i, (2 * cp_size - 2 - cp_rank) * c + i)


def _vision_block(p, t, h, w, time_scale):
    """(t*h*w, 3) ids of one merged grid starting at p (HF ``get_vision_position_ids``)."""
    frames = np.arange(t, dtype=np.int64)
    if time_scale != 1.0:   # HF: (arange(t) * time_interval).long() in float32
        frames = (frames.astype(np.float32) * np.float32(time_scale)).astype(np.int64)
    tt, hh, ww = np.meshgrid(frames, np.arange(h, dtype=np.int64), np.arange(w, dtype=np.int64), indexing="ij")
    return np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)], axis=-1) + p


def _runs(kinds):
    """[(kind, start, stop)] of maximal runs of equal values."""
    if kinds.size == 0:
        return []
    edges = np.flatnonzero(np.diff(kinds)) + 1
    starts = np.concatenate([[0], edges])
    stops = np.concatenate([edges, [kinds.size]])
    return [(int(kinds[a]), int(a), int(z)) for a, z in zip(starts, stops)]


def _grids(value, name):
    if value is None:
        return np.zeros((0, 3), dtype=np.int64)
    g = _to_numpy(value)
    if g.dtype.kind not in "iu" or g.ndim != 2 or g.shape[1] != 3:
        raise ValueError(f"{name} must be an integer array of shape (n, 3) (t, h, w per grid), got "
                         f"{g.dtype} of shape {g.shape}")
    if g.size and g.min() < 1:
        raise ValueError(f"{name} entries must be >= 1, got {g.tolist()}")
    return g.astype(np.int64)


def _time_scales(second_per_grid_ts, tokens_per_second, n_videos):
    """float32 ``tokens_per_second * second_per_grid_ts[v]`` per video (HF's time_interval)."""
    tps = np.float32(tokens_per_second)
    if not (np.isfinite(tps) and tps > 0):
        raise ValueError(f"tokens_per_second must be a number > 0, got {tokens_per_second!r}")
    if second_per_grid_ts is None:
        return [float(tps)] * n_videos
    s = _to_numpy(second_per_grid_ts).astype(np.float32).reshape(-1)
    if s.shape[0] != n_videos:
        raise ValueError(f"second_per_grid_ts must have one value per video ({n_videos}), got {s.shape[0]}")
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        raise ValueError(f"second_per_grid_ts must be finite and >= 0, got {s.tolist()}")
    return [float(tps * v) for v in s]


def _video_rule(model_type):
    if model_type is None:
        raise ValueError("videos need model_type= (or config=) to pick the video position rule: one of "
                         f"{sorted(VIDEO_RULES)}")
    key = str(model_type).removesuffix("_text")
    if key not in VIDEO_RULES:
        raise ValueError(f"model_type must be one of {sorted(VIDEO_RULES)}, got {model_type!r}")
    return VIDEO_RULES[key]


def _token_types(input_ids, mm_token_type_ids, image_token_id, video_token_id, cfg):
    """(types (batch, seq) int64 in {0, 1, 2}, squeezed): from mm_token_type_ids or from input_ids."""
    if mm_token_type_ids is not None:
        types = _to_numpy(mm_token_type_ids)
        name = "mm_token_type_ids"
        if types.dtype.kind not in "iub":
            raise TypeError(f"mm_token_type_ids must be integers (0 text, 1 image, 2 video), got {types.dtype}")
        if input_ids is not None and _to_numpy(input_ids).shape != types.shape:
            raise ValueError(f"input_ids of shape {_to_numpy(input_ids).shape} and mm_token_type_ids of shape "
                             f"{types.shape} must match")
        if types.size and (types.min() < 0 or types.max() > 2):
            raise ValueError("mm_token_type_ids must hold 0 (text), 1 (image) or 2 (video)")
    elif input_ids is not None:
        ids = _to_numpy(input_ids)
        name = "input_ids"
        if ids.dtype.kind not in "iu":
            raise TypeError(f"input_ids must be integer token ids, got {ids.dtype}")
        image_token_id = image_token_id if image_token_id is not None else cfg.get("image_token_id")
        video_token_id = video_token_id if video_token_id is not None else cfg.get("video_token_id")
        if image_token_id is None and video_token_id is None:
            raise ValueError("input_ids need image_token_id / video_token_id (or config=) to find the vision "
                             "tokens; or pass mm_token_type_ids")
        types = np.zeros(ids.shape, dtype=np.int64)
        if image_token_id is not None:
            types[ids == as_int(image_token_id, "image_token_id")] = IMAGE
        if video_token_id is not None:
            types[ids == as_int(video_token_id, "video_token_id")] = VIDEO
    else:
        raise ValueError("pass input_ids (with image_token_id / video_token_id or config=) or mm_token_type_ids")
    if types.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape (batch, seq) or (seq,), got {types.shape}")
    squeeze = types.ndim == 1
    return types.reshape(-1 if squeeze else types.shape[0], types.shape[-1]).astype(np.int64), squeeze


def _to_numpy(value):
    """A NumPy view of a NumPy array, a sequence, or a torch tensor (without importing torch)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


class _ConfigReader:
    """Values from an HF config (dict or PretrainedConfig): top level, or its vision_config."""

    def __init__(self, config):
        if config is not None and not isinstance(config, dict) and not hasattr(config, "to_dict"):
            raise TypeError(f"config must be a dict (config.json) or a transformers PretrainedConfig, "
                            f"got {type(config).__name__}")
        self.config = config

    @staticmethod
    def _read(obj, key):
        if obj is None:
            return None
        if isinstance(obj, dict):
            return obj.get(key)
        return getattr(obj, key, None)

    def get(self, key, *, vision=False, default=None):
        value = self._read(self._read(self.config, "vision_config"), key) if vision else None
        if value is None:
            value = self._read(self.config, key)
        return default if value is None else value
