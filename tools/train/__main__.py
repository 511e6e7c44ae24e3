"""`python -m tools.train`: see tools/train/train.py."""
import sys

from .train import main

if __name__ == "__main__":
    sys.exit(main())
