"""The HTML report (`lhd report`) and the trajectory viewer (`lhd view`): static, self-contained
pages (inline CSS, base64 PNG plots, one hashed inline script, no network)."""
from lhd_train.report.build import build_report
from lhd_train.report.viewer import build_viewer, write_trial_page

__all__ = ["build_report", "build_viewer", "write_trial_page"]
