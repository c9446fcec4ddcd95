"""`RemoteVerifier`: the Verifier contract (dspark/engine/verifier.py) over gRPC.

    verifier = RemoteVerifier("127.0.0.1:50053")                # waits for the server, reads GetInfo
    engine = SpeculativeEngine.from_parts(verifier=verifier, drafter=RemoteDrafter(...))

Construction waits (up to `connect_timeout_s`) for the server and reads what it serves (vocab,
context window, captured layers, KV budget); every later call has a deadline. Errors arrive as
the local contract has them: ValueError (INVALID_ARGUMENT), KVBudgetExceeded (RESOURCE_EXHAUSTED
from AddRequest: the engine queues the request), and services.grpc_common's DeadlineExceeded /
ServiceUnavailable / ServiceError (the engine recovers from those: dspark/engine/faults.py).
AddRequest of an id the verifier already holds replaces that state: the engine adds only ids it
does not run, so it is stale (a dead scheduler's). Every reply is validated before it is trusted
(a verifier of another vocabulary, a result that does not match the batch: ServiceError).
"""

from __future__ import annotations

import grpc
import numpy as np

from dspark.engine.verifier import Verifier, VerifyBatch, VerifyResult
from dspark.profiling.sps import SPSProfile
from dspark.protos import convert, validate
from dspark.protos.dspark.v1 import verifier_pb2, verifier_pb2_grpc
from dspark.sampling.params import SamplingParams
from services.grpc_common import ServiceError, call, check_health, check_reply, connect_client, translate_rpc_error
from services.grpc_tls import TlsCredentials
from services.wire_bytes import WireBytes

__all__ = ["RemoteVerifier"]

_NOT_FETCHED = object()


class RemoteVerifier(Verifier):
    in_process = False  # its calls can fail (PartFailure): the engine wraps it (dspark/engine/resilience.py)
    runtime = None  # the target runs in the verifier service

    def __init__(
        self,
        address: str,
        *,
        deadline_s: float = 10.0,  # control calls: add / remove / info / SPS profile
        verify_deadline_s: float = 300.0,  # one Verify round
        connect_timeout_s: float = 120.0,  # how long to wait for the server at construction
        max_message_mb: int = 512,
        auth_token: str = "",  # rpc.auth_token, sent on every call (services/grpc_auth.py)
        tls: TlsCredentials | None = None,  # mutual TLS (services/grpc_tls.py: load_tls(config.rpc)); None = plaintext
        wire_bytes: WireBytes | None = None,  # counts the serialized bytes of every call (benchmarks)
    ):
        self.address = address
        self.deadline_s = deadline_s
        self.verify_deadline_s = verify_deadline_s
        # waits up to connect_timeout_s for a service still loading its model
        self._channel, self._stub, info = connect_client(
            address, verifier_pb2_grpc.VerifierStub, verifier_pb2.GetVerifierInfoRequest(), service="verifier",
            connect_timeout_s=connect_timeout_s, max_message_mb=max_message_mb, auth_token=auth_token, tls=tls, wire_bytes=wire_bytes)
        self._check_reply(lambda: validate.verifier_info(info), "GetInfo")
        self.model: str = info.model
        self.vocab_size: int = info.vocab_size
        self.max_model_len: int = info.max_model_len
        self.capture_layers: tuple[int, ...] = tuple(info.capture_layers)
        self.hidden_size: int = info.hidden_size
        self.kv_budget_tokens: int = info.kv_budget_tokens
        self.sampler_backend: str = info.sampler_backend
        self._free_kv_tokens: int = info.free_kv_tokens
        self._sps_profile = _NOT_FETCHED

    def _where(self, rpc: str) -> str:
        return f"verifier at {self.address}: {rpc}"

    def _check_reply(self, check, rpc: str) -> None:
        check_reply(check, where=self._where(rpc))

    # ---- the Verifier contract -----------------------------------------------------------

    @property
    def free_kv_tokens(self) -> int:
        """As of the last AddRequest / RemoveRequest reply (no call of its own)."""
        return self._free_kv_tokens

    @property
    def sps_profile(self) -> SPSProfile | None:
        """The verifier's SPS(B) profile, fetched once; None if it was started without one."""
        if self._sps_profile is _NOT_FETCHED:
            try:
                msg = self._stub.GetSPSProfile(verifier_pb2.GetSPSProfileRequest(), timeout=self.deadline_s)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise translate_rpc_error(err, where=self._where("GetSPSProfile"), timeout=self.deadline_s) from None
                self._sps_profile = None
            else:
                self._check_reply(lambda: validate.sps_profile(msg), "GetSPSProfile")
                self._sps_profile = convert.sps_profile_from_proto(msg)
        return self._sps_profile

    @sps_profile.setter
    def sps_profile(self, profile: SPSProfile | None) -> None:
        self._sps_profile = profile  # a caller's own profile replaces the server's

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, num_kv_tokens: int) -> None:
        msg = verifier_pb2.VerifierAddRequest(request_id=request_id, prompt_ids=prompt_ids,
                                              params=convert.sampling_params_to_proto(params), num_kv_tokens=num_kv_tokens)
        where = self._where("AddRequest")
        try:
            reply = self._stub.AddRequest(msg, timeout=self.deadline_s)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise translate_rpc_error(err, where=where, timeout=self.deadline_s) from None
            # The engine adds only ids it does not run: what the verifier holds under this one is stale
            # (left by a scheduler that died, or by a round lost to a deadline). Replace it.
            self.remove_request([request_id])
            reply = call(self._stub.AddRequest, msg, timeout=self.deadline_s, where=where)
        self._free_kv_tokens = reply.free_kv_tokens

    def remove_request(self, request_ids: list[str]) -> int:
        if not request_ids:
            return 0
        reply = call(self._stub.RemoveRequest, verifier_pb2.VerifierRemoveRequest(request_ids=request_ids),
                     timeout=self.deadline_s, where=self._where("RemoveRequest"))
        self._free_kv_tokens = reply.free_kv_tokens
        return reply.num_removed

    def verify(self, batch: VerifyBatch) -> VerifyResult:
        msg = convert.verify_batch_to_proto(batch)
        reply = call(self._stub.Verify, msg, timeout=self.verify_deadline_s, where=self._where("Verify"))
        self._check_reply(lambda: validate.verify_result(reply, vocab_size=self.vocab_size), "Verify")
        self._check_matches(batch, reply)
        return convert.verify_result_from_proto(reply)

    def _check_matches(self, batch: VerifyBatch, reply: verifier_pb2.VerifyResult) -> None:
        """The reply answers this very batch: same round and requests, a_r <= l_r, features when asked."""
        where = self._where("Verify")
        if reply.round_id != batch.round_id or list(reply.request_ids) != list(batch.request_ids):
            raise ServiceError(f"{where}: the reply is for round {reply.round_id} {list(reply.request_ids)[:4]}, "
                               f"expected round {batch.round_id} {batch.request_ids[:4]}")
        accepted = np.asarray(reply.num_accepted, dtype=np.int64)  # [num_requests]
        drafts = batch.num_draft_tokens.numpy()  # [num_requests]
        if (accepted > drafts).any():
            r = int(np.flatnonzero(accepted > drafts)[0])
            raise ServiceError(f"{where}: request {batch.request_ids[r]!r} has {accepted[r]} accepted of {drafts[r]} drafts")
        if batch.capture_hidden_states and not reply.HasField("hidden_states"):
            raise ServiceError(f"{where}: hidden states were asked for and not returned")

    def is_serving(self, timeout: float = 1.0) -> bool:
        """The service answers its health check with SERVING."""
        return check_health(self._channel, timeout=timeout)

    def close(self) -> None:
        self._channel.close()
