"""What a tree costs on a hybrid linear-attention target against an attention-only one of
the same size, measured in one run on this machine:

* the verify cost of T tree nodes (a drafted-tree shape, depth about log2 T) after a
  prefix, against T, for a hybrid with Qwen3.5-9B's proportions at a smaller width (Gated
  DeltaNet layers, full attention every 4th) and an attention-only Qwen3 of the same width,
  depth, attention heads and MLP;
* the cycle's time outside the model forwards (draft, acceptance, update) with a random
  EAGLE-1 head and a 16/4/4 tree;
* the bytes a tree node costs in recurrent state for Qwen3.5-9B and Qwen3.5-35B-A3B shapes
  (transformers' default Qwen3.5 configs), from the same code that bounds the trees.

    python -m eagle_mlx.benchmark hybrid-verify [--hidden 1024 --layers 8 --prefix 512]
"""

import argparse
import time

import mlx.core as mx


def build(kind: str, a):
    from mlx.utils import tree_map

    from .. import mlxlm
    from ..targets.target import Target

    # Qwen3.5-9B's proportions at width H (4096 there): attention 16 heads of 256 and 4 KV
    # heads, linear layers 32 value heads and 16 key heads of 128, MLP 3H
    H = a.hidden
    common = dict(hidden_size=H, num_hidden_layers=a.layers, intermediate_size=H * 3,
                  num_attention_heads=max(1, H // 256), num_key_value_heads=max(1, H // 1024),
                  head_dim=256, vocab_size=32000, rms_norm_eps=1e-6, max_position_embeddings=8192,
                  tie_word_embeddings=False)
    if kind == "hybrid":
        config = dict(common, model_type="qwen3_5", linear_num_value_heads=max(1, H // 128),
                      linear_num_key_heads=max(1, H // 256), linear_key_head_dim=128,
                      linear_value_head_dim=128,
                      linear_conv_kernel_dim=4, full_attention_interval=4,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                       "partial_rotary_factor": 0.25})
    else:
        config = dict(common, model_type="qwen3", rope_theta=1e7)
    module = mlxlm.model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.float32) * 0.02 if p.ndim > 1 else p,
                          model.parameters()))
    mx.eval(model.parameters())
    return Target(model, config)


def verify_curve(target, prefix, sizes, reps=5):
    from .curves import heap_tree

    cache = target.make_cache()
    mx.eval(target(mx.arange(3, 3 + prefix)[None], cache)[0])
    out = {}
    for k in sizes:
        anc, depth = heap_tree(k)
        mask = mx.concatenate([mx.ones((k, prefix), dtype=mx.bool_), anc], axis=1)
        positions, levels = prefix + depth, int(depth.max().item())
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            h, _ = target(mx.arange(3, 3 + k)[None], cache, positions=positions, mask=mask,
                          max_depth=levels)
            mx.eval(target.lm_head(h))
            times.append(time.perf_counter() - t)
            for m, c in zip(target.mechanisms, cache):
                m.truncate(c, prefix)
                if hasattr(c, "pending"):
                    c.pending = None
        out[k] = sorted(times)[reps // 2]
    return out


def cycle_phases(target, prompt_len, cycles=12):
    from ..heads.eagle import Eagle1Head, HeadArgs
    from ..decoding.profiling import PhaseTimer
    from ..decoding.steps import SamplingParams, eagle_steps
    from ..training.trainer import new_head_config

    head = Eagle1Head(HeadArgs.from_config(new_head_config(target), "eagle1"))
    mx.eval(head.parameters())
    timer = PhaseTimer()
    steps = eagle_steps(target, head, list(range(3, 3 + prompt_len)), SamplingParams(), 16, 4, 4,
                        timer=timer)
    for n, _ in zip(range(cycles + 1), steps):
        pass
    return timer


def state_bytes():
    import transformers

    from .. import mlxlm
    from ..targets.families import LinearAttentionMechanism
    from ..targets.target import Target

    out = {}
    for name, cls in (("Qwen3.5-9B", "Qwen3_5TextConfig"), ("Qwen3.5-35B-A3B", "Qwen3_5MoeTextConfig")):
        config = getattr(transformers, cls)().to_dict()
        config["model_type"] = {"Qwen3_5TextConfig": "qwen3_5"}.get(cls, "qwen3_5_moe")
        config["full_attention_interval"] = 4
        module = mlxlm.model_module(config["model_type"])
        model = module.Model(module.ModelArgs.from_dict(config))  # never evaluated: no memory
        target = Target(model, config)
        out[name] = target.node_state_bytes, sum(isinstance(m, LinearAttentionMechanism)
                                                 for m in target.mechanisms)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark hybrid-verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--sizes", default="1,2,4,8,16,32,64")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    print(f"{mx.default_device()}, float32, hidden {a.hidden}, {a.layers} layers, prefix {a.prefix}")
    rows = {}
    for kind in ("hybrid", "attention"):
        target = build(kind, a)
        curve = verify_curve(target, a.prefix, sizes)
        timer = cycle_phases(target, a.prefix)
        rows[kind] = curve, timer, target.node_state_bytes
        del target
    print(f"{'T':>4} " + " ".join(f"{k + ' ms':>12} {k + ' /t(1)':>13}" for k in rows))
    for k in sizes:
        print(f"{k:>4} " + " ".join(f"{c[k] * 1e3:>12.1f} {c[k] / c[1]:>13.2f}"
                                    for c, _, _ in rows.values()))
    for kind, (_, timer, per_node) in rows.items():
        per = {k: v / max(timer.cycles, 1) * 1e3 for k, v in timer.seconds.items()}
        outside = per["draft"] + per["accept"] + per["update"]
        print(f"{kind}: a 16/4/4 cycle: verify {per['verify']:.0f} ms, outside the model "
              f"forwards {outside:.0f} ms (draft {per['draft']:.0f}, accept {per['accept']:.0f}, "
              f"update {per['update']:.0f}); recurrent state a node: {per_node / 2**10:.0f} KB")
    for name, (per_node, linear) in state_bytes().items():
        print(f"{name}: {linear} linear-attention layers, {per_node / 2**20:.1f} MB of recurrent "
              f"state a tree node (60 nodes: {60 * per_node / 2**30:.2f} GB)")


if __name__ == "__main__":
    main()
