"""The served path against the in-process batch: `benchmarks.served` (`andromeda bench served`), kept
under this name for the GPU machine's `device_check.sh served` stage and older commands."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.served import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
