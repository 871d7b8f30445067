"""benchmarks/bench_decode_step.py at a tiny cell: the script runs end to end (fill, the check against torch SDPA,
every row, the JSON) and its figure is drawn from that JSON; its memory plan keeps the grid's heavy cells under the
budget. No timing is asserted."""

import importlib.util
import json
from pathlib import Path

import pytest

import rotary

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench():
    return _module("benchmarks/bench_decode_step.py", "bench_decode_step_under_test")


def test_cells_and_memory_plan():
    bench = _bench()
    assert bench.parse_cell("4kx8") == (4096, 8) and bench.parse_cell("1000x32") == (1000, 32)
    with pytest.raises(Exception):
        bench.parse_cell("4k")
    gib = 2**30
    # 16k keys x 32 sequences in fp32: 4 GiB of K+V a layer; with torch's copies one layer peaks at 12 GiB
    assert bench.kv_bytes_per_layer(16384, 32, "fp32") == 4 * gib
    assert bench.plan_layers(16384, 32, "fp32", 32, 6 * gib) == 0
    assert bench.plan_layers(16384, 32, "int8", 32, 6 * gib) == 3
    assert bench.plan_layers(16384, 8, "fp32", 32, 6 * gib) == 2
    assert bench.plan_layers(1024, 1, "fp32", 32, 6 * gib) == 32
    assert bench.plan_layers(1024, 1, "fp32", 2, 6 * gib) == 2
    for context in bench.CONTEXTS:
        for batch in bench.BATCHES:
            for kv in bench.KVS:
                layers = bench.plan_layers(context, batch, kv, 32, 6 * gib)
                if layers:
                    assert bench.peak_bytes(context, batch, kv, layers) <= 6 * gib
                    if layers < 32:   # scaled cells are far past any last-level cache
                        assert layers * bench.kv_bytes_per_layer(context, batch, kv) >= 128 * 2**20
    row = bench.summarize([0.2, 0.1, 0.3], reps=2, scale=16)
    assert row["median_ms"] == pytest.approx(1600) and row["best_ms"] == pytest.approx(800)


def test_tiny_run_and_its_figure(tmp_path):
    if not rotary.available_backends()["numba"][0]:
        pytest.skip("the benchmark times rotary's Numba backend")
    bench = _bench()
    out = tmp_path / "decode_step.json"
    res = bench.main(["--cells", "256x2", "--layers", "2", "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text())["cells"] == json.loads(json.dumps(res["cells"]))
    assert [(c["label"], c["kv"], c["layers_timed"]) for c in res["cells"]] == [("256 x 2", "fp32", 2),
                                                                                ("256 x 2", "int8", 2)]
    torch_there = res["machine"]["torch"] is not None
    for cell in res["cells"]:
        names = {"step", "append", "attend", "read_limit"}
        if torch_there and cell["kv"] == "fp32":
            names |= {"torch_gather_sdpa", "torch_sdpa_pregathered"}
        assert set(cell["rows"]) == names
        assert all(r["median_ms"] > 0 and r["best_ms"] <= r["median_ms"] for r in cell["rows"].values())
        assert cell["scale_to_model"] == 16 and cell["read_GBps"] > 0
        if torch_there:
            assert cell["check"]["rel_error"] < bench.TOL
    assert "| 256 x 2 | int8 |" in bench.report(res)
    pytest.importorskip("matplotlib")
    plot = _module("docs/scripts/plot_decode_step.py", "plot_decode_step_under_test")
    png = plot.plot(out, tmp_path / "decode_step.png")
    assert png.stat().st_size > 0
