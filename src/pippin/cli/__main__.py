"""``python -m pippin.cli``: how tests, benchmarks and the OpenBLAS re-exec start pippin."""

import sys

from pippin.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
