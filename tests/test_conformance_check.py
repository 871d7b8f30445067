"""rotary.conformance.check: rotary's cases against other implementations, with a diagnosis of failures.

Verified three ways: rotary's own ``apply`` passes every case (NumPy, torch, JAX arrays); planted-bug
implementations (wrong pairing, positions off by one, a missing attention factor, angles formed in fp16 or
fp32, wrong NTK base formulas, ...) each fail with the right diagnosis; and peers' own code where it is
installed (HF transformers' ``apply_rotary_pos_emb`` with rotary's tables and with its own rotary modules,
lucidrains' rotary-embedding-torch, MLX's ``mx.fast.rope``) passes what it implements and is diagnosed on
what it does not. The flash-attn and vLLM adapters are exercised with small stand-ins written to those
signatures here (flash-attn and vLLM are not installable on this machine; no peer result is claimed for them).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import warnings

import numpy as np
import pytest

import rotary
import rotary.testing
from rotary.conformance import NotApplicable, check
from rotary.conformance.adapters import hf_rope_parameters


# -- implementations under test ------------------------------------------------------------------------
def rotary_plain(x, positions, spec, inverse=False):
    """rotary itself in the plain signature (BSHD: seq axis -3)."""
    return rotary.apply(x, positions, spec=spec, seq_axis=-3, inverse=inverse)


def rope_np(x, positions, spec, *, layout=None, freqs=None, scale=None, shift=0, angles=np.float64, inverse=False):
    """A NumPy RoPE with every convention a knob (the planted bugs below turn one each)."""
    p = np.asarray(positions)
    n = int(p.max()) + 1
    w = spec.inv_freq(n) if freqs is None else np.asarray(freqs)
    A = spec.attention_scaling_at(n) if scale is None else scale
    with np.errstate(over="ignore", invalid="ignore"):
        theta = ((p.astype(angles) + angles(shift))[..., None] * w.astype(angles)).astype(np.float64)
        theta = -theta if inverse else theta
        c, s = np.cos(theta) * A, np.sin(theta) * A
    c = np.broadcast_to(c, x.shape[:2] + c.shape[-1:])[:, :, None]
    s = np.broadcast_to(s, x.shape[:2] + s.shape[-1:])[:, :, None]
    half = len(w)
    i = np.arange(half)
    a, b = (i, i + half) if (layout or spec.layout) == "half" else (2 * i, 2 * i + 1)
    xf = x.astype(np.float64)
    y = xf.copy()
    y[..., a] = xf[..., a] * c - xf[..., b] * s
    y[..., b] = xf[..., b] * c + xf[..., a] * s
    return y.astype(x.dtype)


def correct(x, p, spec, inverse=False):
    return rope_np(x, p, spec, inverse=inverse)


def wrong_pairs(x, p, spec, inverse=False):
    return rope_np(x, p, spec, layout="interleaved", inverse=inverse)


def off_by_one(x, p, spec, inverse=False):
    return rope_np(x, p, spec, shift=1, inverse=inverse)


def no_attention_factor(x, p, spec, inverse=False):
    return rope_np(x, p, spec, scale=1.0, inverse=inverse)


def fp16_angles(x, p, spec, inverse=False):
    return rope_np(x, p, spec, angles=np.float16, inverse=inverse)


def fp32_angles(x, p, spec, inverse=False):
    return rope_np(x, p, spec, angles=np.float32, inverse=inverse)


def ntk_base_without_exponent(x, p, spec, inverse=False):
    if spec.rope_type == "ntk":
        d = spec.rotary_dim
        return rope_np(x, p, spec, freqs=1.0 / (spec.base * spec.scaling_dict["factor"]) ** (np.arange(0, d, 2) / d),
                       inverse=inverse)
    return rope_np(x, p, spec, inverse=inverse)


def dynamic_as_static_ntk(x, p, spec, inverse=False):
    if spec.rope_type == "dynamic":
        d, s = spec.rotary_dim, spec.scaling_dict["factor"]
        return rope_np(x, p, spec, freqs=1.0 / (spec.base * s ** (d / (d - 2))) ** (np.arange(0, d, 2) / d),
                       inverse=inverse)
    return rope_np(x, p, spec, inverse=inverse)


def head_dim_denominator(x, p, spec, inverse=False):
    if spec.scaling is None and spec.frequencies is None:
        d = spec.rotary_dim
        return rope_np(x, p, spec, freqs=1.0 / spec.base ** (np.arange(0, d, 2) / spec.head_dim), inverse=inverse)
    return rope_np(x, p, spec, inverse=inverse)


def ignores_inverse(x, p, spec, inverse=False):
    return rope_np(x, p, spec)


def returns_float32(x, p, spec, inverse=False):
    return rope_np(x, p, spec, inverse=inverse).astype(np.float32)


def pairs_and_shift(x, p, spec, inverse=False):
    return rope_np(x, p, spec, layout="interleaved", shift=1, inverse=inverse)


def no_inverse_argument(x, positions, spec):
    return rope_np(x, positions, spec)


def _diagnoses(report):
    return {r.case: r.diagnosis for r in report.results}


# -- rotary itself ---------------------------------------------------------------------------------------
def test_rotary_passes_every_case():
    report = check(rotary_plain, cases="full", report=False)
    assert report.passed, report.format(failures_only=True)
    assert not report.not_applicable
    names = {r.case for r in report.results}
    # both layouts, partial, odd dims, every position form, large positions, every scaling rule, HF configs,
    # the dtype sweep and the inverse
    for name in ("half-basic", "inte-basic", "half-partial", "inte-odd-dim", "half-tokens", "half-batch",
                 "half-batch-offset", "half-huge-pos", "inte-huge-offset", "half-inverse", "scaling-linear",
                 "scaling-ntk", "scaling-dynamic", "scaling-yarn", "scaling-llama3", "scaling-longrope",
                 "hf-llama3.1", "hf-deepseek-yarn-mscale", "hf-phi3-longrope", "half-basic-fp16", "half-basic-bf16",
                 "half-basic-fp64"):
        assert name in names
    assert report.precision["float32"].angles == "exact"


@pytest.mark.parametrize("arrays", ["torch", "jax"])
def test_rotary_passes_in_other_array_libraries(arrays):
    pytest.importorskip(arrays)
    cases = "quick" if arrays == "torch" else ["half-basic", "inte-batch", "half-partial", "scaling-yarn",
                                               "half-huge-offset", "half-basic-fp16", "half-basic-bf16",
                                               "half-basic-fp64"]   # JAX: a compile per shape
    report = check(rotary_plain, arrays=arrays, cases=cases, report=False)
    assert report.passed, report.format(failures_only=True)
    if arrays == "jax":   # without jax_enable_x64 JAX has no float64: those cases do not apply
        import jax

        if not jax.config.jax_enable_x64:
            assert [r.case for r in report.not_applicable] == ["half-basic-fp64"]
            assert "jax_enable_x64" in report["half-basic-fp64"].diagnosis


@pytest.mark.parametrize("case", rotary.conformance.conformance_cases(rotary_plain, cases="quick"))
def test_pytest_entry_point(case):
    """rotary.conformance.conformance_cases: the cases as a project's own parametrized tests."""
    result = case.check()
    assert result.passed


# -- planted bugs ----------------------------------------------------------------------------------------
PLANTED = {
    wrong_pairs: {"half-basic": "pairs (2i, 2i+1): layout='interleaved'", "half-batch": "pairs (2i, 2i+1)",
                  "scaling-yarn": "pairs (2i, 2i+1): layout='interleaved'"},
    off_by_one: {"half-basic": "positions shifted by one: position p rotated as p+1",
                 "inte-batch": "positions shifted by one", "scaling-dynamic": "positions shifted by one"},
    no_attention_factor: {"scaling-yarn": "YaRN without the attention factor",
                          "hf-deepseek-yarn-mscale": "YaRN without the attention factor: cos and sin not multiplied "
                                                     "by 1.08573",
                          "scaling-longrope": "LongRoPE without the attention factor"},
    fp16_angles: {"half-basic": "angles formed in fp16: error grows as position x 2^-11",
                  "half-huge-offset": "angles formed in fp16"},
    fp32_angles: {"half-huge-pos": "angles formed in fp32: error grows as position x 2^-24",
                  "inte-huge-offset": "angles formed in fp32", "half-huge-offset-fp16": "angles formed in fp32",
                  "half-basic-fp64": "angles formed in fp32"},
    ntk_base_without_exponent: {"scaling-ntk": "NTK base b*s = 40000 without the d/(d-2) exponent"},
    dynamic_as_static_ntk: {"scaling-dynamic": "static NTK: base b*s**(d/(d-2))"},
    head_dim_denominator: {"half-partial": "the head size, not rotary_dim=12, as the exponent's denominator",
                           "inte-odd-dim": "base**(-2i/17): the head size, not rotary_dim=16"},
    ignores_inverse: {"half-inverse": "rotates by +theta where the inverse (-theta) was asked for"},
    returns_float32: {"half-basic-fp16": "returned float32 for float16 input"},
    pairs_and_shift: {"half-basic": "pairs (2i, 2i+1): layout='interleaved' (the spec's layout is 'half'); and "
                                    "positions shifted by one"},
}


@pytest.mark.parametrize("impl", list(PLANTED), ids=lambda f: f.__name__)
def test_planted_bug_fails_with_its_diagnosis(impl):
    report = check(impl, report=False)
    got = _diagnoses(report)
    for case, text in PLANTED[impl].items():
        assert report[case].failed, f"{impl.__name__} passed {case}"
        assert text in got[case], f"{impl.__name__} on {case}: {got[case]!r}"
    assert not report.passed
    findings = "\n".join(report.findings())
    assert next(iter(PLANTED[impl].values())) in findings


@pytest.mark.parametrize("impl, passing", [
    (wrong_pairs, ["inte-basic", "inte-batch", "inte-huge-pos"]),       # the layout it does have
    (no_attention_factor, ["half-basic", "scaling-linear", "scaling-llama3", "scaling-ntk"]),   # rules with factor 1
    (fp32_angles, ["half-basic", "half-batch", "scaling-yarn", "hf-llama3.1", "half-basic-bf16"]),  # allowance
    (ntk_base_without_exponent, ["half-basic", "scaling-yarn", "scaling-dynamic"]),
], ids=lambda v: getattr(v, "__name__", "cases"))
def test_planted_bug_passes_what_it_does_right(impl, passing):
    report = check(impl, cases="full", report=False)
    for case in passing:
        assert report[case].passed, (case, report[case])


def test_fp32_angles_error_is_fitted_against_position():
    """The issue's example: fp32 angles err as position x 2^-24, a few 1e-3 at 131072."""
    fit = check(fp32_angles, cases=["half-huge-pos"], report=False).precision["float32"]
    assert fit.angles == "fp32" and -26 < fit.exponent < -22
    at = dict(zip(fit.positions, fit.errors))[131072]
    assert 5e-4 < at < 3e-2
    assert f"{at:.0e} at 131072" in fit.message


def test_inverse_cases_not_applicable_without_an_inverse_argument():
    report = check(no_inverse_argument, report=False, dtypes=("float32",))
    assert report.passed
    assert {r.case for r in report.not_applicable} == {"half-inverse", "inte-inverse"}
    assert report["half-inverse"].diagnosis == "f takes no inverse= argument"


def test_implementation_declines_with_not_applicable_and_skip():
    def only_half(x, p, spec, inverse=False):
        if spec.layout != "half":
            raise NotApplicable("half-split pairs only")
        return rope_np(x, p, spec, inverse=inverse)

    report = check(only_half, report=False, skip=["scaling-*"], dtypes=("float32", "float16"))
    assert report.passed
    assert report["inte-basic"].diagnosis == "half-split pairs only" and not report["inte-basic"].applicable
    assert report["scaling-yarn"].diagnosis == "skipped (skip=)"


def test_an_exception_is_a_failure_not_a_crash():
    def broken(x, p, spec):
        raise RuntimeError("boom")

    report = check(broken, cases=["half-basic"], report=False)
    assert report["half-basic"].failed and report["half-basic"].diagnosis == "raised RuntimeError: boom"


# -- the report ------------------------------------------------------------------------------------------
def test_report_prints_assert_ok_and_to_dict():
    out = io.StringIO()
    report = check(wrong_pairs, report=out)
    text = out.getvalue()
    assert "half-basic" in text and "FAIL" in text and "diagnosis:" in text and "precision:" in text
    assert text.rstrip().endswith(report.summary())
    with pytest.raises(AssertionError, match=r"half-basic: error .*pairs \(2i, 2i\+1\)"):
        report.assert_ok()
    d = report.to_dict()
    assert d["passed"] is False and d["precision"]["float32"]["angles"] == "exact"
    check(rotary_plain, report=False).assert_ok()


def test_report_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "error.png"
    check(fp32_angles, cases=["half-basic"], report=False).plot(path)
    assert path.stat().st_size > 1000


def test_pytest_items_fail_and_skip():
    from rotary.conformance.check import items

    item = next(i for i in items(wrong_pairs) if i.name == "half-basic")
    with pytest.raises(AssertionError, match="pairs"):
        item.check()
    skipped = next(i for i in items(no_inverse_argument) if i.name == "half-inverse")
    with pytest.raises(pytest.skip.Exception, match="no inverse"):
        skipped.check()


def test_cli_impl_exit_codes():
    from rotary.cli import conformance as cli

    out = io.StringIO()
    args = argparse.ArgumentParser()
    cli.add_arguments(args)
    ok = cli.run_cli(args.parse_args(["--impl", f"{__name__}:rotary_plain", "--quick", "--dtypes", "float32"]), out)
    assert ok == 0 and "OK" in out.getvalue()
    out = io.StringIO()
    bad = cli.run_cli(args.parse_args(["--impl", f"{__name__}:off_by_one", "--quick", "--failures-only"]), out)
    assert bad == 1 and "positions shifted by one" in out.getvalue()
    assert cli.run_cli(args.parse_args(["--impl", "no_such_module:f"]), io.StringIO()) == 2


# -- adapters with stand-ins written to the peers' signatures (not peer results) -------------------------
torch = pytest.importorskip("torch") if importlib.util.find_spec("torch") else None
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


def flash_attn_signature(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                         max_seqlen=None):
    """flash-attn's ``apply_rotary_emb`` contract (x (B, S, H, D); cos/sin (rows, rd/2); offsets), in torch."""
    b, s = x.shape[:2]
    offs = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else torch.full((b,), int(seqlen_offsets))
    rows = offs.long()[:, None] + torch.arange(s)
    c, sn = cos[rows].float()[:, :, None], sin[rows].float()[:, :, None]
    rd = 2 * cos.shape[-1]
    xr = x[..., :rd].float()
    x1, x2 = (xr[..., ::2], xr[..., 1::2]) if interleaved else xr.chunk(2, dim=-1)
    y1, y2 = x1 * c - x2 * sn, x2 * c + x1 * sn
    y = torch.stack((y1, y2), -1).flatten(-2) if interleaved else torch.cat((y1, y2), -1)
    return torch.cat((y.to(x.dtype), x[..., rd:]), -1)


class VLLMStyleRope(torch.nn.Module if torch is not None else object):
    """vLLM's RotaryEmbedding contract: a float32 cos_sin_cache of max_position rows, forward_native on
    flattened tokens."""

    def __init__(self, spec, max_position, is_neox_style=None):
        super().__init__()
        self.head_size, self.rotary_dim = spec.head_dim, spec.rotary_dim
        self.max_position_embeddings = max_position
        self.is_neox_style = spec.layout == "half" if is_neox_style is None else is_neox_style
        cos, sin = spec.cos_sin(np.arange(max_position), seq_len=max_position, dtype=np.float32)
        self.cos_sin_cache = torch.cat([torch.from_numpy(cos), torch.from_numpy(sin)], -1)

    def forward_native(self, positions, query, key):
        cos, sin = self.cos_sin_cache[positions].chunk(2, -1)

        def rotate(t):
            t = t.view(t.shape[0], -1, self.head_size)
            rot = t[..., :self.rotary_dim].float()
            if self.is_neox_style:
                x1, x2 = rot.chunk(2, -1)
            else:
                x1, x2 = rot[..., ::2], rot[..., 1::2]
            c, s = cos[:, None], sin[:, None]
            y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
            y = torch.cat((y1, y2), -1) if self.is_neox_style else torch.stack((y1, y2), -1).flatten(-2)
            return torch.cat((y.to(t.dtype), t[..., self.rotary_dim:]), -1).flatten(1)

        return rotate(query), rotate(key)


@needs_torch
def test_flash_attn_adapter():
    report = check(flash_attn_signature, signature="flash_attn", cases="full", report=False,
                   dtypes=("float32", "float16", "bfloat16"))   # computes in float32, as flash-attn does
    assert report.passed, report.format(failures_only=True)
    assert not report["half-batch"].applicable and not report["half-inverse"].applicable
    assert report["scaling-yarn-interleaved-partial"].passed      # per-sequence offsets as a (batch,) tensor
    assert report["half-batch"].diagnosis.startswith("apply_rotary_emb takes one table row per token")
    assert report["half-huge-offset"].passed and report["half-batch-offset"].passed


@needs_torch
def test_vllm_adapter():
    report = check(lambda spec, max_position: VLLMStyleRope(spec, max_position), signature="vllm", report=False,
                   dtypes=("float32", "float16", "bfloat16"))
    assert report.passed, report.format(failures_only=True)
    assert "beyond a cos_sin_cache" in report["half-huge-pos"].diagnosis
    wrong = check(lambda spec: VLLMStyleRope(spec, 4096, is_neox_style=True), signature="vllm", report=False)
    assert "pairs (i, i+d/2): layout='half'" in wrong["inte-basic"].diagnosis


def test_importing_conformance_stays_cheap():
    """rotary.conformance imports NumPy and rotary only: torch, JAX, MLX, matplotlib and pytest load when used."""
    import subprocess
    import sys

    code = ("import sys, rotary.conformance, rotary.testing; "
            "print(sorted(m for m in ('torch', 'jax', 'mlx', 'matplotlib', 'pytest', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_signature_and_arrays_are_checked():
    with pytest.raises(ValueError, match="signature must be one of"):
        check(correct, signature="nope", report=False)
    with pytest.raises(ValueError, match="takes torch arrays"):
        check(correct, signature="hf", arrays="numpy", report=False)


# -- peers' own code -------------------------------------------------------------------------------------
def _hf():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def hf_cos_sin(spec, q, position_ids):
    """HF's own cos/sin: a GPT-NeoX rotary module (its ROPE_INIT_FUNCTIONS rule, partial_rotary_factor,
    dynamic / LongRoPE updates in forward) built from the case's spec."""
    import transformers
    from transformers import modeling_rope_utils
    from transformers.models.gpt_neox import modeling_gpt_neox

    params = hf_rope_parameters(spec)
    if params["rope_type"] != "default" and params["rope_type"] not in modeling_rope_utils.ROPE_INIT_FUNCTIONS:
        raise NotApplicable(f"transformers {transformers.__version__} has no rope_type {params['rope_type']!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.GPTNeoXConfig(hidden_size=2 * spec.head_dim, num_attention_heads=2, num_hidden_layers=1,
                                            intermediate_size=8, vocab_size=16, rope_parameters=params,
                                            max_position_embeddings=spec.max_position_embeddings or 4096)
        return modeling_gpt_neox.GPTNeoXRotaryEmbedding(config)(q, position_ids)


@pytest.mark.peer
def test_hf_apply_rotary_pos_emb_with_rotary_tables():
    _hf()
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    report = check(apply_rotary_pos_emb, signature="hf", cases="full", report=False)
    for r in report.results:
        if not r.applicable:
            assert r.case.endswith("inverse"), r
        elif r.case.startswith("inte") or "interleaved" in r.case:   # rotate_half pairs (i, i+d/2) only
            assert r.failed and "rotate_half pairs (i, i+d/2)" in r.diagnosis, r
        else:   # everything else, huge positions and float64 included (rotary's tables are exact)
            assert r.passed, r


@pytest.mark.peer
def test_hf_with_its_own_rope_init_functions():
    """HF's rotary module (default, linear, dynamic, yarn, llama3, longrope from ROPE_INIT_FUNCTIONS) with its
    apply_rotary_pos_emb: every half-split case but large positions passes; float32 angles are diagnosed."""
    transformers = _hf()
    from transformers import modeling_rope_utils
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    report = check(apply_rotary_pos_emb, signature="hf", cos_sin=hf_cos_sin, cases="full",
                   dtypes=("float32", "float16", "bfloat16"), report=False)
    for r in report.results:
        if not r.applicable:
            assert r.case.endswith("inverse") or r.case.startswith("scaling-ntk"), r
        elif "huge" in r.case:
            assert r.failed and r.diagnosis.startswith("angles formed in fp32: error grows as position x 2^-24"), r
        elif r.case.startswith("inte") or "interleaved" in r.case:
            assert r.failed and "pairs (i, i+d/2): layout='half'" in r.diagnosis, r
        else:
            assert r.passed, r
    for rule in ("linear", "dynamic", "yarn", "llama3", "longrope"):
        assert rule in modeling_rope_utils.ROPE_INIT_FUNCTIONS
        assert report[f"scaling-{rule}"].passed
    for name in ("scaling-dynamic-short", "scaling-longrope-short", "hf-llama3.1", "hf-qwen2.5-yarn",
                 "hf-deepseek-yarn-mscale", "hf-gpt-oss-yarn", "hf-phi3-longrope", "hf-phi2-partial", "half-basic"):
        assert report[name].passed, report[name]
    assert report["scaling-ntk"].applicable is ("ntk" in modeling_rope_utils.ROPE_INIT_FUNCTIONS)
    del transformers


@pytest.mark.peer
def test_hf_llama_computes_in_float32():
    """HF's Llama rotary module and apply_rotary_pos_emb on float64 data: computed in float32, diagnosed."""
    _hf()
    from transformers.models.llama import modeling_llama

    report = check(modeling_llama.apply_rotary_pos_emb, signature="hf", cos_sin=hf_cos_sin,
                   cases=["half-basic", "half-offset", "half-gqa"], dtypes=("float64",), report=False)
    for r in report.results:
        assert r.failed and r.diagnosis.startswith("angles formed in fp32"), r


@pytest.mark.peer
def test_hf_gptj_interleaved():
    """HF GPT-J's rotate_every_two / sinusoidal table (base 10000, interleaved pairs) in the plain signature."""
    _hf()
    from transformers.models.gptj import modeling_gptj

    def gptj(x, positions, spec):
        if spec.scaling is not None or spec.base != 10000.0 or spec.frequencies is not None:
            raise NotApplicable("GPT-J's table is base 10000, unscaled")
        if int(positions.max()) >= 1 << 16:
            raise NotApplicable("GPT-J's table holds max_position_embeddings rows")
        table = modeling_gptj.create_sinusoidal_positions(int(positions.max()) + 1, spec.rotary_dim)
        sincos = table[positions.expand(x.shape[0], -1)]
        sin, cos = torch.split(sincos, spec.rotary_dim // 2, dim=-1)
        rot = modeling_gptj.apply_rotary_pos_emb(x[..., :spec.rotary_dim], sin, cos)
        return torch.cat([rot, x[..., spec.rotary_dim:]], -1)

    report = check(gptj, arrays="torch", cases="full", dtypes=("float32",), report=False)
    for r in report.results:
        if r.case.startswith("inte") and r.applicable and "huge" not in r.case:
            assert r.passed, r
        elif r.case.startswith("half") and r.applicable:
            assert r.failed and "pairs (2i, 2i+1): layout='interleaved'" in r.diagnosis, r


@pytest.mark.peer
def test_lucidrains_rotary_embedding_torch():
    pytest.importorskip("torch")
    pytest.importorskip("rotary_embedding_torch")
    from rotary_embedding_torch import RotaryEmbedding, apply_rotary_emb

    def lucidrains(x, positions, spec):
        kwargs = {}
        if spec.scaling is not None:
            if spec.rope_type not in ("linear", "ntk"):
                raise NotApplicable(f"rotary-embedding-torch has no {spec.rope_type!r} rule")
            key = "interpolate_factor" if spec.rope_type == "linear" else "theta_rescale_factor"
            kwargs[key] = spec.scaling_dict["factor"]
        rope = RotaryEmbedding(dim=spec.rotary_dim, theta=spec.base, seq_before_head_dim=True,
                               cache_if_possible=False, **kwargs)
        if positions.ndim == 1 and torch.equal(positions, positions[0] + torch.arange(positions.shape[0])):
            return rope.rotate_queries_or_keys(x, offset=int(positions[0]))     # its own offset path
        freqs = rope(positions.float() / rope.interpolate_factor)
        return apply_rotary_emb(freqs[..., None, :], x)

    report = check(lucidrains, arrays="torch", cases="full", report=False)
    for name in ("inte-basic", "inte-offset", "inte-batch", "inte-partial", "inte-odd-dim", "inte-gqa",
                 "scaling-linear-interleaved-partial", "scaling-ntk-interleaved-partial", "inte-basic-fp16"):
        assert report[name].passed, report[name]
    assert "pairs (2i, 2i+1): layout='interleaved'" in report["half-basic"].diagnosis
    assert report["inte-huge-offset"].diagnosis.startswith("angles formed in fp32")
    assert report["half-huge-offset-fp16"].diagnosis.startswith("positions formed in fp16")   # arange in x.dtype
    assert not report["scaling-yarn"].applicable


@pytest.mark.peer
def test_flash_attn_apply_rotary_emb():
    """flash-attn's own apply_rotary_emb (Triton: a CUDA device), where installed."""
    pytest.importorskip("torch")
    rotary_mod = pytest.importorskip("flash_attn.layers.rotary")
    if not torch.cuda.is_available():
        pytest.skip("flash-attn's rotary kernel needs a CUDA device")
    report = check(rotary_mod.apply_rotary_emb, signature="flash_attn", device="cuda",
                   dtypes=("float32", "float16", "bfloat16"), report=False)
    for r in report.results:
        if "huge" not in r.case and r.applicable:
            assert r.passed, r


@pytest.mark.peer
def test_mlx_fast_rope():
    mx = pytest.importorskip("mlx.core")
    report = check(mx.fast.rope, signature="mlx", cases="full", dtypes=("float32", "float16", "bfloat16"),
                   report=False)
    for name in ("half-basic", "inte-basic", "half-offset", "half-batch-offset", "half-partial", "inte-odd-dim",
                 "scaling-linear", "hf-phi2-partial", "half-basic-fp16", "half-basic-bf16"):
        assert report[name].passed, report[name]
    assert report["half-huge-offset"].diagnosis.startswith("angles formed in fp32")
    for name in ("scaling-yarn", "half-tokens", "half-inverse"):
        assert not report[name].applicable, report[name]
    assert "no 'yarn' scaling rule" in report["scaling-yarn"].diagnosis
