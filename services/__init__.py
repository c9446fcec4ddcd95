"""The serving system's gRPC services: thin shells around the `dspark` library.

    verifier/   server.py: VerifierServicer over a LocalVerifier (target, KV caches, rejection
                sampler, SPS(B)); client.py: RemoteVerifier, the Verifier contract over gRPC
    drafter/    server.py: DrafterServicer over any drafter of make_drafter; client.py: RemoteDrafter
    scheduler/  server.py: the Scheduler API (Submit / Cancel / Stats) and the bus worker over
                AsyncEngine(SpeculativeEngine(RemoteVerifier, RemoteDrafter)): build_remote_engine
    grpc_common.py   servers with health + reflection, status codes, client deadlines and errors
    cli.py           `dspark verifier | drafter | scheduler | up`

Configuration: dspark/serving_config.py. Contracts: protos/ (dspark.v1).
"""
