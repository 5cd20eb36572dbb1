"""Targets: mlx-lm's models made tree-capable without changing them.

`target` holds the `Target` adapter (one forward over a tree of tokens, keeping an accepted
path), `load` reads a checkpoint (folder, Hub repo, GGUF via `gguf`) into one, with the
dtypes of `dtypes`; `families` describes how each model type runs its layers in a tree (and
the Gated DeltaNet tree recurrence of the hybrids), `layers` the RoPE and attention at
per-token positions, `cache` the caches the tree forward writes to.
Imports only the ground modules (errors, mlxlm, outputs, hub, tensorfiles).
"""
