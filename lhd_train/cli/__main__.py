"""`python -m lhd_train.cli ...`: the same as `lhd ...`."""
from lhd_train.cli import main

main()
