#!/usr/bin/env python3
"""A user's agent harness against the model being trained: the official ``openai`` client talks to the
rlbus gateway (``rlbus serve``), each episode is one RL session, and the harness's own check of the answers
closes the session with a reward. Needs only ``openai`` (any release from 1.x on); the reward call uses the
standard library, so it does not depend on the HTTP package ``openai`` happens to ship with.

The contract (docs/harness.md, "The contract"):

    base URL  http://HOST:PORT/v1                        the OpenAI client's base_url
    token     Authorization: Bearer <tenant token>       the OpenAI client's api_key; the gateway's tokens
                                                         come from `rlbus serve --token-file` or
                                                         $RLBUS_SERVE_TOKENS ("tenant:token,…")
    session   X-RL-Session: <id> on every turn           1-128 of [A-Za-z0-9_.:-], one choice per turn (n=1)
    reward    POST http://HOST:PORT/rl/sessions/<id>/reward   (the gateway's root, not /v1)
              Authorization: Bearer <the same token>, body {"reward": <number in [0, 1]>}
              → 202: the session is closed, its rollout and reward are on the bus

Run it (the token in the environment, not on the command line, where `ps` shows it):

    RLBUS_API_KEY=<token> python examples/harness_openai.py --base-url http://127.0.0.1:8000/v1 --sessions 4

One line per session: its id, how many answers were right, the reward sent, the HTTP status of the reward
call, and the answers. The exit status is 1 if any call failed (a wrong token, a gateway that is down …).

``--temperature 0`` samples greedily: the gateway records every log-prob as exactly 0.0 (the point mass on
the argmax), and a greedy session has no stochastic policy for the trainer to correct — train on sessions
sampled at a temperature above 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import urllib.error
import urllib.request
import uuid

import openai
from openai.types.chat import ChatCompletionMessageParam

SESSION_HEADER = "X-RL-Session"
SYSTEM = "You are a calculator. Answer with the number only."


def answer_of(text: str) -> int | None:
    """The number an answer ends with ("12", "3 + 9 = 12.", "The answer is 12"), or None."""
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def play(client: openai.OpenAI, *, model: str, session_id: str, problems: list[tuple[int, int]], task: str,
         max_tokens: int, temperature: float) -> tuple[list[str], int]:
    """One episode: the problems asked one turn at a time in one conversation (every earlier reply sent back
    as the gateway returned it, so it trains on the tokens it sampled). Returns (answers, how many right)."""
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
    answers, right = [], 0
    for a, b in problems:
        messages.append({"role": "user", "content": f"What is {a} + {b}?"})
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=temperature,
            metadata={"task": task},  # the session's task key: the trainer's baseline is kept per task
            extra_headers={SESSION_HEADER: session_id},
        )
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        answers.append(text)
        right += answer_of(text) == a + b
    return answers, right


def send_reward(root: str, api_key: str, session_id: str, reward: float, reason: str) -> tuple[int, str]:
    """Close the session with its reward (0 = bad … 1 = good): one rollout and one reward on the bus.
    Returns the HTTP status and body (an error status is returned, not raised)."""
    request = urllib.request.Request(
        f"{root}/rl/sessions/{session_id}/reward", method="POST",
        data=json.dumps({"reward": reward, "reason": reason}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:  # 4xx/5xx: the body is OpenAI's {"error": {...}}
        return exc.code, exc.read().decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("RLBUS_BASE_URL", "http://127.0.0.1:8000/v1"),
                        help="the gateway's OpenAI base URL, …/v1 (default $RLBUS_BASE_URL or %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("RLBUS_API_KEY"),
                        help="a tenant token of the gateway (default $RLBUS_API_KEY; prefer the variable)")
    parser.add_argument("--model", help="the model name (default: the one the gateway lists at /v1/models)")
    parser.add_argument("--sessions", type=int, default=4, help="episodes to play (default %(default)s)")
    parser.add_argument("--turns", type=int, default=2, help="problems per episode (default %(default)s)")
    parser.add_argument("--task", default="harness-arith", help="task key sent as metadata.task")
    parser.add_argument("--session-prefix", default=f"harness-{uuid.uuid4().hex[:8]}",
                        help="session ids are <prefix>-<n> (default: a fresh random prefix)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the problems")
    args = parser.parse_args(argv)
    if not args.api_key:
        parser.error("give the gateway's token: set RLBUS_API_KEY (or --api-key)")
    if args.sessions < 1 or args.turns < 1:
        parser.error("--sessions and --turns must be at least 1")

    root = args.base_url.rstrip("/").removesuffix("/v1")  # the reward route is on the gateway's root
    with openai.OpenAI(base_url=f"{root}/v1", api_key=args.api_key, max_retries=0, timeout=120) as client:
        try:
            model = args.model or client.models.list().data[0].id
        except openai.APIError as exc:  # a wrong token is a 401 here already
            print(f"cannot list the models at {root}/v1: {exc}", file=sys.stderr)
            return 1
        failed = sum(not episode(client, root, args, model, n) for n in range(args.sessions))
    print(f"{args.sessions - failed}/{args.sessions} sessions closed with a reward", file=sys.stderr)
    return 1 if failed else 0


def episode(client: openai.OpenAI, root: str, args: argparse.Namespace, model: str, n: int) -> bool:
    """Session ``n``: play it, reward it, print one line; False if a call failed."""
    session_id = f"{args.session_prefix}-{n}"
    rng = random.Random(f"{args.seed}-{n}")
    problems = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(args.turns)]
    try:
        answers, right = play(client, model=model, session_id=session_id, problems=problems, task=args.task,
                              max_tokens=args.max_tokens, temperature=args.temperature)
    except openai.APIError as exc:  # 401 wrong token, 429 too many sessions or too stale, a connection error …
        print(f"session={session_id} status={getattr(exc, 'status_code', '-')} error: {exc}", file=sys.stderr)
        return False
    reward = right / len(problems)
    try:
        status, body = send_reward(root, args.api_key, session_id, reward, f"{right}/{len(problems)} right")
    except (urllib.error.URLError, OSError) as exc:  # the gateway is down or unreachable
        print(f"session={session_id} reward call failed: {exc!r}", file=sys.stderr)
        return False
    print(f"session={session_id} right={right}/{len(problems)} reward={reward:.2f} status={status} "
          f"answers={[a[:40] for a in answers]}", flush=True)
    if status != 202:  # the body is OpenAI's {"error": {message, type, param, code}}
        print(f"session={session_id} reward refused: {body}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
