"""A small OTLP trace receiver for tests: what a collector (Jaeger) receives, decoded.

    with OtlpReceiver() as receiver:       # OTLP/HTTP on receiver.http_endpoint, OTLP/gRPC on receiver.grpc_endpoint
        ...                                # processes export their spans to either endpoint
        spans = receiver.spans()           # ReceivedSpan per span, with its service.name

It speaks the real protocols with the opentelemetry-proto messages: OTLP/HTTP is
`POST /v1/traces` with an ExportTraceServiceRequest body (protobuf, gzip allowed), answered with
an ExportTraceServiceResponse; OTLP/gRPC is the TraceService/Export RPC.
"""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service_name: str  # the exporting process's resource attribute service.name
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 SERVER, 3 CLIENT, 5 CONSUMER, 1 INTERNAL
    transport: str  # "http" or "grpc": how it arrived


def _decode(request: trace_service_pb2.ExportTraceServiceRequest, transport: str) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(ReceivedSpan(service_name=attributes.get("service.name", ""), name=span.name,
                                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                                        parent_span_id=span.parent_span_id.hex(), kind=span.kind, transport=transport))
    return out


class OtlpReceiver:
    def __init__(self):
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(_decode(request, "http"))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):  # quiet
                pass

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the RPC's name
                receiver._add(_decode(request, "grpc"))
                return trace_service_pb2.ExportTraceServiceResponse()

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), self._grpc)
        self._grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._http.server_port}"

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._grpc_port}"

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> OtlpReceiver:
        self._http_thread.start()
        self._grpc.start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._grpc.stop(None)
