# SPDX-License-Identifier: MIT
"""Run a Python command in the virtual environment that holds torch and
transformers (``./kvrecall.sh test`` makes it: ``$KVRECALL_VENV``, by default
``${XDG_CACHE_HOME:-~/.cache}/kvrecall/venv``), or skip (exit 77, meson's
"skipped") saying why when there is none.

    python3 run_in_venv.py -m pytest tests/python/test_transformers.py
"""
import os
import sys

cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
venv = os.environ.get("KVRECALL_VENV") or os.path.join(cache, "kvrecall", "venv")
python = os.path.join(venv, "bin", "python")
if not os.access(python, os.X_OK):
    print(f"skipped: no virtual environment at {venv} (./kvrecall.sh test makes it; or set KVRECALL_VENV)")
    sys.exit(77)
os.execv(python, [python] + sys.argv[1:])
