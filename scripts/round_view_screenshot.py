"""Take the README's screenshot of the round view during a busy run: docs/results/round_view.png.

    .venv/bin/python scripts/round_view_screenshot.py [--out docs/results/round_view.png] [--users 4]

Serves the default model as `dspark serve` does (the shipped drafter with lookups, the `dspark`
policy on the SPS(B) profile measured at start-up), opens /ui in headless Chromium (Debian's
/usr/bin/chromium, driven by Playwright), sends a prompt from the page's box while `--users`
other greedy requests decode, and takes the picture once the page has shown a few rounds that
Algorithm 1 scheduled. Minutes on a 2-core CPU (loading, warm-up and the SPS profile first).
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from pathlib import Path

import httpx

PROMPTS = [  # long answers: the run stays busy while the page watches
    "Write a Python function that reverses a string, then explain it line by line.",
    "Count from one to forty in words, separated by commas.",
    "List twenty fruits, one per line, each with its colour.",
    "Write a long story about a robot who learns to paint.",
    "Explain in detail how a CPU cache works, with examples.",
    "Describe the planets of the solar system, one paragraph each.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/round_view.png")
    parser.add_argument("--users", type=int, default=5, help="other requests decoding beside the page's")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for a busy round with a break")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()

    import uvicorn
    from playwright.sync_api import sync_playwright

    from dspark.model.target_runtime import TargetConfig
    from dspark.serving_config import ServingConfig
    from gateway.connection_limits import uvicorn_config
    from gateway.server import build_engine, embedded_gateway, served_model_name

    defaults = ServingConfig()
    target = TargetConfig(model=defaults.model.name)
    engine, tokenizer = build_engine(target, drafter=defaults.drafter.name, gamma=defaults.scheduler.gamma,
                                     policy=defaults.scheduler.policy, sps_max_batch=defaults.verifier.sps_max_batch)
    model = served_model_name(target.model)
    gateway = embedded_gateway(engine, tokenizer, model_name=model)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn_config(gateway.app, limits=defaults.gateway, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def user(i: int) -> None:
        httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": args.max_tokens, "temperature": 0})

    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1500, "height": 1360}, device_scale_factor=1)
            page.goto(f"{url}/ui")
            page.wait_for_function("document.getElementById('sources').textContent.length > 0", timeout=60_000)
            users = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(args.users)]
            for t in users:
                t.start()
            page.fill("#prompt", "Write a haiku about CPUs")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", str(args.max_tokens))
            page.click("#send")
            # busy: most requests still decoding, and the SPS panel showing a round whose break fired
            try:
                page.wait_for_function(
                    f"document.querySelectorAll('.card').length >= {args.users + 1} && "
                    f"document.querySelectorAll('.card:not(.finished)').length >= {max(2, args.users - 1)} && "
                    "document.querySelectorAll('#rounds tbody tr').length >= 15 && "
                    "document.getElementById('sps-caption').textContent.includes('break fired')",
                    timeout=args.wait_s * 1000, polling=100)
            except Exception:  # noqa: BLE001 - no break while busy: take the picture anyway
                print(f"no break fired while busy within {args.wait_s} s; taking the picture as it is")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=False)
            print(f"wrote {args.out}")
            browser.close()
        for t in users:
            t.join(600)
    finally:
        server.should_exit = True
        thread.join(30)
        gateway.close()
        engine.shutdown()


if __name__ == "__main__":
    main()
