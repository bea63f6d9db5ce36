"""Shared by tests/python and tests/gpu: helper modules in tests/ (trimul_cases) are importable."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
