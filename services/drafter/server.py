"""The drafter service: any drafter of `dspark.drafters.make_drafter`, over gRPC.

    dspark drafter --config serving.toml        # DSPARK_DRAFTER_NAME=dspark DSPARK_DRAFTER_PATH=DIR dspark drafter

Per request it keeps what the drafter needs between rounds: the token sequence (so that a round
carries only the tokens emitted since the last one: `DraftRequest.token_offset`), the request's
own draft random stream (seeded at AddRequest from `draft_stream_seed(params.seed)`: never the
verifier's rejection stream), and, inside a stateful drafter (DSpark), the context features
the scheduler forwards from the verifier with AppendFeatures. A Draft call drafts all its
requests in one batched `propose` and streams one DraftBlock per request; rows go over the wire
as the drafter made them (sparse when it truncates to top-k, dense otherwise).

Every incoming message is validated first (INVALID_ARGUMENT with "field: message"); a request
the drafter does not hold, or a round whose anchor lacks the features of the positions before it,
is FAILED_PRECONDITION. The calls run one at a time on one compute thread (so that the drafter's
OpenMP pool stays one pool: dspark/model/compute_thread.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import torch

from dspark.drafters.base import Drafter, NoDrafter, checked_spec
from dspark.engine.speculative import draft_stream_seed
from dspark.model.compute_thread import ComputeThread, release_openmp_workers
from dspark.protos import DRAFTER_SERVICE, convert, validate
from dspark.protos.dspark.v1 import drafter_pb2, drafter_pb2_grpc
from dspark.serving_config import ServingConfig
from services.grpc_common import GrpcServer, RpcAbort, create_server, rpc_errors, serve_until_signalled
from services.grpc_tls import TlsCredentials, load_tls

__all__ = ["DrafterServicer", "build_drafter", "serve_drafter", "start_drafter_server"]

log = logging.getLogger(__name__)


@dataclass
class _DraftState:
    token_ids: list[int]  # prompt + generated, as of the last round (the scheduler sends only what is new)
    generator: torch.Generator  # the request's draft stream


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, drafter: Drafter | None, *, vocab_size: int, hidden_size: int = 0):
        self.drafter: Drafter = drafter if drafter is not None else NoDrafter()
        self.spec = checked_spec(self.drafter)  # TypeError for anything but a Drafter declaring a DrafterSpec
        self.vocab_size = vocab_size
        self.needs_hidden = self.spec.needs_hidden_states
        self.capture_layers = self.spec.capture_layers
        self.hidden_size = hidden_size if self.needs_hidden else 0
        if self.needs_hidden and hidden_size < 1:
            raise ValueError(f"drafter {self.spec.name!r} reads hidden states: pass the target's hidden_size")
        self._states: dict[str, _DraftState] = {}
        # Drafters are single-threaded, and one thread keeps the OpenMP pool one pool
        # (dspark/model/compute_thread.py): every handler hands its call to this thread.
        self._compute = ComputeThread("dspark-drafter-compute")
        self._seed_source = torch.Generator().manual_seed(int(time.time_ns() % 2**63))

    def _state(self, request_id: str, rpc: str) -> _DraftState:
        state = self._states.get(request_id)
        if state is None:
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{rpc}: request {request_id!r} is not registered with this drafter (AddRequest first)")
        return state

    def AddRequest(self, request: drafter_pb2.DrafterAddRequest, context) -> drafter_pb2.DrafterAddResponse:
        with rpc_errors(context, "Drafter.AddRequest"):
            validate.drafter_add_request(request, vocab_size=self.vocab_size)
            seed = request.params.seed if request.params.HasField("seed") else None
            self._compute.run(self._add_request, request, seed)
            return drafter_pb2.DrafterAddResponse()

    def _add_request(self, request: drafter_pb2.DrafterAddRequest, seed: int | None) -> None:
        if request.request_id in self._states:
            raise RpcAbort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id!r} is already registered")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        self._states[request.request_id] = _DraftState(
            token_ids=list(request.prompt_ids), generator=torch.Generator().manual_seed(draft_stream_seed(seed))
        )
        self.drafter.add_request(request.request_id, list(request.prompt_ids), convert.sampling_params_from_proto(request.params))

    def AppendFeatures(self, request: drafter_pb2.AppendFeaturesRequest, context) -> drafter_pb2.AppendFeaturesResponse:
        with rpc_errors(context, "Drafter.AppendFeatures"):
            if not self.needs_hidden:
                raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION, f"drafter {self.spec.name!r} reads no hidden states")
            validate.append_features(request, num_capture_layers=len(self.capture_layers), hidden_size=self.hidden_size)
            self._compute.run(self._append_features, request)
            return drafter_pb2.AppendFeaturesResponse()

    def _append_features(self, request: drafter_pb2.AppendFeaturesRequest) -> None:
        features = convert.append_features_from_proto(request)  # request id -> [n_new, m, hidden]
        for rid in features:
            self._state(rid, "AppendFeatures")
        self.drafter.observe_many(features)

    def RemoveRequest(self, request: drafter_pb2.DrafterRemoveRequest, context) -> drafter_pb2.DrafterRemoveResponse:
        with rpc_errors(context, "Drafter.RemoveRequest"):
            validate.remove_request(request)
            return drafter_pb2.DrafterRemoveResponse(num_removed=self._compute.run(self._remove_requests, list(request.request_ids)))

    def _remove_requests(self, request_ids: list[str]) -> int:
        removed = sum(self._states.pop(rid, None) is not None for rid in request_ids)
        self.drafter.remove_requests(request_ids)
        return removed

    def Draft(self, request: drafter_pb2.DraftRoundRequest, context):
        with rpc_errors(context, "Drafter.Draft"):
            validate.draft_round_request(request, vocab_size=self.vocab_size)
            blocks = self._compute.run(self._draft, request)
        yield from blocks

    def _draft(self, request: drafter_pb2.DraftRoundRequest) -> list[drafter_pb2.DraftBlock]:
        reqs = []
        for msg in request.requests:
            state = self._state(msg.request_id, "Draft")
            req = convert.draft_request_from_proto(msg, known_token_ids=state.token_ids, generator=state.generator)
            self._check_features(req.request_id, len(req.token_ids))
            state.token_ids = req.token_ids
            reqs.append(req)
        proposals = self.drafter.propose(reqs) if reqs else []
        if len(proposals) != len(reqs):
            raise RuntimeError(f"drafter {self.spec.name!r} returned {len(proposals)} proposals for {len(reqs)} requests")
        blocks = []
        for req, p in zip(reqs, proposals):
            if len(p) > req.max_draft_tokens:
                raise RuntimeError(f"drafter {self.spec.name!r} proposed {len(p)} > {req.max_draft_tokens} tokens")
            blocks.append(convert.draft_block_to_proto(request.round_id, req.request_id, p))
        return blocks

    def GetInfo(self, request: drafter_pb2.GetDrafterInfoRequest, context) -> drafter_pb2.DrafterInfo:
        with rpc_errors(context, "Drafter.GetInfo"):
            return drafter_pb2.DrafterInfo(
                name=self.spec.name, needs_hidden_states=self.needs_hidden, capture_layers=list(self.capture_layers),
                provides_confidences=self.spec.provides_confidences, vocab_size=self.vocab_size,
                hidden_size=self.hidden_size, free_proposals=self.spec.free_proposals,
                block_size=self.spec.block_size or 0, draft_vocab_size=self.spec.draft_vocab_size or 0,
            )

    def _check_features(self, request_id: str, num_tokens: int) -> None:
        """A stateful drafter must hold the features of every position before the anchor."""
        if not self.needs_hidden:
            return
        held = self.drafter.context_len(request_id)
        if held != num_tokens - 1:
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION,
                           f"Draft: request {request_id!r}: the drafter holds features of {held} positions, "
                           f"the anchor sits at position {num_tokens - 1}; AppendFeatures every verified position first")


def start_drafter_server(
    drafter: Drafter | None, *, vocab_size: int, hidden_size: int = 0, bind: str = "127.0.0.1:0", max_message_mb: int = 512,
    auth_token: str = "", tls: TlsCredentials | None = None,
) -> GrpcServer:
    """Serve `drafter` on `bind` (port 0: a free port, see `.port`), health SERVING, reflection on;
    every call but health needs `auth_token` when one is given, every connection a client
    certificate under `tls` (services/grpc_tls.py)."""
    servicer = DrafterServicer(drafter, vocab_size=vocab_size, hidden_size=hidden_size)
    return create_server(lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s), (DRAFTER_SERVICE,),
                         bind=bind, max_message_mb=max_message_mb, auth_token=auth_token, tls=tls)


def build_drafter(config: ServingConfig) -> tuple[Drafter | None, int, int]:
    """The configured drafter, the model's vocab size and hidden size. A drafter that shares the
    target's embedding and LM head (the trained ones) loads the target weights; the others only
    read the model's config."""
    from dspark.drafters import drafter_capture_layers, make_drafter
    from dspark.model.config import ModelConfig
    from dspark.model.model_store import resolve_model_dir

    m, d = config.model, config.drafter
    model_config = ModelConfig.from_dir(resolve_model_dir(m.name))
    capture = drafter_capture_layers(d.name, d.path or None)  # also checks the checkpoint path early
    runtime = None
    if capture is not None:
        from dspark.model.target_runtime import TargetConfig, TargetRuntime

        runtime = TargetRuntime.load(TargetConfig.of(m, capture_layers=capture, kv_budget_mb=1))
    drafter = make_drafter(d.name, runtime=runtime, path=d.path or None, top_k=d.top_k)
    release_openmp_workers()  # this thread is done with torch: the servicer's compute thread drafts now
    return drafter, model_config.vocab_size, model_config.hidden_size


def serve_drafter(config: ServingConfig) -> None:
    """`dspark drafter`: build the drafter, serve until SIGTERM / Ctrl-C."""
    tls = load_tls(config.rpc)  # a bad TLS file fails now, not after building the drafter
    drafter, vocab_size, hidden_size = build_drafter(config)
    server = start_drafter_server(drafter, vocab_size=vocab_size, hidden_size=hidden_size, bind=config.drafter.bind,
                                  max_message_mb=config.rpc.max_message_mb, auth_token=config.rpc.auth_token, tls=tls)
    log.info("drafter %s serving on %s:%d", config.drafter.name, config.drafter.host, server.port)
    serve_until_signalled(server)
