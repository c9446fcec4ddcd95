"""Verifier service (issue #5): the target runtime behind gRPC.

Its core already exists in the library: `dspark.model.target_runtime.TargetRuntime` (batched
variable-length forward, per-request KV caches under a budget) and
`dspark.sampling.rejection_sample` (exact torch reference and fused Triton kernel). This
package will hold the gRPC servicer that exposes them and serves the SPS(B) profile
(`dspark.profiling.sps`).
"""
