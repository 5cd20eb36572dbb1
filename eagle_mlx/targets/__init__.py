"""Targets: mlx-lm's models made tree-capable without changing them.

`target` holds the `Target` adapter (one forward over a tree of tokens, keeping an accepted
path), `load` reads a checkpoint (folder, Hub repo, GGUF) into one; `families` and
`mechanisms` describe each model type's layers, `gated_delta` is the tree recurrence of
the linear-attention hybrids, `cache` the caches the tree forward writes to.
Imports only the ground modules (errors, mlxlm, outputs, hub).
"""
