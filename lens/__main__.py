"""`python -m lens ...` runs the same commands as `lhd lens ...`."""
from lens.cli import app

app(prog_name="python -m lens")
