"""The benchmarks behind `python -m eagle_mlx.benchmark`: prompt sets (`prompts`), timed runs
(`timing`), cost curves and the cycle model (`curves`), the tree tuning (`trees`), adaptive
speculation against plain decoding (`auto`), prompt lookup (`lookup`), long contexts
(`context`), the plot (`plots`), and the benchmarks that are subcommands of the tool
(`SUBCOMMANDS` in `eagle_mlx.benchmark`): peers, device shapes, batching, the server and
its load test, the plain pass, the forward pass, training, and more."""
