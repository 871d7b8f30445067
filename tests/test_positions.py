"""Position helpers: grid_positions, mrope_positions, mrope_next_positions.

Hand-worked expectations (no HF needed), then token-for-token agreement with HF's own
``get_rope_index`` / ``get_vision_position_ids`` / decode rule on random mixed text/image/video
prompts (skipped without transformers 5; CI installs it).
"""

import types

import numpy as np
import pytest

import rotary


# -- grid_positions ---------------------------------------------------------------------------------
def test_grid_row_major():
    g = rotary.grid_positions(2, 3)
    assert g.dtype == np.int64 and g.shape == (6, 2)
    assert g.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_grid_spatial_merge_blocks():
    # 4x4 grid, 2x2 blocks: block (0,0) = tokens (0,0),(0,1),(1,0),(1,1); then block (0,1) ...
    g = rotary.grid_positions(4, 4, spatial_merge_size=2)
    expected = []
    for br in range(2):
        for bc in range(2):
            expected += [[2 * br + r, 2 * bc + c] for r in range(2) for c in range(2)]
    assert g.tolist() == expected
    # a permutation of the row-major grid
    assert sorted(map(tuple, g.tolist())) == sorted(map(tuple, rotary.grid_positions(4, 4).tolist()))


def test_grid_temporal():
    g = rotary.grid_positions(2, 2, t=3)
    assert g.shape == (12, 3)
    assert g[:, 0].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert np.array_equal(g[8:, 1:], rotary.grid_positions(2, 2))


def test_grid_normalized_centres():
    g = rotary.grid_positions(2, 4, normalized=True)
    assert g.dtype == np.float64
    assert g[:, 0].tolist() == [-0.5] * 4 + [0.5] * 4
    assert g[:4, 1].tolist() == [-0.75, -0.25, 0.25, 0.75]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(h=0, w=2), ValueError, "h must be >= 1"),
    (dict(h=2, w=2.0), TypeError, "w must be an integer"),
    (dict(h=3, w=4, spatial_merge_size=2), ValueError, "multiples of spatial_merge_size"),
    (dict(h=2, w=2, t=2, normalized=True), ValueError, "t=None"),
    (dict(h=2, w=2, normalized=1), TypeError, "normalized must be a bool"),
])
def test_grid_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        rotary.grid_positions(**kwargs)


# -- mrope_positions: hand-worked ---------------------------------------------------------------------
def test_mrope_hand_worked_image():
    # 2 text, an image (1, 4, 6) -> 1 x 2 x 3 = 6 tokens after a 2x2 merge, 2 text
    types_ = np.array([0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    pos, delta = rotary.mrope_positions(mm_token_type_ids=types_, image_grid_thw=[[1, 4, 6]], spatial_merge_size=2)
    assert pos.shape == (10, 3) and pos.dtype == np.int64
    assert pos[:, 0].tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]   # t: image frame 0 at 2; text resumes at 2 + max(2, 3)
    assert pos[:, 1].tolist() == [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]   # h: rows
    assert pos[:, 2].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]   # w: cols
    assert delta.tolist() == [7 - 10]


def test_mrope_video_rules():
    # 1 text, a video (3, 2, 2) -> 3 frames of 1 token, 1 text
    types_ = np.array([[0, 2, 2, 2, 0]])
    grid = [[3, 2, 2]]
    t_index, _ = rotary.mrope_positions(mm_token_type_ids=types_, video_grid_thw=grid, model_type="qwen2_vl")
    assert t_index[0, :, 0].tolist() == [0, 1, 2, 3, 2]
    t_secs, _ = rotary.mrope_positions(mm_token_type_ids=types_, video_grid_thw=grid, model_type="qwen2_5_vl",
                                       tokens_per_second=2, second_per_grid_ts=[1.5])
    assert t_secs[0, :, 0].tolist() == [0, 1, 4, 7, 2]             # 1 + int(f * 3)
    # Qwen3-VL: frames are separate grids, separated by timestamp text
    types3 = np.array([[0, 2, 0, 2, 0, 2, 0]])
    t_frames, d = rotary.mrope_positions(mm_token_type_ids=types3, video_grid_thw=grid, model_type="qwen3_vl")
    assert t_frames[0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert d.tolist() == [[0]]


def test_mrope_input_ids_and_config_dict():
    cfg = {"model_type": "qwen2_5_vl", "image_token_id": 7, "video_token_id": 8,
           "vision_config": {"spatial_merge_size": 2, "tokens_per_second": 2}}
    ids = np.array([[1, 7, 7, 3, 8, 8, 4]])
    pos, _ = rotary.mrope_positions(ids, image_grid_thw=[[1, 2, 4]], video_grid_thw=[[2, 2, 2]],
                                    second_per_grid_ts=[1.0], config=cfg)
    explicit, _ = rotary.mrope_positions(mm_token_type_ids=[[0, 1, 1, 0, 2, 2, 0]], image_grid_thw=[[1, 2, 4]],
                                         video_grid_thw=[[2, 2, 2]], second_per_grid_ts=[1.0], spatial_merge_size=2,
                                         tokens_per_second=2, model_type="qwen2_5_vl")
    assert np.array_equal(pos, explicit)
    assert pos[0, :, 0].tolist() == [0, 1, 1, 3, 4, 6, 5]


def test_mrope_padding_and_text_only():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos, d = rotary.mrope_positions(mm_token_type_ids=np.zeros((2, 5), int), attention_mask=mask)
    assert pos[0, :, 0].tolist() == [0, 0, 0, 1, 2] and pos[1, :, 2].tolist() == [0, 1, 2, 3, 4]
    assert d.tolist() == [[0], [0]]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(), ValueError, "pass input_ids"),
    (dict(input_ids=[[1, 2]]), ValueError, "image_token_id"),
    (dict(mm_token_type_ids=[[0, 3]]), ValueError, "0 \\(text\\), 1 \\(image\\) or 2"),
    (dict(mm_token_type_ids=[[0.0, 1.0]]), TypeError, "mm_token_type_ids must be integers"),
    (dict(mm_token_type_ids=[[0, 1, 1]], image_grid_thw=[[1, 4, 4]]), ValueError, "ends inside image grid 0"),
    (dict(mm_token_type_ids=[[0, 1, 1]]), ValueError, "more image tokens than"),
    (dict(mm_token_type_ids=[[0, 1]], image_grid_thw=[[1, 2, 2], [1, 2, 2]]), ValueError, "2 grids but"),
    (dict(mm_token_type_ids=[[0, 2]], video_grid_thw=[[1, 2, 2]]), ValueError, "model_type="),
    (dict(mm_token_type_ids=[[0, 2]], video_grid_thw=[[1, 2, 2]], model_type="llama"), ValueError, "model_type must"),
    (dict(mm_token_type_ids=[[0, 1]], image_grid_thw=[[1, 3, 2]]), ValueError, "multiples of spatial_merge_size"),
    (dict(mm_token_type_ids=[[0, 1]], image_grid_thw=[1, 2, 2]), ValueError, "shape \\(n, 3\\)"),
    (dict(mm_token_type_ids=[[0, 2]], video_grid_thw=[[1, 2, 2]], model_type="qwen2_5_vl",
          second_per_grid_ts=[1.0, 2.0]), ValueError, "one value per video"),
    (dict(mm_token_type_ids=[[0, 2]], video_grid_thw=[[1, 2, 2]], model_type="qwen3_vl",
          second_per_grid_ts=[1.0]), ValueError, "Qwen2.5-VL's rule only"),
    (dict(mm_token_type_ids=[[0, 0]], attention_mask=[[1, 1, 1]]), ValueError, "attention_mask of shape"),
    (dict(mm_token_type_ids=[[0, 0]], config="qwen"), TypeError, "config must be"),
])
def test_mrope_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        rotary.mrope_positions(**kwargs)


def test_mrope_inputs_not_modified():
    types_ = np.array([[0, 2, 2, 0]])
    grid = np.array([[2, 2, 2]])
    rotary.mrope_positions(mm_token_type_ids=types_, video_grid_thw=grid, model_type="qwen3_vl")
    assert grid.tolist() == [[2, 2, 2]] and types_.tolist() == [[0, 2, 2, 0]]


# -- decode rule --------------------------------------------------------------------------------------
def test_next_positions_continue_from_max():
    pos, delta = rotary.mrope_positions(mm_token_type_ids=[[0, 1, 1, 1, 1, 1, 1]], image_grid_thw=[[1, 4, 6]])
    nxt = rotary.mrope_next_positions(pos, 3)
    assert nxt.shape == (1, 3, 3)
    assert nxt[0].tolist() == [[4, 4, 4], [5, 5, 5], [6, 6, 6]]   # max id 3 (w of the last column: 1 + 2) + 1
    # HF's form: past_length + arange + rope_deltas
    assert np.array_equal(nxt[0, :, 0], 7 + np.arange(3) + delta[0, 0])
    # stepping from the last step's positions gives the same sequence
    assert np.array_equal(rotary.mrope_next_positions(nxt[:, :1]), nxt[:, 1:2])


def test_next_positions_mask_and_errors():
    pos = np.array([[[0, 0, 0], [9, 9, 9]], [[0, 0, 0], [1, 1, 1]]])
    out = rotary.mrope_next_positions(pos, attention_mask=[[1, 0], [1, 1]])
    assert out[:, 0, 0].tolist() == [1, 2]
    with pytest.raises(ValueError, match="shape \\(seq, 3\\)"):
        rotary.mrope_next_positions(np.zeros((4, 2), np.int64))
    with pytest.raises(TypeError, match="integer"):
        rotary.mrope_next_positions(np.zeros((4, 3)))
    with pytest.raises(ValueError, match="no token"):
        rotary.mrope_next_positions(pos, attention_mask=[[0, 0], [1, 1]])


# -- against HF ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers >= 5 (get_rope_index with mm_token_type_ids)")
    return torch, transformers


#: model_type -> (model module, model class, config class)
HF_MODELS = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLModel", "Qwen2VLConfig"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLModel", "Qwen2_5_VLConfig"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLModel", "Qwen3VLConfig"),
    "qwen3_5": ("qwen3_5", "Qwen3_5Model", "Qwen3_5Config"),
    "glm4v": ("glm4v", "Glm4vModel", "Glm4vConfig"),
}


def _hf_model(transformers, model_type):
    """An object with the model's own get_rope_index / get_vision_position_ids / compute_3d_position_ids
    and its default config (no weights)."""
    import importlib
    module, cls_name, cfg_name = HF_MODELS[model_type]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    cls = getattr(mod, cls_name)
    fake = types.SimpleNamespace(config=getattr(transformers, cfg_name)(), rope_deltas=None)
    for name in ("get_rope_index", "get_vision_position_ids", "compute_3d_position_ids"):
        setattr(fake, name, getattr(cls, name).__get__(fake))
    return fake


def _random_prompt(rng, model_type, m, batch=3, pad=True):
    """Token types, grids and a mask for a random mixed prompt batch: rows left-padded (mask 0) when
    ``pad``, else filled up with trailing text tokens (mask all 1)."""
    frames_split = rotary.spec.positions.VIDEO_RULES[model_type] == "frames"
    rows, images, videos, seconds = [], [], [], []
    for _ in range(batch):
        row = [0] * int(rng.integers(1, 4))
        for _ in range(int(rng.integers(1, 5))):
            kind = int(rng.integers(1, 3))
            t = 1 if kind == 1 else int(rng.integers(1, 4))
            h, w = m * int(rng.integers(1, 5)), m * int(rng.integers(1, 5))
            (images if kind == 1 else videos).append([t, h, w])
            if kind == 2:
                seconds.append(float(rng.choice([0.5, 2 / 3, 1.0, 1.3, 2.0])))
            if kind == 2 and frames_split:   # <timestamp> <frame> <timestamp> <frame> ...
                for _ in range(t):
                    row += [0] * int(rng.integers(1, 3)) + [2] * ((h // m) * (w // m))
            else:
                row += [kind] * (t * (h // m) * (w // m))
            row += [0] * int(rng.integers(1, 4))
        rows.append(row)
    seq = max(map(len, rows)) + 2
    types_ = np.zeros((batch, seq), np.int64)
    mask = np.zeros((batch, seq), np.int64)
    for b, row in enumerate(rows):
        types_[b, seq - len(row):] = row
        mask[b, seq - len(row):] = 1
    if not pad:
        types_ = np.stack([np.array(row + [0] * (seq - len(row))) for row in rows])
        mask[:] = 1
    grids = lambda g: np.array(g, np.int64).reshape(-1, 3) if g else None
    return types_, mask, grids(images), grids(videos), (np.array(seconds, np.float32) if seconds else None)


@pytest.mark.peer
@pytest.mark.parametrize("model_type", sorted(HF_MODELS))
def test_mrope_positions_match_hf_get_rope_index(hf, model_type):
    torch, transformers = hf
    model = _hf_model(transformers, model_type)
    m = model.config.vision_config.spatial_merge_size
    rng = np.random.default_rng(sum(map(ord, model_type)))
    for trial in range(6):
        use_mask = trial % 2 == 1
        types_, mask, images, videos, seconds = _random_prompt(rng, model_type, m, pad=use_mask)
        ids = np.where(types_ == 1, model.config.image_token_id,
                       np.where(types_ == 2, model.config.video_token_id, 5))
        t = lambda a, dtype=torch.long: None if a is None else torch.tensor(a, dtype=dtype)
        kwargs = dict(image_grid_thw=t(images), video_grid_thw=t(videos), attention_mask=t(mask) if use_mask else None)
        if model_type == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = t(seconds, torch.float32)
        hf_pos, hf_delta = model.get_rope_index(t(ids), mm_token_type_ids=t(types_, torch.int32), **kwargs)
        hf_pos = np.moveaxis(hf_pos.numpy(), 0, -1)
        ours_kwargs = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask if use_mask else None,
                           second_per_grid_ts=seconds if model_type == "qwen2_5_vl" else None)
        # from the token ids and the config, and from HF 5's mm_token_type_ids
        pos, delta = rotary.mrope_positions(ids, config=model.config, **ours_kwargs)
        pos2, delta2 = rotary.mrope_positions(mm_token_type_ids=types_, spatial_merge_size=m, model_type=model_type,
                                              tokens_per_second=getattr(model.config.vision_config,
                                                                        "tokens_per_second", None), **ours_kwargs)
        assert pos.shape == hf_pos.shape and pos.dtype == np.int64
        np.testing.assert_array_equal(pos, hf_pos)
        np.testing.assert_array_equal(delta, hf_delta.numpy())
        np.testing.assert_array_equal(pos2, hf_pos)
        np.testing.assert_array_equal(delta2, hf_delta.numpy())


@pytest.mark.peer
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_next_positions_match_hf_decode(hf, model_type):
    torch, transformers = hf
    seconds_of = lambda s: s if model_type == "qwen2_5_vl" else None
    model = _hf_model(transformers, model_type)
    m = model.config.vision_config.spatial_merge_size
    types_, mask, images, videos, seconds = _random_prompt(np.random.default_rng(3), model_type, m)
    kwargs = dict(image_grid_thw=None if images is None else torch.tensor(images),
                  video_grid_thw=None if videos is None else torch.tensor(videos))
    if model_type == "qwen2_5_vl" and seconds is not None:
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    ids = torch.tensor(types_)
    model.compute_3d_position_ids(input_ids=ids, inputs_embeds=None, attention_mask=torch.tensor(mask), cache=None,
                                  mm_token_type_ids=torch.tensor(types_, dtype=torch.int32), **kwargs)
    pos, _ = rotary.mrope_positions(mm_token_type_ids=types_, attention_mask=mask, image_grid_thw=images,
                                    video_grid_thw=videos, second_per_grid_ts=seconds_of(seconds), config=model.config)
    ours = rotary.mrope_next_positions(pos, 4, attention_mask=mask)
    batch, seq = types_.shape
    cache = types.SimpleNamespace(get_seq_length=lambda: seq)
    # HF decode with the attention mask: positions of the whole (prompt + 4 new) mask, new columns at the end
    full_mask = torch.tensor(np.concatenate([mask, np.ones((batch, 4), np.int64)], axis=1))
    hf_pos = model.compute_3d_position_ids(input_ids=None, inputs_embeds=torch.zeros(batch, seq + 4, 1),
                                           attention_mask=full_mask, cache=cache,
                                           image_grid_thw=None, video_grid_thw=None)
    np.testing.assert_array_equal(ours, np.moveaxis(hf_pos.numpy(), 0, -1)[:, -4:])
    # and without a mask (no padding): past_length + arange + rope_deltas
    types_, _, images, videos, seconds = _random_prompt(np.random.default_rng(4), model_type, m, pad=False)
    kwargs = dict(image_grid_thw=None if images is None else torch.tensor(images),
                  video_grid_thw=None if videos is None else torch.tensor(videos))
    if model_type == "qwen2_5_vl" and seconds is not None:
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    model.rope_deltas = None
    model.compute_3d_position_ids(input_ids=torch.tensor(types_), inputs_embeds=None, cache=None, attention_mask=None,
                                  mm_token_type_ids=torch.tensor(types_, dtype=torch.int32), **kwargs)
    pos, _ = rotary.mrope_positions(mm_token_type_ids=types_, image_grid_thw=images, video_grid_thw=videos,
                                    second_per_grid_ts=seconds_of(seconds), config=model.config)
    cache = types.SimpleNamespace(get_seq_length=lambda: types_.shape[1])
    hf_next = model.compute_3d_position_ids(input_ids=None, inputs_embeds=torch.zeros(batch, 2, 1), cache=cache,
                                            attention_mask=None, image_grid_thw=None, video_grid_thw=None)
    np.testing.assert_array_equal(rotary.mrope_next_positions(pos, 2), np.moveaxis(hf_next.numpy(), 0, -1))


@pytest.mark.peer
def test_grid_positions_match_hf_vision_position_ids(hf):
    torch, _ = hf
    vision_utils = pytest.importorskip("transformers.vision_utils")
    grid = torch.tensor([[1, 4, 6], [3, 2, 8]])
    hf_ids = vision_utils.get_vision_position_ids(grid, 2).numpy()
    ours = np.concatenate([rotary.grid_positions(4, 6, spatial_merge_size=2),
                           np.tile(rotary.grid_positions(2, 8, spatial_merge_size=2), (3, 1))])
    np.testing.assert_array_equal(ours, hf_ids)
    hf_3d = vision_utils.get_vision_position_ids(grid[1:], 2, include_temporal=True).numpy()
    np.testing.assert_array_equal(rotary.grid_positions(2, 8, t=3, spatial_merge_size=2), hf_3d)
    dinov3 = pytest.importorskip("transformers.models.dinov3_vit.modeling_dinov3_vit")
    centres = dinov3.get_patches_center_coordinates(3, 5, dtype=torch.float64, device="cpu").numpy()
    np.testing.assert_allclose(rotary.grid_positions(3, 5, normalized=True), centres, rtol=0, atol=1e-15)


# -- HF position_ids of one row ---------------------------------------------------------------------
@pytest.mark.parametrize("shape, seq_axis", [((2, 5, 3, 8), -3), ((2, 3, 5, 8), -2), ((2, 5, 8), -2)])
def test_one_row_of_position_ids_broadcasts_over_the_batch(shape, seq_axis):
    """HF's position_ids of shape (1, S) with a batch of 2: the row serves every batch entry, as NumPy and HF
    broadcast it (issue 44); never onto heads (tests/test_integration_edges.py)."""
    x = np.random.default_rng(0).standard_normal(shape)
    ids = np.arange(4, 9)[None]
    want = rotary.apply(x, ids[0], seq_axis=seq_axis, backend="numpy")
    np.testing.assert_array_equal(rotary.apply(x, ids, seq_axis=seq_axis, backend="numpy"), want)
    np.testing.assert_array_equal(rotary.apply(x, np.repeat(ids, 2, axis=0), seq_axis=seq_axis, backend="numpy"),
                                  want)


def test_one_row_of_multi_axis_positions_broadcasts_over_the_batch():
    spec = rotary.RopeSpec(16, mrope_section=(2, 3, 3))
    x = np.ones((2, 5, 16))
    pos = np.arange(15, dtype=np.int64).reshape(1, 5, 3)
    np.testing.assert_array_equal(rotary.apply(x, pos, spec=spec, seq_axis=-2, backend="numpy"),
                                  rotary.apply(x, pos[0], spec=spec, seq_axis=-2, backend="numpy"))
