"""Offline evaluation: the paper's benchmark prompts (prompts.py); accepted-length evaluation follows (issue #4)."""
