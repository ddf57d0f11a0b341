#!/usr/bin/env python
"""Write deterministic tiny random HF checkpoints (thin wrapper around nvllm.launch.tiny).

python scripts/make_tiny_checkpoint.py --preset qwen3 --out /tmp/tiny
python scripts/make_tiny_checkpoint.py --all
"""

import pathlib
import sys

# Allow running from a source checkout without `pip install -e .`.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from nvllm.launch.tiny import main  # noqa: E402

if __name__ == "__main__":
    main()
