"""Confidence calibration: Sequential Temperature Scaling (sts.py, docs/method.md §4)."""

from dspark.calibration.sts import STSFit, apply_temperatures, ece, fit_sts, roc_auc

__all__ = ["STSFit", "apply_temperatures", "ece", "fit_sts", "roc_auc"]
