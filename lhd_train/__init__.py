"""lhd_train."""
