"""Scheduler service (issue #5): continuous batching and the prefix scheduler behind gRPC.

The math already lives in the library: `dspark.scheduling` (Algorithm 1, its async variant and
the baseline policies, pure functions) and `dspark.engine.speculative` (the round loop, which
today drafts a fixed γ per round). This package will hold the gRPC servicer around them.
"""
