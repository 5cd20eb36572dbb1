"""scripts/bench_device.py on the CPU, at tiny shapes: every mode's tokens are plain
decoding's, and the set acceptance is what the drafted chains get (the mean accepted length
of a chain of d at per-token acceptance a, worked out: (1 - a^(d+1)) / (1 - a))."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_device.py"


def test_bench_device_tiny_shapes(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_device", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--tiny", "--context", "24", "--max-tokens", "40", "--nodes", "1", "2",
                         "4", "--acceptance", "1.0", "0.6", "--chains", "1", "3", "--reps", "1",
                         "--output", str(tmp_path / "r.json")])
    assert [s["shape"] for s in report["shapes"]] == list(bench.SHAPES)
    for shape in report["shapes"]:
        assert set(shape["verify_seconds"]) == {"1", "2", "4"}
        for row in shape["acceptance"]:
            modes = row["modes"]
            assert all(m["identical"] for m in modes.values()), (shape["shape"], modes)
            a = row["acceptance"]
            for d in (1, 3):
                tau = modes[f"chain {d}"]["tau"]
                expected = d + 1 if a == 1.0 else (1 - a ** (d + 1)) / (1 - a)
                # (40 tokens: a few dozen cycles, and the last is cut short)
                assert tau == pytest.approx(expected, rel=0.35 if a < 1 else 0.1), (d, a, tau)
