"""`python -m lens ...` runs the same commands as `lhd lens ...`, inside the same error boundary
(the app's group is `lhd_train.boundary.GuardedGroup`)."""
import os

from lens.cli import app

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
app(prog_name="python -m lens")
