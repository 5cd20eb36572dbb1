"""Training heads: conversations and their rendering (`data`), feature shards (`features`),
the training-time test (`ttt`), loss functions and the training loop (`trainer`).
Imports the ground modules, `targets` and `heads`.
"""
