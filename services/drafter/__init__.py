"""Drafter service (issue #5): hosts a drafter and streams draft blocks + confidences over gRPC.

The drafting logic lives in `dspark.drafters` (today: `ngram.NgramDrafter`; the DSpark drafter
arrives with issue #3); this package will only hold the gRPC servicer around it.
"""
