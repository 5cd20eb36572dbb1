"""`python -m eagle_mlx.benchmark device` on the CPU, at tiny shapes in float16: every mode's tokens are
mlx-lm's own `generate_step`'s (the built model has no near-ties), the set acceptance is
what the drafted chains and trees get (worked out by enumeration: a chain of d at
per-token acceptance a keeps (1 - a^(d+1)) / (1 - a) tokens a cycle; a tree keeps 1 plus
the sum, over its rank paths, of each path's probability), every cost figure is there, a
failing shape is reported while the others go on, and --budget ends the run."""

import json
import math
import pytest



@pytest.fixture(scope="module")
def bench():
    from eagle_mlx.bench import device

    return device


def expected_tau(shape, a: float) -> float:
    return 1 + sum(math.prod(a * (1 - a) ** r for r in path) for path in shape)


def test_bench_device_tiny_shapes_in_float16(bench, tmp_path):
    out = tmp_path / "r.json"
    report = bench.main(["--tiny", "--dtype", "float16", "--context", "24", "--max-tokens",
                         "40", "--nodes", "1", "4", "--acceptance", "1.0", "0.6", "--chains",
                         "1", "3", "--trees", "8/3/2", "--reps", "1", "--reps-cost", "1",
                         "--output", str(out)])
    assert json.loads(out.read_text())["shapes"] == report["shapes"]
    assert [s["shape"] for s in report["shapes"]] == list(bench.SHAPES)
    for shape in report["shapes"]:
        assert "error" not in shape, shape.get("traceback")
        at = shape["contexts"]["24"]
        costs = at["costs"]
        for curve in ("mlx_lm", "tree_forward"):
            assert set(costs[curve]) == {"1", "4"}
        for curve in ("mlx_lm", "engine_batch_verify"):  # (a batch of 4 beside)
            assert set(costs["batch 4"][curve]) == {"1", "4"}
        for cycles in (costs["keys padded: True"], costs["keys padded: False"],
                       costs["uncompiled"]):
            assert set(cycles["cycle"]) == {"1", "4"}
            assert set(cycles["phases"]["4"]) == {"draft", "verify", "accept", "update"}
        for row in at["acceptance"]:
            modes = row["modes"]
            assert all(m["identical"] for m in modes.values()), (shape["shape"], modes)
            a = row["acceptance"]
            for d in (1, 3):
                tau = modes[f"chain {d}"]["tau"]
                expected = d + 1 if a == 1.0 else (1 - a ** (d + 1)) / (1 - a)
                # (40 tokens: a few dozen cycles, and the last is cut short)
                assert tau == pytest.approx(expected, rel=0.35 if a < 1 else 0.1), (d, a, tau)
            tau = modes["tree 8/3/2"]["tau"]
            expected = expected_tau(bench.tree_shape(8, 3, 2, a), a)
            assert tau == pytest.approx(expected, rel=0.35 if a < 1 else 0.1), (a, tau)


def test_tree_shapes_are_the_most_probable_rank_paths(bench):
    """Best-first against exact enumeration: the kept paths are the nodes - 1 most probable
    of all rank paths within the depth and top-k, parents before children."""
    import itertools

    a = 0.7
    for nodes, depth, top_k in [(16, 4, 4), (8, 3, 2), (5, 4, 1)]:
        shape = bench.tree_shape(nodes, depth, top_k, a)
        every = [p for d in range(1, depth + 1)
                 for p in itertools.product(range(top_k), repeat=d)]
        prob = {p: math.prod(a * (1 - a) ** r for r in p) for p in every}
        best = sorted(every, key=lambda p: -prob[p])[: nodes - 1]
        assert sorted(prob[p] for p in shape) == pytest.approx(sorted(prob[p] for p in best))
        assert all(p[:-1] == () or shape.index(p[:-1]) < shape.index(p) for p in shape)


def test_a_failing_shape_is_reported_and_the_budget_ends_the_run(bench, tmp_path,
                                                                monkeypatch):
    built = bench.build

    def build(name, *args, **kwargs):
        if name == "qwen3.5-9b":
            raise RuntimeError("no such kernel")
        return built(name, *args, **kwargs)

    monkeypatch.setattr(bench, "build", build)
    report = bench.main(["--tiny", "--shapes", "qwen3.5-9b", "llama-3.1-8b", "--context", "16",
                         "--max-tokens", "8", "--nodes", "1", "2", "--acceptance", "0.5",
                         "--chains", "1", "--trees", "--reps", "1", "--reps-cost", "1",
                         "--output", str(tmp_path / "r.json")])
    failed, ran = report["shapes"]
    assert failed["error"] == "RuntimeError: no such kernel"
    assert ran["contexts"]["16"]["acceptance"][0]["modes"]["chain 1"]["identical"]
    report = bench.main(["--tiny", "--budget", "0", "--output", str(tmp_path / "b.json")])
    assert all(s.get("skipped") for s in report["shapes"])
