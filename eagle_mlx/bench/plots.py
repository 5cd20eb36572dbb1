"""The benchmark's plot: tau and speedups per tree, and this machine's cost curves."""

def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for temp, per_tree in results["trees"].items():
        sizes = [t["tree"]["total_tokens"] for t in per_tree]
        a.plot(sizes, [t["tau"] for t in per_tree], "o-", label=f"tau, temp {temp}")
        a.plot(sizes, [t["measured_speedup"] for t in per_tree], "s--",
               label=f"measured speedup, temp {temp}")
        a.plot(sizes, [t["expected_speedup"] for t in per_tree], "^:",
               label=f"expected speedup, temp {temp}")
    a.axhline(1.0, color="gray", lw=0.8)
    a.set_xscale("log", base=2)
    a.set_xlabel("tree size (total tokens)")
    a.set_title("acceptance and speedup per tree")
    a.legend(fontsize=7)
    curve = results["verify_cost_curve"]
    ks = sorted(int(k) for k in curve)
    b.plot(ks, [curve[str(k)] for k in ks], "o-", label="verify t(k)/t(1)")
    if results.get("draft_cost_curve"):
        d = results["draft_cost_curve"]
        b.plot(ks, [d[str(k)] for k in ks], "s--", label="draft step / verify t(1)")
    b.set_xscale("log", base=2)
    b.set_xlabel("tokens per forward (k)")
    b.set_title("cost curves on this machine")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
