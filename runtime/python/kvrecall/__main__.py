# SPDX-License-Identifier: MIT
"""python -m kvrecall: the benchmarks (python -m kvrecall.bench --help)."""
import sys

from .bench import main

sys.exit(main())
