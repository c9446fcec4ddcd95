"""`RemoteDrafter`: the Drafter contract (dspark/drafters/base.py) over gRPC.

    drafter = RemoteDrafter("127.0.0.1:50052")         # waits for the server, reads GetInfo
    engine = SpeculativeEngine.from_parts(verifier=RemoteVerifier(...), drafter=drafter)

Its spec is what the service's GetInfo declares; each lifecycle method of the contract is one
RPC: `add_request` registers a request with the service (its prompt and sampling settings: the
service seeds the request's draft stream from them; an id it already holds is replaced, so the
engine can register a request again after a failure, from its tokens so far), `observe_many` forwards the verifier's
hidden states of a round in one AppendFeatures call, `remove_requests` frees many at once. A
round sends each request's tokens emitted since the previous round only (token_offset) and reads
the streamed DraftBlocks, each validated (ids in range, rows summing to 1, at most
max_draft_tokens) before the engine sees it; every call has a deadline. `DraftRequest.generator`
is not sent: the request's draft stream lives on the service.
"""

from __future__ import annotations

import grpc
import torch

from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest
from dspark.protos import convert, validate
from dspark.protos.dspark.v1 import drafter_pb2, drafter_pb2_grpc
from dspark.sampling.params import SamplingParams
from services.grpc_common import ServiceError, call, check_health, check_reply, connect_client, translate_rpc_error
from services.grpc_tls import TlsCredentials
from services.wire_bytes import WireBytes

__all__ = ["RemoteDrafter"]


class RemoteDrafter(Drafter):
    in_process = False  # its calls can fail (PartFailure): the engine wraps it (dspark/engine/resilience.py)

    def __init__(
        self,
        address: str,
        *,
        deadline_s: float = 10.0,  # control calls: add / remove / features / info
        draft_deadline_s: float = 60.0,  # one Draft round, the whole stream
        connect_timeout_s: float = 120.0,  # how long to wait for the server at construction
        max_message_mb: int = 512,
        auth_token: str = "",  # rpc.auth_token, sent on every call (services/grpc_auth.py)
        tls: TlsCredentials | None = None,  # mutual TLS (services/grpc_tls.py: load_tls(config.rpc)); None = plaintext
        wire_bytes: WireBytes | None = None,  # counts the serialized bytes of every call (benchmarks)
    ):
        self.address = address
        self.deadline_s = deadline_s
        self.draft_deadline_s = draft_deadline_s
        # waits up to connect_timeout_s for a service still loading its model
        self._channel, self._stub, info = connect_client(
            address, drafter_pb2_grpc.DrafterStub, drafter_pb2.GetDrafterInfoRequest(), service="drafter",
            connect_timeout_s=connect_timeout_s, max_message_mb=max_message_mb, auth_token=auth_token, tls=tls, wire_bytes=wire_bytes)
        self._check_reply(lambda: validate.drafter_info(info), "GetInfo")
        # the service's spec as declared: 0 on the wire is None ("no bound of its own", "the
        # target's whole vocabulary")
        self.spec = DrafterSpec(name=info.name, needs_hidden_states=info.needs_hidden_states,
                                capture_layers=tuple(info.capture_layers) if info.needs_hidden_states else (),
                                provides_confidences=info.provides_confidences,
                                free_proposals=info.free_proposals,  # it proposes lookups on rounds the draft gate skips
                                block_size=info.block_size or None, draft_vocab_size=info.draft_vocab_size or None)
        self.vocab_size: int = info.vocab_size
        self.hidden_size: int = info.hidden_size
        self._known_tokens: dict[str, int] = {}  # request -> tokens the service holds (it keeps the sequence)
        self._round = 0

    def _where(self, rpc: str) -> str:
        return f"drafter at {self.address}: {rpc}"

    def _check_reply(self, check, rpc: str) -> None:
        check_reply(check, where=self._where(rpc))

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        msg = drafter_pb2.DrafterAddRequest(request_id=request_id, prompt_ids=token_ids, params=convert.sampling_params_to_proto(params))
        where = self._where("AddRequest")
        try:
            self._stub.AddRequest(msg, timeout=self.deadline_s)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise translate_rpc_error(err, where=where, timeout=self.deadline_s) from None
            # What the drafter holds under this id is stale (a dead scheduler's, or ours before a
            # failure: the engine registers a request again from its tokens so far). Replace it.
            self.remove_requests([request_id])
            call(self._stub.AddRequest, msg, timeout=self.deadline_s, where=where)
        self._known_tokens[request_id] = len(token_ids)

    def remove_request(self, request_id: str) -> None:
        self.remove_requests([request_id])

    def remove_requests(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        for rid in request_ids:
            self._known_tokens.pop(rid, None)
        call(self._stub.RemoveRequest, drafter_pb2.DrafterRemoveRequest(request_ids=request_ids), timeout=self.deadline_s,
             where=self._where("RemoveRequest"))

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        self.observe_many({request_id: features})

    def observe_many(self, features: dict[str, torch.Tensor]) -> None:
        """Hand over each request's hidden states of newly verified positions ([n_new, m, hidden])."""
        if features:
            call(self._stub.AppendFeatures, convert.append_features_to_proto(features), timeout=self.deadline_s,
                 where=self._where("AppendFeatures"))

    # ---- one round -----------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        if not requests:
            return []
        self._round += 1
        msgs = []
        for r in requests:
            known = self._known_tokens.get(r.request_id, 0)
            msgs.append(convert.draft_request_to_proto(r, token_offset=min(known, len(r.token_ids) - 1)))  # keep the anchor
        round_msg = drafter_pb2.DraftRoundRequest(round_id=self._round, requests=msgs)
        wanted = {r.request_id: r for r in requests}
        proposals: dict[str, DraftProposal] = {}
        where = self._where("Draft")
        try:
            for block in self._stub.Draft(round_msg, timeout=self.draft_deadline_s):
                req = wanted.get(block.request_id)
                if req is None or block.request_id in proposals or block.round_id != self._round:
                    raise ServiceError(f"{where}: unexpected block for request {block.request_id!r} of round {block.round_id} "
                                       f"(round {self._round}, requests {list(wanted)[:4]}, already got {len(proposals)})")
                self._check_reply(
                    lambda b=block, r=req: validate.draft_block(b, vocab_size=self.vocab_size, max_draft_tokens=r.max_draft_tokens),
                    "Draft")
                proposals[block.request_id] = convert.draft_proposal_from_proto(block.proposal)
        except grpc.RpcError as err:
            raise translate_rpc_error(err, where=where, timeout=self.draft_deadline_s) from None
        missing = [rid for rid in wanted if rid not in proposals]
        if missing:
            raise ServiceError(f"{where}: the stream ended without blocks for {missing[:4]}")
        for r in requests:
            self._known_tokens[r.request_id] = len(r.token_ids)
        return [proposals[r.request_id] for r in requests]

    def is_serving(self, timeout: float = 1.0) -> bool:
        """The service answers its health check with SERVING."""
        return check_health(self._channel, timeout=timeout)

    def close(self) -> None:
        self._channel.close()
