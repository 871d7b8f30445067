"""rotary.interop.hf.patch_model: rotary's RoPE inside a Hugging Face transformers model (issue 44).

Tiny random-weight LlamaForCausalLM (llama3 scaling), Qwen3ForCausalLM (q/k norms, YaRN with its attention factor)
and Gemma3ForCausalLM (sliding layers on the local base, global layers with linear scaling): the configs of
tests/test_decoding_hf.py. The patched model's logits against the unpatched model's:

- float32: HF's own model, its float32 angles (``position_ids.float() * inv_freq``) against rotary's exact ones:
  within 1e-6 of the largest logit (a few float32 ulps);
- float64: HF computes the angles and RMSNorm in float32 even there (~1e-7), so the reference is the unpatched
  model with those made float64 (HF's RoPE formula on rotary's float64 ``inv_freq``, HF's attention scaling) and
  the same float64 RMSNorm in both: within 1e-12 of the largest logit;

for a batch of two with HF's default (1, seq) position_ids, a left-padded batch with its (batch, seq) ones, greedy
``generate`` with a KV cache (one token per step), and under ``torch.compile(fullgraph=True)``.
"""

import copy

import numpy as np
import pytest

import rotary

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("the HF configs here are transformers 5.x's", allow_module_level=True)

from rotary.interop import hf  # noqa: E402

# the tiny configs of the decoder's HF tests, and HF's RMSNorm formulas without their float32 cast
from .test_decoding_hf import _hf_config as _config  # noqa: E402
from .test_decoding_hf import _norm_forward  # noqa: E402

pytestmark = pytest.mark.peer

FAMILIES = ("llama", "qwen3", "gemma3")
IDS = [[5, 17, 3, 42, 8, 11, 60, 2], [7, 9, 11, 13, 15, 17, 19, 21]]


def _model(family, dtype):
    cls, config = _config(family)
    torch.manual_seed(0)
    model = cls(config).to(dtype).eval()
    with torch.no_grad():   # weights that spread the logits (HF's init, std 0.02, keeps them near 0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if family == "gemma3" else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def _float64_steps(model, family):
    """HF's float32 steps made float64: RoPE angles from rotary's float64 inv_freq (HF's formula and attention
    scaling), RMSNorm without its x.to(float32)."""
    rope = model.model.rotary_emb
    gemma = family == "gemma3"
    config = model.config

    def rope_forward(x, position_ids, layer_type=None):
        spec = rotary.RopeSpec.from_hf_config(config, layer_type=layer_type) if gemma else \
            rotary.RopeSpec.from_hf_config(config)
        inv = torch.tensor(spec.inv_freq(), dtype=torch.float64)
        scaling = getattr(rope, f"{layer_type}_attention_scaling") if gemma else rope.attention_scaling
        angles = position_ids[..., None].double() * inv
        emb = torch.cat((angles, angles), dim=-1)
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    rope.forward = rope_forward
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _norm_forward(torch, module, gemma)
    return model


def _pair(family, dtype):
    """(reference, patched): the same weights; float64 makes both models' float32 steps float64 first."""
    model = _model(family, dtype)
    if dtype == torch.float64:
        model = _float64_steps(model, family)
    reference = copy.deepcopy(model)
    return reference, hf.patch_model(model)


TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


def _error(got, want):
    """max |got - want| relative to the largest logit (at least 1): float32 logits of size ~3 have ulps of 2.4e-7."""
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.fixture(scope="module", params=[(f, d) for f in FAMILIES for d in (torch.float32, torch.float64)],
                ids=lambda p: f"{p[0]}-{str(p[1]).split('.')[-1]}")
def pair(request):
    family, dtype = request.param
    return family, dtype, *_pair(family, dtype)


def test_batch_with_hf_default_position_ids(pair):
    """No position_ids: HF makes them (1, seq) for a batch of two (rotary broadcasts the row over the batch)."""
    family, dtype, reference, patched = pair
    ids = torch.tensor(IDS)
    calls = []
    rotate = hf.RotaryPositions.rotate
    hf.RotaryPositions.rotate = lambda self, *args: calls.append(self.spec) or rotate(self, *args)
    try:
        got = _logits(patched, ids)
    finally:
        hf.RotaryPositions.rotate = rotate
    assert len(calls) == patched.config.num_hidden_layers   # every layer's RoPE is rotary's
    assert set(calls) == {hf.model_spec(patched, t) for t in (["sliding_attention", "full_attention"]
                                                              if family == "gemma3" else [None])}
    want = _logits(reference, ids)
    assert _error(got, want) <= TOLERANCE[dtype]
    assert want.abs().max().item() > 0.5   # logits that spread, so the tolerance means something


def test_left_padded_batch_with_position_ids(pair):
    family, dtype, reference, patched = pair
    ids = torch.tensor([[0, 0, 0] + IDS[0][:5], IDS[1]])
    mask = (ids != 0).long()
    mask[1] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    want = _logits(reference, ids, attention_mask=mask, position_ids=position_ids)
    got = _logits(patched, ids, attention_mask=mask, position_ids=position_ids)
    real = mask.bool()
    assert _error(got[real], want[real]) <= TOLERANCE[dtype]


@pytest.mark.interop("HF transformers (hf.patch_model)", "cpu", "numba", "generate with a KV cache")
def test_generate_with_kv_cache(pair):
    """Greedy decoding: the prompt, then one token per step at position_ids (batch, 1); same tokens, same scores."""
    family, dtype, reference, patched = pair
    ids = torch.tensor(IDS)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
        got = patched.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert _error(a, b) <= max(TOLERANCE[dtype], 1e-6)   # generate hands out float32 logits


@pytest.mark.interop("HF transformers (hf.patch_model)", "cpu", "numba", "torch.compile fullgraph")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_patched_model_compiles_fullgraph(family):
    """torch.compile(fullgraph=True) of the patched model: one graph (rotary's rotation one custom op per layer),
    logits as eager, and new positions without a recompile."""
    from torch._dynamo.utils import counters

    reference, patched = _pair(family, torch.float32)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
    ids = torch.tensor(IDS)
    for step, start in enumerate((0, 7)):
        position_ids = torch.arange(start, start + ids.shape[1])[None]
        stance = torch.compiler.set_stance("fail_on_recompile" if step else "default")
        with torch.no_grad(), stance:
            got = compiled(ids, position_ids=position_ids, use_cache=False).logits
        want = _logits(reference, ids, position_ids=position_ids, use_cache=False)
        assert _error(got, want) <= TOLERANCE[torch.float32]
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(patched, fullgraph=True, backend=capture)(ids, use_cache=False)
    assert graphs[0].count("torch.ops.rotary.rotate_qk") == patched.config.num_hidden_layers


def test_unpatch_restores_the_model_and_other_models_are_untouched():
    reference, patched = _pair("llama", torch.float32)
    other = copy.deepcopy(reference)   # never patched: the module-level function falls through to HF's
    ids = torch.tensor(IDS)
    want = _logits(reference, ids)
    assert torch.equal(_logits(other, ids), want)
    assert hf.unpatch_model(patched) is patched
    assert torch.equal(_logits(patched, ids), want)
    assert torch.equal(_logits(other, ids), want)


def test_patch_model_spec_and_errors():
    reference, patched = _pair("qwen3", torch.float32)
    assert hf.model_spec(patched) == rotary.RopeSpec.from_hf_config(patched.config)
    assert hf.patch_model(patched) is patched   # twice: no double wrapping
    with pytest.raises(TypeError, match="rotary_emb"):
        hf.patch_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="backend"):
        hf.patch_model(copy.deepcopy(reference), backend="tpu")


def test_backend_numpy_matches_numba():
    _, a = _pair("llama", torch.float32)
    _, b = _pair("llama", torch.float32)
    hf.patch_model(b, backend="numpy")
    ids = torch.tensor(IDS)
    assert _error(_logits(a, ids), _logits(b, ids)) <= 1e-6
