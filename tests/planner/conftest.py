import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # tests run from a checkout without `pip install -e .`
    sys.path.insert(0, ROOT)
