"""Scheduler service: the speculative round loop (dspark.engine) over remote verifier and drafter
services, with continuous batching, KV admission control and the configured policy
(dspark.scheduling); serves the Scheduler API and, with a Redis URL, the gateways' bus."""
