"""``RopeSpec.from_hf_config`` on every HF config class's default config and on mutated configs (issue 25):
a spec, or a clear ConfigError (a ValueError naming the config key), never a TypeError / KeyError /
AttributeError / OverflowError from inside, and never a hang.

Mutations: fields removed, wrong types (lists, dicts, None, bools), strings for numbers, negative or zero
values, NaN / inf, huge integers, unknown rope_type. The default configs also agree between the
PretrainedConfig object and its ``to_dict()`` (the dict path fills in the class defaults itself).
"""

from __future__ import annotations

import copy
import signal
import sys
import warnings

import numpy as np
import pytest

import rotary
from rotary.spec.hf_config import ConfigError

transformers = pytest.importorskip("transformers")

N_MUTATED = 200
#: fields the reader looks at, and others a mutation may break
FIELDS = ("head_dim", "hidden_size", "num_attention_heads", "max_position_embeddings", "rope_theta",
          "partial_rotary_factor", "rope_parameters", "rope_scaling", "rotary_dim", "qk_rope_head_dim",
          "qk_nope_head_dim", "mrope_section", "mrope_interleaved", "rope_type", "factor", "beta_fast",
          "original_max_position_embeddings", "text_config", "num_hidden_layers", "rotary_emb_base",
          "rope_interleave", "model_type", "layer_types", "no_rope_layers", "no_rope_layer_interval",
          "sliding_window", "short_factor", "long_factor", "low_freq_factor", "high_freq_factor")
BAD_VALUES = (None, "4096", "abc", "1e4", -1, 0, -0.5, 1.5, float("nan"), float("inf"), [], {}, [1, 2], True, False,
              10**30, {"x": 1}, {"rope_type": "no-such-rule", "factor": 2.0}, "yarn")


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.fixture(scope="module")
def default_configs():
    """{model_type: PretrainedConfig} of every config class transformers can build with its defaults."""
    from transformers import CONFIG_MAPPING

    out = {}
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            out[model_type] = _quiet(transformers.AutoConfig.for_model, model_type)
        except Exception:  # noqa: BLE001 - a class that cannot build itself has no default config to read
            continue
    assert len(out) > 300
    return out


def read(config):
    """from_hf_config(config): the spec, or the ConfigError; anything else fails the test (with a 20 s
    alarm turning a hang into a failure where signals allow)."""
    def hang(*_):
        raise TimeoutError("from_hf_config did not return within 20 s")

    use_alarm = sys.platform != "win32"
    if use_alarm:
        old = signal.signal(signal.SIGALRM, hang)
        signal.alarm(20)
    try:
        return _quiet(rotary.RopeSpec.from_hf_config, config)
    except ConfigError as exc:
        assert str(exc), "an empty message"
        return exc
    finally:
        if use_alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


def _has_rope_parameters(d) -> bool:
    keys = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_emb_base")
    return any(d.get(k) is not None for k in keys) or any(
        isinstance(d.get(sub), dict) and _has_rope_parameters(d[sub]) for sub in ("text_config", "llm_config",
                                                                                "language_config", "decoder"))


def test_every_default_config(default_configs):
    """Each class's default config, as the object and as its dict: a spec or a ConfigError; for configs
    with RoPE parameters the same outcome both ways (and the same spec)."""
    outcomes = {"spec": 0, "error": 0}
    differ = []
    for model_type, config in default_configs.items():
        a = read(config)
        b = read(_quiet(config.to_dict))
        outcomes["spec" if isinstance(a, rotary.RopeSpec) else "error"] += 1
        if not _has_rope_parameters(_quiet(config.to_dict)):
            continue   # no RoPE (BART, CLIP, ...): the reader's fallback head sizes may read other aliases
        if isinstance(a, rotary.RopeSpec) and isinstance(b, rotary.RopeSpec):
            assert a.head_dim >= a.rotary_dim + a.rotary_offset and a.base > 0
            if a != b:
                differ.append((model_type, a, b))
        elif isinstance(a, rotary.RopeSpec) != isinstance(b, rotary.RopeSpec):
            differ.append((model_type, a, b))
    assert outcomes["spec"] > 200, outcomes
    assert not differ, "\n".join(f"{m}: object {a!r} / dict {b!r}" for m, a, b in differ[:10])


def _paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict) and len(prefix) < 2:
            yield from _paths(v, prefix + (k,))


def mutations(configs, n, seed=25):
    """n deterministic mutations (1-3 changes each) of the default configs' dicts."""
    rng = np.random.default_rng(seed)
    names = sorted(configs)
    out = []
    while len(out) < n:
        base = copy.deepcopy(_quiet(configs[names[rng.integers(len(names))]].to_dict))
        paths = [p for p in _paths(base) if p[-1] in FIELDS]
        if not paths:
            continue
        changes = []
        for _ in range(int(rng.integers(1, 4))):
            path = paths[rng.integers(len(paths))]
            parent = base
            for key in path[:-1]:
                parent = parent.get(key) if isinstance(parent, dict) else None
            if not isinstance(parent, dict):
                continue
            if rng.integers(3) == 0:
                parent.pop(path[-1], None)
                changes.append(("removed", path))
            else:
                value = BAD_VALUES[rng.integers(len(BAD_VALUES))]
                parent[path[-1]] = copy.deepcopy(value)
                changes.append(("set", path, value))
        out.append((changes, base))
    return out


def test_mutated_configs(default_configs):
    """200 mutated configs: a spec or a ConfigError each (a mutation may leave a readable config)."""
    outcomes = {"spec": 0, "error": 0}
    for changes, config in mutations(default_configs, N_MUTATED):
        try:
            got = read(config)
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"{type(exc).__name__}: {exc} for {changes}") from exc
        outcomes["spec" if isinstance(got, rotary.RopeSpec) else "error"] += 1
    assert outcomes["spec"] > 20 and outcomes["error"] > 20, outcomes


# -- the defects the mutations found (each was a TypeError, AttributeError, OverflowError or a hang) --------
BASE = {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 1e4}


@pytest.mark.parametrize("config, words", [
    ({**BASE, "model_type": {"x": 1}}, "model_type"),                                   # TypeError: unhashable
    ({**BASE, "model_type": "gemma3_text", "layer_types": float("nan")}, "layer_types"),   # not iterable
    ({**BASE, "model_type": "gemma3_text", "layer_types": None, "num_hidden_layers": 10**30}, "num_hidden_layers"),
    ({**BASE, "hidden_size": 10**30}, "head_dim"),                                       # a hang / OverflowError
    ({**BASE, "head_dim": 10**30}, "head_dim"),
    ({**BASE, "model_type": "qwen2_vl", "rope_parameters": {"rope_type": "default", "mrope_section": float("nan")}},
     "mrope_section"),
    ({**BASE, "model_type": "gemma3_text", "rope_parameters": {"full_attention": "x", "sliding_attention": {}}},
     "rope_parameters"),                                                                 # AttributeError
    ({**BASE, "model_type": "llama4_text", "no_rope_layer_interval": 0, "num_hidden_layers": 4}, "no_rope_layer_interval"),
    ({**BASE, "model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention"],
      "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "per layer type"),
    ({**BASE, "rope_scaling": {"rope_type": "no-such-rule", "factor": 2.0}}, "rope_type"),   # was a bare ValueError
])
def test_broken_configs_give_a_config_error(config, words):
    with pytest.raises(ConfigError, match=words):
        _quiet(rotary.RopeSpec.from_hf_config, config)
