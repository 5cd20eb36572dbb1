"""`python -m eagle_mlx.benchmark peers` on a tiny pair: every mode runs every prompt of both sets, and
eagle_mlx's modes (plain, lookup, auto) give mlx-lm's plain decoding's tokens (mlx-dspark's
modes join where it is installed)."""

from tiny import make_eagle_head, tiny_llama

def test_bench_peers_tiny_pair(tmp_path):
    target = tiny_llama(tmp_path / "t", num_hidden_layers=2, max_position_embeddings=2048)
    head = make_eagle_head(tmp_path / "h", target, "eagle1", seed=1)
    from eagle_mlx.bench import peers

    report = peers.main(["--model", str(target), "--eagle", str(head), "--num-prompts", "1",
                         "--max-tokens", "12", "--output", str(tmp_path / "r.json")])
    assert set(report["summary"]) == {"chat", "copy"}
    for kind, modes in report["summary"].items():
        assert {"mlx-lm plain", "eagle_mlx plain", "eagle_mlx lookup",
                "eagle_mlx auto"} <= set(modes)
        for name, s in modes.items():
            assert s["tokens_per_second"] > 0
            if name.startswith("eagle_mlx"):
                assert s["identical"], (kind, name)
    assert len(report["prompts"]) == 2
