"""`dspark`: the one entry point.

    dspark generate "Write a haiku" --max-tokens 64 --temperature 0 --drafter ngram --json
    dspark profile --max-batch 64
    dspark serve --port 8000            # embedded OpenAI-compatible server on the default model
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dspark.drafters import DRAFTERS, drafter_capture_layers, make_drafter


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="default model name or a local HF Llama/Qwen directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype of the linear layers")
    p.add_argument("--kv-budget-mb", type=int, default=4096, help="memory for all requests' KV caches")


def _target_config(args):
    from dspark.model.target_runtime import TargetConfig

    # A drafter that reads target hidden states fixes which layers the runtime captures.
    capture = drafter_capture_layers(args.drafter, args.drafter_path) if hasattr(args, "drafter") else None
    return TargetConfig(model=args.model, dtype=args.dtype, kv_budget_mb=args.kv_budget_mb, capture_layers=capture)


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", choices=DRAFTERS, default="ngram")
    p.add_argument("--drafter-path", default=None, help="checkpoint directory of a trained drafter (dspark)")
    p.add_argument("--gamma", type=int, default=7, help="draft tokens per round (block size)")


def cmd_generate(args) -> int:
    import torch

    from dspark.engine.speculative import GenerationRequest, SpeculativeEngine
    from dspark.model.target_runtime import TargetRuntime
    from dspark.model.tokenizer import Tokenizer
    from dspark.sampling.params import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.seed is not None:
        torch.manual_seed(args.seed)
    try:
        target = _target_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runtime = TargetRuntime.load(target)
    tokenizer = Tokenizer(runtime.model_dir)
    prompt_ids = tokenizer.encode(args.prompt) if args.no_chat_template else tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    engine = SpeculativeEngine(runtime, make_drafter(args.drafter, runtime=runtime, path=args.drafter_path),
                               num_speculative_tokens=args.gamma)
    request = GenerationRequest("cli", prompt_ids, args.max_tokens, params, stop_token_ids=tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    try:
        (state,) = engine.generate([request])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    text = tokenizer.decode(state.output_ids)
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": state.output_ids,
            "prompt_tokens": len(prompt_ids),
            "finish_reason": state.finish_reason,
            "drafter": args.drafter,
            "rounds": state.rounds,
            "mean_accepted_length": state.mean_accepted_length,
            "draft_tokens": state.draft_tokens,
            "accepted_tokens": state.accepted_tokens,
            "elapsed_s": elapsed,
            "tokens_per_s": len(state.output_ids) / elapsed if elapsed > 0 else None,
        }))
    else:
        print(text)
        print(
            f"[{len(state.output_ids)} tokens in {elapsed:.2f}s, {len(state.output_ids) / elapsed:.1f} tok/s, "
            f"{state.rounds} rounds, mean accepted length {state.mean_accepted_length:.2f}]",
            file=sys.stderr,
        )
    return 0


def cmd_profile(args) -> int:
    from dspark.model.target_runtime import TargetRuntime
    from dspark.profiling.sps import profile_sps

    runtime = TargetRuntime.load(_target_config(args))
    prof = profile_sps(runtime, max_batch=args.max_batch, tokens_per_request=args.tokens_per_request,
                       context_len=args.context_len, repeats=args.repeats)
    if args.json:
        print(prof.to_json())
        return 0
    print(f"{'B':>5} {'ms/step':>9} {'SPS':>8} {'tokens/s':>9}")
    for b, t in zip(prof.batch_sizes, prof.step_seconds):
        print(f"{b:>5} {t * 1e3:>9.2f} {1 / t:>8.2f} {b / t:>9.1f}")
    return 0


def cmd_serve(args) -> int:
    from gateway.server import serve

    serve(host=args.host, port=args.port, target=_target_config(args), drafter=args.drafter, gamma=args.gamma,
          drafter_path=args.drafter_path,
          max_tokens_limit=args.max_tokens_limit, sps_max_batch=args.sps_max_batch)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding: serve, generate, profile")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt (chat template applied) and print it")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    _add_drafter_args(g)
    g.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and statistics")
    _add_target_args(g)
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("profile", help="measure SPS(B), verifier steps per second per batch size")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--tokens-per-request", type=int, default=8)
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    _add_target_args(p)
    p.set_defaults(func=cmd_profile)

    s = sub.add_parser("serve", help="embedded OpenAI-compatible server (one process, no external services)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    _add_drafter_args(s)
    s.add_argument("--max-tokens-limit", type=int, default=2048)
    s.add_argument("--sps-max-batch", type=int, default=64, help="profile SPS(B) at start-up up to this B (0: skip)")
    _add_target_args(s)
    s.set_defaults(func=cmd_serve)
    from dspark.data.cli import add_data_parser

    add_data_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
