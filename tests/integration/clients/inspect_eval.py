"""inspect-ai's OpenAI provider (``openai/<model>``, its defaults: the Responses API) against the gateway: a
two-sample task, each sample one session (its solver sends the session header), scored by inspect."""

from __future__ import annotations

import os
import tempfile

from common import API_KEY, BASE_URL, MODEL, PREFIX, close, report
from inspect_ai import Task, eval, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import Generate, TaskState, solver


def session_of(state: TaskState) -> str:
    return f"{PREFIX}-inspect-{state.sample_id}-{state.epoch}"


@solver
def generate_in_session():  # type: ignore[no-untyped-def]
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        return await generate(state, extra_headers={"X-RL-Session": session_of(state)})

    return solve


@task
def capitals() -> Task:
    return Task(dataset=[Sample(id="fr", input="What is the capital of France?", target="Paris"),
                         Sample(id="it", input="What is the capital of Italy?", target="Rome")],
                solver=generate_in_session(), scorer=includes())


def main() -> None:
    os.environ["OPENAI_API_KEY"] = API_KEY
    os.environ["OPENAI_BASE_URL"] = BASE_URL
    with tempfile.TemporaryDirectory() as logs:  # the log reads its samples from here: use it inside
        [log] = eval(capitals(), model=f"openai/{MODEL}", log_dir=logs, display="none", max_tokens=12,
                     temperature=0, max_retries=0)
        samples = list(log.samples or [])
        errors = [str(s.error) for s in samples if s.error is not None]
        ids = [f"{PREFIX}-inspect-{s.id}-{s.epoch}" for s in samples]
        report(client="inspect-ai", status=log.status, errors=errors, error=str(log.error) if log.error else None,
               sessions=[{"id": i, "receipt": close(i, 1.0)} for i in ids],
               outputs=[s.output.completion for s in samples])


main()
