"""The verifier service: the target model, each request's KV cache and the rejection sampler, over gRPC.

    dspark verifier --config serving.toml          # or: DSPARK_VERIFIER_PORT=50053 dspark verifier

Start-up: load the target (capturing the layers the configured drafter reads), warm up, measure
SPS(B) (`verifier.sps_max_batch`; the prefix scheduler's input, served by GetSPSProfile), then
listen and report SERVING on grpc.health.v1. The servicer is a thin shell around a LocalVerifier
(dspark/engine/verifier.py): every incoming message is validated first (INVALID_ARGUMENT with
"field: message"), a request that does not fit the KV budget now gets RESOURCE_EXHAUSTED (the
scheduler queues it), an id it already holds ALREADY_EXISTS and a round naming a request it does
not hold FAILED_PRECONDITION (both are what a restart of the scheduler or of this service leaves;
the scheduler recovers, dspark/engine/faults.py), and the calls run one at a time on one compute
thread (one forward at a time: the model uses every core anyway; one thread, so that the
target's OpenMP pool stays one pool: dspark/model/compute_thread.py).
"""

from __future__ import annotations

import logging
import time

import grpc
import torch

from dspark.engine.verifier import LocalVerifier, VerifyBatch, resolve_sampler_backend
from dspark.model.compute_thread import ComputeThread, release_openmp_workers
from dspark.protos import VERIFIER_SERVICE, convert, validate
from dspark.protos.dspark.v1 import verifier_pb2, verifier_pb2_grpc
from dspark.sampling import DraftProbs
from dspark.sampling.params import SamplingParams
from dspark.serving_config import ServingConfig
from services.grpc_common import GrpcServer, RpcAbort, create_server, rpc_errors, serve_until_signalled
from services.grpc_tls import TlsCredentials, load_tls

__all__ = ["VerifierServicer", "build_local_verifier", "serve_verifier", "start_verifier_server", "warm_up"]

log = logging.getLogger(__name__)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, verifier: LocalVerifier, *, model: str = ""):
        self.verifier = verifier
        self.model = model
        # LocalVerifier is single-threaded, and one thread keeps the target's OpenMP pool one
        # pool (dspark/model/compute_thread.py): every handler hands its call to this thread.
        self._compute = ComputeThread("dspark-verifier-compute")

    def AddRequest(self, request: verifier_pb2.VerifierAddRequest, context) -> verifier_pb2.VerifierAddResponse:
        with rpc_errors(context, "Verifier.AddRequest"):
            validate.verifier_add_request(request, vocab_size=self.verifier.vocab_size, max_model_len=self.verifier.max_model_len)
            params = convert.sampling_params_from_proto(request.params)
            return self._compute.run(self._add_request, request, params)

    def _add_request(self, request: verifier_pb2.VerifierAddRequest, params: SamplingParams) -> verifier_pb2.VerifierAddResponse:
        if self.verifier.has_request(request.request_id):  # the client decides: stale state of a dead scheduler?
            raise RpcAbort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id!r} is already registered")
        self.verifier.add_request(request.request_id, list(request.prompt_ids), params, request.num_kv_tokens)
        return verifier_pb2.VerifierAddResponse(free_kv_tokens=self.verifier.free_kv_tokens)

    def RemoveRequest(self, request: verifier_pb2.VerifierRemoveRequest, context) -> verifier_pb2.VerifierRemoveResponse:
        with rpc_errors(context, "Verifier.RemoveRequest"):
            validate.remove_request(request)
            return self._compute.run(self._remove_request, list(request.request_ids))

    def _remove_request(self, request_ids: list[str]) -> verifier_pb2.VerifierRemoveResponse:
        removed = self.verifier.remove_request(request_ids)
        return verifier_pb2.VerifierRemoveResponse(num_removed=removed, free_kv_tokens=self.verifier.free_kv_tokens)

    def Verify(self, request: verifier_pb2.VerifyBatch, context) -> verifier_pb2.VerifyResult:
        with rpc_errors(context, "Verifier.Verify"):
            validate.verify_batch(request, vocab_size=self.verifier.vocab_size)
            return self._compute.run(self._verify, request)

    def _verify(self, request: verifier_pb2.VerifyBatch) -> verifier_pb2.VerifyResult:
        batch = convert.verify_batch_from_proto(request)  # tensors are built and read on the compute thread too
        unknown = [rid for rid in batch.request_ids if not self.verifier.has_request(rid)]
        if unknown:  # e.g. this verifier restarted: the scheduler rebuilds them (dspark/engine/faults.py)
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION,
                           f"requests {unknown[:5]} are not registered with this verifier (AddRequest first)")
        return convert.verify_result_to_proto(self.verifier.verify(batch))

    def GetSPSProfile(self, request: verifier_pb2.GetSPSProfileRequest, context) -> verifier_pb2.SPSProfile:
        with rpc_errors(context, "Verifier.GetSPSProfile"):
            profile = self.verifier.sps_profile
            if profile is None:
                raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION,
                               "this verifier was started without an SPS(B) profile (verifier.sps_max_batch = 0)")
            return convert.sps_profile_to_proto(profile)

    def GetInfo(self, request: verifier_pb2.GetVerifierInfoRequest, context) -> verifier_pb2.VerifierInfo:
        with rpc_errors(context, "Verifier.GetInfo"):
            v = self.verifier
            return verifier_pb2.VerifierInfo(
                model=self.model, vocab_size=v.vocab_size, max_model_len=v.max_model_len, capture_layers=list(v.capture_layers),
                hidden_size=v.hidden_size, kv_budget_tokens=v.kv_budget_tokens, free_kv_tokens=v.free_kv_tokens,
                sampler_backend=v.sampler_backend,
            )


def start_verifier_server(
    verifier: LocalVerifier, *, bind: str = "127.0.0.1:0", model: str = "", max_message_mb: int = 512, auth_token: str = "",
    tls: TlsCredentials | None = None,
) -> GrpcServer:
    """Serve `verifier` on `bind` (port 0: a free port, see `.port`), health SERVING, reflection on;
    every call but health needs `auth_token` when one is given, every connection a client
    certificate under `tls` (services/grpc_tls.py)."""
    servicer = VerifierServicer(verifier, model=model)
    return create_server(lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s), (VERIFIER_SERVICE,),
                         bind=bind, max_message_mb=max_message_mb, auth_token=auth_token, tls=tls)


def warm_up(verifier: LocalVerifier) -> float:
    """A prefill round and a decode round with one draft on a throwaway request (first-call
    costs paid before the first client); returns its seconds."""
    t0 = time.perf_counter()
    rid = "__verifier_warm_up"
    verifier.add_request(rid, [0, 1, 2, 3], SamplingParams(temperature=0.0), 8)
    try:
        first = VerifyBatch(0, [rid], torch.tensor([-1]), torch.tensor([0]), torch.empty(0, dtype=torch.long), None)
        anchor = int(verifier.verify(first).result.output_token_ids[0, 0])
        draft = torch.tensor([0])
        rows = DraftProbs(sparse_ids=torch.tensor([[0]]), sparse_probs=torch.tensor([[1.0]]))
        verifier.verify(VerifyBatch(1, [rid], torch.tensor([anchor]), torch.tensor([1]), draft, rows))
    finally:
        verifier.remove_request([rid])
    return time.perf_counter() - t0


def build_local_verifier(config: ServingConfig) -> LocalVerifier:
    """Load the target for `config`, warm it up and (unless sps_max_batch = 0) profile SPS(B)."""
    from dspark.drafters import drafter_capture_layers
    from dspark.model.target_runtime import TargetConfig, TargetRuntime, resolve_device
    from dspark.profiling.sps import profile_sps

    m, d, v = config.model, config.drafter, config.verifier
    resolve_sampler_backend(v.sampler_backend, resolve_device(m.device))  # refuse triton off CUDA before loading the target
    capture = drafter_capture_layers(d.name, d.path or None)  # the layers the drafter reads, if any
    runtime = TargetRuntime.load(TargetConfig.of(m, capture_layers=capture))
    verifier = LocalVerifier(runtime, sampler_backend=v.sampler_backend)
    log.info("warm-up took %.2f s", warm_up(verifier))
    if v.sps_max_batch > 0:
        t0 = time.perf_counter()
        verifier.sps_profile = profile_sps(runtime, max_batch=v.sps_max_batch, tokens_per_request=v.sps_tokens_per_request)
        log.info("SPS(B) profiled in %.1f s up to B = %d", time.perf_counter() - t0, v.sps_max_batch)
    release_openmp_workers()  # this thread is done with torch: the servicer's compute thread runs the target now
    return verifier


def serve_verifier(config: ServingConfig) -> None:
    """`dspark verifier`: load, profile, serve until SIGTERM / Ctrl-C."""
    tls = load_tls(config.rpc)  # a bad TLS file fails now, not after loading the model
    verifier = build_local_verifier(config)
    server = start_verifier_server(verifier, bind=config.verifier.bind, model=config.model.name,
                                   max_message_mb=config.rpc.max_message_mb, auth_token=config.rpc.auth_token, tls=tls)
    log.info("verifier serving %s on %s:%d (vocab %d, context %d, KV budget %d tokens, captures layers %s)",
             config.model.name, config.verifier.host, server.port, verifier.vocab_size, verifier.max_model_len,
             verifier.kv_budget_tokens, list(verifier.capture_layers))
    serve_until_signalled(server)
