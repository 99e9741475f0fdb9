import sys
from pathlib import Path

# test helpers (nodeproc, strategy_harness, ...) import as plain modules
sys.path.insert(0, str(Path(__file__).parent))
