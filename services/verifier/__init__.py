"""Verifier service: the target model, per-request KV caches and the rejection sampler
(dspark.engine.verifier.LocalVerifier) behind gRPC, with the SPS(B) profile measured at start.
`server.py` serves it, `client.py` (RemoteVerifier) calls it."""
