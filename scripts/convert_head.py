#!/usr/bin/env python3
"""Convert a published EAGLE head to MLX: the same as `python -m eagle_mlx.convert`."""
import sys

from eagle_mlx.convert import main

if __name__ == "__main__":
    sys.exit(main())
