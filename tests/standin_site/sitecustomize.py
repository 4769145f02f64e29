"""Activates the stand-in Triton driver in every Python started with this folder on PYTHONPATH.

Only GPU-free tests put this folder on PYTHONPATH: ninetoothed's AOT path
runs ``python -m triton.tools.compile``, which needs an active driver.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_standin

triton_standin.activate()
