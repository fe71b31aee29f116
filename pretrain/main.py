"""Entry point for launchers that take a script path:

    deepspeed --num_gpus 2 pretrain/main.py --ds ds_configs/cpu_zero2.json [--set key=value ...]

Equivalent to `pretrain train ...`; the launcher's `--local_rank` is accepted and ignored in
favour of the LOCAL_RANK environment variable.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a file, Python puts pretrain/ itself first on sys.path, where its modules would
    # shadow top-level names; import the package from the checkout root instead.
    here = Path(__file__).resolve().parent
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(here.parent))

    from pretrain.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
