"""TRL's ``GRPOTrainer`` with deltasync: weights out through the store, rollouts back
from ``deltasync serve``.

    from deltasync import DeltasyncCallback, DeltasyncRollout, Emitter
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=prompts,
        callbacks=[DeltasyncCallback(Emitter(run="grpo-7"))],
        rollout_func=DeltasyncRollout("http://rollout-1:8000", on_policy=True),
    )

``DeltasyncCallback`` publishes the policy with the trainer's global step as the
version: at ``on_train_begin`` (version 0 of a new run: the servers' ports open once
it is loaded) and after every ``every``-th optimizer step, through the ``Emitter``.
``DeltasyncRollout`` is a ``rollout_func``: one ``/v1/completions`` request per
distinct prompt with ``n`` completions (TRL repeats each prompt ``num_generations``
times in a row), through the official ``openai`` client, each gated
(``x-deltasync-min-version``) at the policy version (``on_policy``) or ``max_staleness``
versions below it. It returns the token ids and log-probabilities TRL expects and the
version that generated every sample (``deltasync_version``, passed on to the reward
functions, and logged in the completions table and as ``deltasync/staleness``).

transformers is imported with this module (the callback subclasses its
``TrainerCallback``); openai on the first rollout; trl never (the trainer is used
through its attributes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback

from pipeline.errors import ChainError, ConfigError, MismatchError, VersionTimeoutError
from pipeline.logs import get_logger
from pipeline.rollout.served import (
    GATE_WAIT_S,
    VERSION_HEADER,
    VersionClient,
    gate_headers,
    parse_label,
)
from workers.trainers.trainer import Emitted, Emitter

log = get_logger(__name__)

VERSION_FIELD = "deltasync_version"  # the extra field of every sample: its version
STALENESS_METRIC = "deltasync/staleness"  # policy version minus the sample's, averaged


class DeltasyncCallback(TrainerCallback):  # type: ignore[misc]
    """A transformers ``TrainerCallback`` that publishes the policy after optimizer steps.

    ``emitter``: an ``Emitter`` (or a run name, for one with settings from the
    environment). The version is the trainer's global step: at train begin (0, or
    the step a resumed trainer starts from, unless the run already holds it) and
    every ``every`` steps, plus the last step at train end. Weights are cast to
    ``dtype`` (the server's; bf16 by default). Only the main process publishes; every
    process tracks ``version``, the newest policy version, which ``DeltasyncRollout``
    gates on."""

    def __init__(
        self, emitter: Emitter | str, *, every: int = 1, dtype: torch.dtype | None = torch.bfloat16
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"every must be an integer >= 1, got {every!r}")
        self.emitter = Emitter(emitter) if isinstance(emitter, str) else emitter
        self.every = every
        self.dtype = dtype
        self.version: int | None = None
        self.emitted: Emitted | None = None  # the latest step this process sent

    @property
    def run(self) -> str:
        return self.emitter.run

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        if state.is_world_process_zero:
            head = self.emitter.head()
            if head is not None and head > step:
                raise ChainError(
                    f"run {self.run!r} already holds version {head}, past the trainer's step "
                    f"{step}: train under a new run name, or resume from step {head} or later"
                )
            if head == step:
                log.info("policy already published (a resumed run)", run=self.run, version=step)
            else:
                self._publish(step, kwargs.get("model"))
        self.version = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        if step % self.every == 0 and step != self.version:
            self._publish_on_main(state, step, kwargs.get("model"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        if self.version is not None and step > self.version:
            self._publish_on_main(state, step, kwargs.get("model"))

    def _publish_on_main(self, state: Any, step: int, model: Any) -> None:
        if state.is_world_process_zero:
            self._publish(step, model)
        self.version = step

    def _publish(self, step: int, model: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError("the trainer passed no model to DeltasyncCallback")
        self.emitted = self.emitter.emit_state(step, model, dtype=self.dtype)
        log.info("policy published", run=self.run, version=step)


def policy_version(trainer: Any) -> int:
    """The newest policy version of ``trainer``: its ``DeltasyncCallback``'s, else its
    global step."""
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        if isinstance(callback, DeltasyncCallback) and callback.version is not None:
            return callback.version
    return int(trainer.state.global_step)


@dataclass(frozen=True)
class _Completions:
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    version: int


class _Server:
    def __init__(self, url: str, api_key: str, timeout_s: float, model: str | None) -> None:
        self.versions = VersionClient(url)
        self.url = self.versions.url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model = model
        self._client: Any = None

    def client(self) -> Any:
        if self._client is None:
            import openai

            self._client = openai.OpenAI(
                base_url=f"{self.url}/v1", api_key=self.api_key, timeout=self.timeout_s
            )
        if self.model is None:
            self.model = str(self._client.models.list().data[0].id)
        return self._client


class DeltasyncRollout:
    """A ready ``rollout_func`` for TRL's ``GRPOTrainer``, generating on ``deltasync serve``.

    ``urls``: one server or several (prompts are spread over them; every server must
    follow the trainer's run). ``on_policy=True`` (the default) gates every request at
    the policy version, so a batch is generated by exactly that version;
    ``max_staleness=k`` accepts any version from k below it on (generation overlaps
    the servers' updates). ``wait_timeout_s``: how long a request may wait for its
    version (then ``VersionTimeoutError``); ``timeout_s``: for the generation itself.
    Sampling follows the trainer (``max_completion_length``, ``temperature``,
    ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``generation_kwargs``);
    no per-request seed is sent (with repeated prompts every sample would be equal).
    Conversational prompts are rendered with the trainer's chat template and sent as
    token ids. ``model``: the served model name (default: the server's first)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        on_policy: bool | None = None,
        max_staleness: int | None = None,
        wait_timeout_s: float = GATE_WAIT_S,
        timeout_s: float = 600.0,
        model: str | None = None,
        api_key: str = "none",
        max_concurrency: int = 32,
    ) -> None:
        if max_staleness is None:
            if on_policy is False:
                raise ConfigError("on_policy=False needs max_staleness=k (versions behind)")
            max_staleness = 0
        elif isinstance(max_staleness, bool) or not isinstance(max_staleness, int):
            raise ConfigError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        elif max_staleness < 0 or (on_policy and max_staleness > 0):
            raise ConfigError(
                f"max_staleness={max_staleness} with on_policy={on_policy}: on-policy is "
                "max_staleness=0; give one of the two"
            )
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        gate_headers(0, wait_timeout_s)  # checks the timeout
        names = [urls] if isinstance(urls, str) else list(urls)
        if not names:
            raise ConfigError("DeltasyncRollout needs at least one server URL")
        self.max_staleness = max_staleness
        self.wait_timeout_s = wait_timeout_s
        self.max_concurrency = max_concurrency
        self.servers = [_Server(u, api_key, wait_timeout_s + timeout_s, model) for u in names]

    def gate(self, trainer: Any) -> int:
        """The oldest version this batch may be generated by."""
        return max(0, policy_version(trainer) - self.max_staleness)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        gate = self.gate(trainer)
        policy = policy_version(trainer)
        groups = _runs(prompts)
        for server in self.servers:  # also waits for a server whose port is not open yet
            server.versions.wait_for(gate, self.wait_timeout_s)
            server.client()  # made here, not by the threads below
        sampling = _sampling(trainer)
        expect = _expected_run(trainer)

        def generate(index: int) -> _Completions:
            prompt, n = groups[index]
            server = self.servers[index % len(self.servers)]
            payload = _prompt_payload(prompt, trainer)
            return self._generate(server, payload, n, gate, sampling, expect)

        workers = min(self.max_concurrency, len(groups)) or 1
        with ThreadPoolExecutor(workers, thread_name_prefix="deltasync-rollout") as pool:
            results = list(pool.map(generate, range(len(groups))))
        samples = [
            (r.prompt_ids, ids, logprobs, r.version)
            for r in results
            for ids, logprobs in zip(r.completion_ids, r.logprobs, strict=True)
        ]
        names = ("prompt_ids", "completion_ids", "logprobs", VERSION_FIELD)
        out: dict[str, list[Any]] = {n: [s[i] for s in samples] for i, n in enumerate(names)}
        _log_to_trainer(trainer, out[VERSION_FIELD], policy)
        return out

    def _generate(
        self,
        server: _Server,
        prompt: str | list[int],
        n: int,
        gate: int,
        sampling: Mapping[str, Any],
        expect_run: str | None,
    ) -> _Completions:
        import openai

        client = server.client()
        headers = gate_headers(gate, self.wait_timeout_s)
        try:
            raw = client.completions.with_raw_response.create(
                model=server.model, prompt=prompt, n=n, logprobs=0, extra_headers=headers,
                **sampling,
            )  # fmt: skip
        except openai.APIStatusError as exc:
            if exc.status_code == 504:
                raise VersionTimeoutError(f"{server.url}: {_error_message(exc)}") from None
            raise
        label = raw.headers.get(VERSION_HEADER)
        if label is None:
            raise ConfigError(
                f"{server.url} names no version ({VERSION_HEADER}): is it a deltasync serve?"
            )
        run, version = parse_label(label)
        if expect_run is not None and run != expect_run:
            raise ConfigError(
                f"{server.url} serves run {run!r}; the trainer publishes {expect_run!r}"
            )
        if version < gate:
            raise MismatchError(
                f"{server.url} answered with version {version}, below the gate {gate}: "
                "does it run deltasync serve with the version gate?"
            )
        doc = json.loads(raw.text)
        choices = sorted(doc["choices"], key=lambda c: int(c["index"]))
        if len(choices) != n:
            raise MismatchError(f"{server.url} returned {len(choices)} completions, not {n}")
        try:
            prompt_ids = [int(t) for t in choices[0]["prompt_token_ids"]]
            ids = [[int(t) for t in c["token_ids"]] for c in choices]
            logprobs = [[float(p) for p in c["logprobs"]["token_logprobs"]] for c in choices]
        except (KeyError, TypeError) as exc:
            raise MismatchError(
                f"{server.url} returned no token ids or log-probabilities ({exc!r}): "
                "vLLM's return_token_ids is needed"
            ) from None
        return _Completions(prompt_ids, ids, logprobs, version)


def _runs(prompts: Sequence[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count): one request with n=count each."""
    groups: list[tuple[Any, int]] = []
    for prompt in prompts:
        if groups and groups[-1][0] == prompt:
            groups[-1] = (prompt, groups[-1][1] + 1)
        else:
            groups.append((prompt, 1))
    return groups


def _prompt_payload(prompt: Any, trainer: Any) -> str | list[int]:
    """A text prompt as it is; a conversation rendered with the trainer's chat
    template, as token ids (the server then generates from exactly those)."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not all(isinstance(m, Mapping) for m in prompt):
        raise ConfigError(f"a prompt must be text or a list of messages, got {type(prompt)}")
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    kwargs = dict(getattr(trainer, "chat_template_kwargs", None) or {})
    ids: Any = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, **kwargs
    )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _sampling(trainer: Any) -> dict[str, Any]:
    args = trainer.args

    def setting(name: str, default: Any) -> Any:
        value = getattr(trainer, name, getattr(args, name, default))
        return default if value is None else value

    extra: dict[str, Any] = {"return_token_ids": True}
    if setting("top_k", 0) > 0:
        extra["top_k"] = int(setting("top_k", 0))
    if setting("min_p", 0.0) > 0:
        extra["min_p"] = float(setting("min_p", 0.0))
    if setting("repetition_penalty", 1.0) != 1.0:
        extra["repetition_penalty"] = float(setting("repetition_penalty", 1.0))
    extra.update(getattr(args, "generation_kwargs", None) or {})
    return {
        "max_tokens": int(setting("max_completion_length", 256)),
        "temperature": float(setting("temperature", 1.0)),
        "top_p": float(setting("top_p", 1.0)),
        "extra_body": extra,
    }


def _expected_run(trainer: Any) -> str | None:
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        if isinstance(callback, DeltasyncCallback):
            return callback.run
    return None


def _log_to_trainer(trainer: Any, versions: list[int], policy: int) -> None:
    """The versions as a column of TRL's completions table and the staleness as a
    metric, through the hooks TRL gives reward functions (skipped where absent)."""
    log_extra = getattr(trainer, "_log_completion_extra", None)
    if callable(log_extra):
        log_extra(VERSION_FIELD, list(versions))
    log_metric = getattr(trainer, "_log_metric", None)
    if callable(log_metric) and versions:
        log_metric(STALENESS_METRIC, sum(policy - v for v in versions) / len(versions))


def _error_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, Mapping) and isinstance(body.get("message"), str):
        return str(body["message"])
    return str(exc)


__all__ = ["DeltasyncCallback", "DeltasyncRollout", "policy_version"]
