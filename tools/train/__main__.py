"""`python -m tools.train`: see tools/train/train.py."""
import sys

from .train import main

sys.exit(main())
