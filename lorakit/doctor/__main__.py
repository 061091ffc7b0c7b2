"""python -m lorakit.doctor: see lorakit.doctor.cli."""

import sys

from lorakit.doctor.cli import main

if __name__ == "__main__":
    sys.exit(main())
