"""``python -m rotary inspect CONFIG [--layer-type T]``: how rotary reads an HF config (a config.json or a
checkpoint folder holding one).

Prints, for each RoPE layer type of the config (or the one named), the spec ``RopeSpec.from_hf_config``
builds: rope type and its parameters, base, head / rotary dims, layout, multi-axis assignment, the
attention factor (multiplied into cos/sin) and the softmax scale factor, then the map from layer
index to layer type. Exit status 0, or 2 with the error when the config cannot be read.
"""

from __future__ import annotations

import argparse
import sys

HELP = "print the RoPE spec(s) rotary reads from an HF config.json"
EPILOG = """examples:
  python -m rotary inspect config.json                                # every RoPE layer type of the config
  python -m rotary inspect ./Llama-3.1-8B                             # a checkpoint folder (its config.json)
  python -m rotary inspect config.json --layer-type sliding_attention  # one layer type (Gemma 3 style)
  python -m rotary inspect config.json --head qk                      # MLA models: the whole [nope | rope] head"""


def describe(spec, axis_names=None) -> list[str]:
    """Lines describing one spec (what a user checks against the model card)."""
    lines = [f"rope type          {spec.rope_type}"]
    if spec.scaling is not None:
        params = {k: v for k, v in spec.scaling_dict.items() if k != "rope_type"}
        lines.append("scaling            " + ", ".join(f"{k}={_short(v)}" for k, v in sorted(params.items())))
    lines.append(f"base (rope_theta)  {spec.base:g}")
    lines.append(f"head / rotary dims {spec.head_dim} / {spec.rotary_dim} ({spec.rotary_dim // 2} pairs)"
                 + (f", rotated from coordinate {spec.rotary_offset}" if spec.rotary_offset else ""))
    lines.append(f"layout             {spec.layout}")
    if spec.frequencies is not None:
        f = spec.inv_freq()
        lines.append(f"frequencies        custom: {_short(f.tolist())}")
    if spec.mrope_section is not None:
        lines.append(f"M-RoPE             sections (t, h, w) {list(spec.mrope_section)}, assignment {spec.mrope_layout}")
    elif spec.multi_axis:
        lines.append(f"axes               {spec.n_axes} coordinates per token")
    if spec.multi_axis:
        lines += pair_assignment(spec, axis_names)
    if spec.max_position_embeddings is not None:
        lines.append(f"max positions      {spec.max_position_embeddings}")
    lines.append(f"attention factor   {spec.attention_scaling:.9g} (multiplies cos and sin)")
    lines.append(f"softmax factor     {spec.softmax_scale_factor:.9g} (multiplies the softmax scale)")
    return lines


#: coordinate names of M-RoPE positions (t, h, w); other multi-axis specs print the coordinate index
MROPE_AXES = "thw"


def pair_assignment(spec, names=None) -> list[str]:
    """Which coordinate each rotated pair reads, complete: runs of pairs ("pairs 0-15 t, 16-39 h, 40-63 w")
    when there are few, else one letter per pair in rows of 32 (an interleaved M-RoPE: "thwthw...").
    ``names``: one letter per coordinate (default t/h/w for M-RoPE, the coordinate index otherwise)."""
    axes = spec.pair_axes().tolist()
    if names is None:
        names = MROPE_AXES if spec.mrope_section is not None and spec.n_axes <= 3 else "0123456789"
    if spec.n_axes > len(names):
        return [f"pairs read         {axes}"]
    runs = _runs([names[a] for a in axes])
    legend = "" if not names[0].isdigit() else " (coordinate index of the position's trailing axis)"
    if len(runs) <= 8:
        return [f"pairs read         {', '.join(runs)}{legend}"]
    letters = "".join(names[a] for a in axes)
    rows = [letters[i:i + 32] for i in range(0, len(letters), 32)]
    out = [f"pairs read         {rows[0]}  (pair 0 first, one letter per pair){legend}"]
    out += [f"                   {row}  (from pair {32 * (k + 1)})" for k, row in enumerate(rows[1:])]
    return out


def _short(value) -> str:
    if isinstance(value, (list, tuple)) and len(value) > 6:
        return "[" + ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in value[:3]) + \
            f", ... {len(value)} values]"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _runs(labels) -> list[str]:
    """['0-4 sliding_attention', '5 full_attention', ...]: consecutive equal labels grouped by index."""
    out, start = [], 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            span = str(start) if i - 1 == start else f"{start}-{i - 1}"
            out.append(f"{span} {labels[start]}")
            start = i
    return out


def inspect_config(config, layer_type=None, head="rope") -> str:
    """The text ``python -m rotary inspect`` prints for a config (dict, PretrainedConfig, or the path of a
    config.json or checkpoint folder); ``head`` as in ``RopeSpec.from_hf_config`` (MLA: "qk" for the whole
    [nope | rope] head, "indexer" for DSA's indexer)."""
    import os

    from ..spec import hf_config as _hf_config
    from ..spec import hf_vision
    from ..spec.rope_spec import RopeSpec

    if isinstance(config, (str, os.PathLike)):
        config = _hf_config.load_config(config)

    vision = hf_vision.vision_reader(config)
    if vision is not None and vision.where == "config":   # the config is a vision tower's own
        return "\n".join(_vision_lines(config))
    if layer_type is not None:
        specs = {layer_type: RopeSpec.from_hf_config(config, layer_type=layer_type, head=head)}
    else:
        specs = RopeSpec.per_layer_from_hf_config(config, head=head)
    out = []
    for name, spec in specs.items():
        out.append(f"[{name}]" if len(specs) > 1 or layer_type is not None or name != "default" else "[all layers]")
        out += ["  " + line for line in describe(spec)]
    reader = _hf_config.text_reader(config)
    types = reader.get("layer_types")
    if types and layer_type is None:
        out.append(f"layers             {', '.join(_runs(list(types)))}")
    if vision is not None and layer_type is None:
        out += _vision_lines(config)
    return "\n".join(out)


def _vision_lines(config) -> list[str]:
    """The vision tower's section: its spec (RopeSpec.from_hf_vision_config), pair assignment and the
    positions HF builds for it."""
    from ..spec import hf_vision
    from ..spec.rope_spec import RopeSpec

    try:
        spec, family, cls_name, positions = hf_vision.vision_spec(config, RopeSpec)
    except ValueError as exc:   # a tower no single spec reproduces (Gemma 4): say what does
        return ["[vision]", f"  {exc}"]
    # grid_positions' coordinates: (row, col), or (frame, row, col)
    names = {2: "rc", 3: "trc"}.get(spec.n_axes)
    out = [f"[vision: {family}, HF {cls_name}]"]
    out += ["  " + line for line in describe(spec, names)]
    if names:
        words = ("frame", "row", "col")[-len(names):]
        out.append("  coordinates        " + " ".join(f"{n}={w}" for n, w in zip(names, words))
                   + " (grid_positions' trailing axis)")
    out.append(f"  positions          {positions}")
    return out


def run_cli(args) -> int:
    try:
        print(inspect_config(args.config, args.layer_type, args.head))
    except (OSError, ValueError, TypeError) as exc:
        print(f"rotary inspect: {exc}", file=sys.stderr)
        return 2
    except RecursionError:   # a config nested past Python's recursion limit
        print(f"rotary inspect: {args.config}: the config nests values deeper than Python's recursion limit "
              "(not an HF config.json)", file=sys.stderr)
        return 2
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("inspect", help=HELP, description=HELP, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="path to an HF config.json, or a checkpoint folder holding one")
    parser.add_argument("--layer-type", default=None, help="only this layer type (e.g. full_attention)")
    parser.add_argument("--head", default="rope", choices=("rope", "qk", "indexer"),
                        help="MLA models: the rope part (default), the whole [nope | rope] q/k head, or "
                             "DeepSeek-V3.2's DSA indexer head")
    parser.set_defaults(func=run_cli)
    return parser
