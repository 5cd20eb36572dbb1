"""Decoding: generation settings, request planning, trees, acceptance, drafters, prompt
lookup, the speculative engine, single-sequence steps, batching and the response stream.
Imports the ground modules and `targets`; drafters hold heads by their interface only.
"""
