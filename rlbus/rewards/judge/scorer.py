"""The ``judge`` scorer: an LM judge with a rubric (`rlbus.rewards.judge`), built from ``[reward.judge]``.

`JudgeConfig` is that table: the rubric file, and the backend — a local model served by an engine kind
(`rlbus.engines.kinds`, the torch engine by default) or an OpenAI-compatible endpoint with its key from a file or
the environment. `build_judge` reads and validates the rubric (errors name the file and field) and builds the
backend; `JudgeScorer` scores with it, closes its HTTP session, and adds the judge's figures (retries, invalid
rate) to the reward worker's heartbeat. Only a judge on a local engine loads torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from rlbus.config import secret_from
from rlbus.engines.kinds import ENGINES
from rlbus.envs.episode import Episode
from rlbus.errors import ConfigError
from rlbus.rewards.judge.backends import JudgeBackend, OpenAIJudge, engine_judge
from rlbus.rewards.judge.grading import Judge
from rlbus.rewards.judge.rubric import load_rubric
from rlbus.rewards.scorers import Scorer, ScorerContext
from rlbus.schemas import Prompt, Reward


class JudgeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[reward.judge]``: the LM judge of a reward worker that scores with ``judge`` (``kind = "judge"`` or
    ``"both"``)."""

    #: The rubric: a TOML file of weighted dimensions (``infra/rlbus/rubrics/*.toml``).
    rubric: str = ""
    #: ``engine`` (a local model in an inference engine) or ``openai`` (any OpenAI-compatible endpoint).
    backend: Literal["engine", "openai"] = "engine"
    #: engine: a shipped model, model directory or .gguf (like ``rlbus generate --model``); openai: the
    #: model name sent in each request.
    model: str = "smollm2-135m-instruct"
    #: engine: where the judge model runs (``auto``: CUDA when available, ``cpu``, ``cuda``).
    device: str = "auto"
    #: engine: the engine kind serving the judge model (`rlbus.engines.kinds`; ``torch`` runs in the reward
    #: worker's process).
    engine: str = "torch"
    #: openai: the endpoint's root (``http://host:8000``) or its ``/v1`` path.
    base_url: str | None = None
    #: openai: a file holding the API key (a mounted secret); else ``$<api_key_env>``; neither: no key.
    api_key_file: str | None = None
    #: openai: the environment variable holding the API key when no file is given.
    api_key_env: str = "RLBUS_JUDGE_API_KEY"
    #: Tokens the judge may write per dimension.
    max_tokens: int = 128
    #: Text the judge's reply starts with, e.g. ``"SCORE: "`` so a small model writes the number at once (then
    #: keep max_tokens small, 4); "" lets the judge explain first. openai: sent as a final assistant message
    #: to continue (vLLM's ``continue_final_message``; the endpoint must support it).
    prefill: str = ""
    #: Sampling temperature of a first judgement (0: greedy).
    temperature: float = 0.0
    #: Times an unreadable or out-of-range score is asked again before the judgement is published invalid.
    parse_retries: int = 2
    #: Temperature of those retries (a greedy judge would repeat itself).
    retry_temperature: float = 0.7
    #: openai: limit of one request, in seconds.
    timeout_s: float = 60.0
    #: openai: further attempts after a connection error, timeout, 429 or 5xx.
    retries: int = 4
    #: The reward source the judgements are published as.
    source: str = "judge"

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.parse_retries < 0 or self.retries < 0:
            raise ValueError("max_tokens must be ≥ 1, parse_retries and retries ≥ 0")
        if self.temperature < 0 or self.retry_temperature < 0 or self.timeout_s <= 0:
            raise ValueError("temperature and retry_temperature must be ≥ 0, timeout_s > 0")
        if self.backend == "openai" and not self.base_url:
            raise ValueError("base_url is needed for backend = \"openai\"")
        if not self.source or self.source == "verifier":
            raise ValueError(f"source {self.source!r} must be a name other than \"verifier\"")
        ENGINES.require(self.engine, field="reward.judge.engine")


def build_judge(config: JudgeConfig, *, seed: int = 0, environ: Mapping[str, str] | None = None) -> Judge:
    """The judge of ``config``: its rubric file read and validated (errors name the file and field), its
    backend a local engine over the named model or an OpenAI-compatible endpoint with the key from
    ``api_key_file`` or ``$api_key_env``."""
    import os

    rubric = load_rubric(config.rubric)
    backend: JudgeBackend
    if config.backend == "openai":
        assert config.base_url is not None
        key = secret_from(None, config.api_key_file, config.api_key_env, field="reward.judge.api_key_file",
                          environ=os.environ if environ is None else environ)
        backend = OpenAIJudge(base_url=config.base_url, model=config.model, api_key=key, timeout_s=config.timeout_s,
                              retries=config.retries, temperature=config.temperature, max_tokens=config.max_tokens,
                              prefill=config.prefill)
    else:
        from rlbus.models.sources import parse_model

        source = parse_model(config.model, device=config.device)
        backend = engine_judge(source, max_new_tokens=config.max_tokens, temperature=config.temperature,
                               prefill=config.prefill, seed=seed, engine=config.engine)
    return Judge(rubric, backend, source=config.source, parse_retries=config.parse_retries,
                 retry_temperature=config.retry_temperature)


class JudgeScorer(Scorer):
    """``kind = "judge"``: the judge of ``[reward.judge]``."""

    config_type = JudgeConfig

    def __init__(self, config: JudgeConfig, context: ScorerContext) -> None:
        super().__init__(config, context)
        self.judge = build_judge(config, seed=context.seed, environ=context.environ)

    @classmethod
    def validate(cls, config: JudgeConfig) -> None:
        if not config.rubric:
            raise ConfigError("rubric", "a judge needs a rubric file")

    @classmethod
    def check(cls, config: JudgeConfig, context: ScorerContext) -> list[str]:
        """The rubric parses and an engine backend's model resolves (nothing loaded or converted)."""
        try:
            rubric = load_rubric(config.rubric)
        except ConfigError as exc:
            raise ConfigError("rubric", f"{exc.field}: {exc.problem}") from None
        notes = [f"reward: rubric {config.rubric} parses ({len(rubric.dimensions)} dimensions)"]
        if config.backend == "engine":
            from rlbus.models.sources import check_model_name

            try:
                notes.append(f"reward: judge model {check_model_name(config.model)}")
            except ConfigError as exc:
                raise ConfigError("model", exc.problem) from None
        return notes

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        return await self.judge.score(episode, prompt)

    async def close(self) -> None:
        await self.judge.close()

    def stats(self) -> dict[str, Any]:
        return self.judge.stats.as_dict()
