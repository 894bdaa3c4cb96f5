"""Analysis engine: structure, drift, calibration, quality and generation measurements (spec §4, §7)."""
