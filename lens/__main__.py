"""`python -m lens ...` runs the same commands as `lhd lens ...`."""
import sys

from lens.cli import app
from lhd_train.cli import guarded

sys.exit(guarded(lambda: app(prog_name="python -m lens")))
