"""Thin service shells (gRPC servicers) around the `dspark` library; see each sub-package."""
