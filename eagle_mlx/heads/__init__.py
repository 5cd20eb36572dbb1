"""Draft heads: EAGLE-1/2/3 heads (`eagle`), the models' own MTP modules (`mtp`), the
published checkpoint layouts (`layouts`), reading (`read`) and writing (`write`) head
checkpoints, the safe PyTorch pickle reader and the reduced draft vocabulary.
Imports the ground modules and `targets`.
"""
