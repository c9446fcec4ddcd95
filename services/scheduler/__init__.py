"""Scheduler service (issue #5): continuous batching and the prefix scheduler (Algorithm 1).

Today one process runs the loop: `dspark.engine.speculative.SpeculativeEngine` with a fixed
number of draft tokens per round. The scheduling policies (Algorithm 1, its async variant,
fixed:K, threshold:C) will be pure functions in the library, wrapped here by the gRPC service.
"""
