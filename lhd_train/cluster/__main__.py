"""`python -m lhd_train.cluster slurm render|vars, merge, data merge, doctor` (same as the `lhd` commands)."""
import sys

from lhd_train.cluster.cli import standalone_app
from lhd_train.errors import LhdError


def main() -> None:
    try:
        standalone_app()()
    except LhdError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
