"""The benchmark table's measurements: a prompt set decoded by the target, plainly and at each setting.

    run = run_benchmark(target, drafter, load_prompt_set("mt-bench"), settings, encode=..., answer_text=...,
                        stop_ids=stops, max_new_tokens=128, context_length=8192)
    run.summary()   # {"prompts", "requests", "seconds", "greedy": {...}, "settings": [{...}, ...]}

A prompt's user turns are asked in order. The request of turn k is the conversation so far,
rendered by ``encode`` (the chat template with ``data.chat_template_kwargs`` and the generation
prompt); the conversation then goes on with the target's own greedy answer, so MT-Bench's second
turn is asked after the target's first answer, as FastChat and SpecForge's benchmark runner ask it.
Every request is decoded once plainly (greedy: the reference output and the baseline speed) and
once per setting with the draft; each setting's counts pool over all requests
(``decoding.acceptance``), and a prompt counts as *differing* when any of its turns' speculative
output is not the greedy one, token for token (speculation is lossless, so the count should be 0).
A request whose prompt plus ``max_new_tokens`` exceeds the target's context is not decoded,
nor are that prompt's later turns (counted as ``skipped_too_long``).

A setting is SGLang's (``--speculative-num-steps``, ``--speculative-eagle-topk``,
``--speculative-num-draft-tokens``). Chain settings (topk 1) decode with ``num_steps = steps``;
tree settings (topk > 1) pass ``topk`` and ``num_draft_tokens`` to ``decode_batch`` (EAGLE3 only;
:func:`check_settings` refuses a tree asking for more tokens than its steps make).
"""

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specforge_core.data.benchmarks import PromptSet
from specforge_core.decoding.acceptance import AcceptanceStats
from specforge_core.decoding.measure import decode_in_batches
from specforge_core.decoding.speculative import tree_token_budget
from specforge_core.decoding.verifier import DecodingTarget
from specforge_core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class DecodingSetting:
    """One row of the table: draft steps per round, branches per step, tokens verified per round
    (checked where it is configured: ``config.BenchmarkSetting``)."""

    steps: int
    topk: int
    draft_tokens: int

    @property
    def label(self) -> str:
        return f"{self.steps},{self.topk},{self.draft_tokens}"

    def decode_kwargs(self) -> dict:
        """The ``decode_batch`` keywords of this setting."""
        kwargs = {"num_steps": self.steps}
        if self.topk > 1:
            kwargs.update(topk=self.topk, num_draft_tokens=self.draft_tokens)
        return kwargs


def check_settings(settings: list[DecodingSetting], where: str = "validation.settings") -> None:
    """Refuse a repeated setting, and a tree setting that asks for more draft tokens than its steps make."""
    labels = [s.label for s in settings]
    if len(set(labels)) < len(labels):
        raise ConfigError(f"settings {labels} repeat a row", where=where, fix="give each setting once")
    for s in settings:
        if s.topk > 1 and not 2 <= s.draft_tokens <= tree_token_budget(s.steps, s.topk):
            raise ConfigError(
                f"setting {s.label} (steps,topk,draft_tokens): {s.steps} steps of topk {s.topk} make at most "
                f"{tree_token_budget(s.steps, s.topk)} verify tokens", where=where,
                fix=f"choose draft_tokens between 2 and {tree_token_budget(s.steps, s.topk)}, e.g. SGLang's 5,4,8",
            )


@dataclass
class Request:
    """One decoded turn: its rendered prompt and the target's greedy answer."""

    prompt_id: str
    turn: int
    ids: list[int]
    answer: list[int]


@dataclass
class SettingFigures:
    setting: DecodingSetting
    stats: AcceptanceStats
    seconds: float = 0.0
    differing: set[str] = field(default_factory=set)  # prompt ids with a turn whose output ≠ greedy

    def add(self, prompt_id: str, gen, reference: list[int]) -> None:
        """Count one request's speculative decode; ``reference`` is its greedy output."""
        self.stats.add(gen)
        if gen.tokens != reference:
            self.differing.add(prompt_id)

    def summary(self, greedy_tokens_per_s: float | None) -> dict:
        s = self.stats.summary()
        tokens_per_s = self.stats.generated_tokens / self.seconds if self.seconds else None
        return {
            "steps": self.setting.steps, "topk": self.setting.topk, "draft_tokens": self.setting.draft_tokens,
            "acceptance_length": s["acceptance_length"],
            "per_request_acceptance_length": s["per_request_acceptance_length"],
            "per_position_acceptance": s["per_position_acceptance"],
            "verify_passes": s["verify_passes"], "generated_tokens": s["generated_tokens"],
            "seconds": round(self.seconds, 3), "tokens_per_s": tokens_per_s,
            "speedup": tokens_per_s / greedy_tokens_per_s if tokens_per_s and greedy_tokens_per_s else None,
            "differing_prompts": sorted(self.differing),
        }


@dataclass
class BenchmarkRun:
    name: str
    source: str
    settings: list[SettingFigures]
    requests: list[Request] = field(default_factory=list)
    skipped_too_long: int = 0
    greedy_seconds: float = 0.0
    greedy_tokens: int = 0
    seconds: float = 0.0

    def summary(self) -> dict:
        greedy_tps = self.greedy_tokens / self.greedy_seconds if self.greedy_seconds else None
        return {
            "name": self.name, "source": self.source,
            "prompts": len({r.prompt_id for r in self.requests}), "requests": len(self.requests),
            "skipped_too_long": self.skipped_too_long, "seconds": round(self.seconds, 3),
            "greedy": {"seconds": round(self.greedy_seconds, 3), "generated_tokens": self.greedy_tokens,
                       "tokens_per_s": greedy_tps},
            "settings": [f.summary(greedy_tps) for f in self.settings],
        }


def _progress_bar(name: str, total: int, enabled: bool):
    from tqdm import tqdm

    # stderr: stdout stays the command's one JSON line
    return tqdm(total=total, desc=name, unit="request", file=sys.stderr, disable=not enabled, leave=True)


def run_benchmark(target: DecodingTarget, drafter, prompt_set: PromptSet, settings: list[DecodingSetting], *,
                  encode: Callable[[list[dict]], list[int]], answer_text: Callable[[list[int]], str],
                  stop_ids: set[int], max_new_tokens: int, context_length: int | None = None,
                  batch_size: int = 8, name: str | None = None, progress: bool = False) -> BenchmarkRun:
    """Decode every turn of ``prompt_set`` plainly and at each of ``settings`` (see the module doc).

    ``encode(messages)``: token ids of the conversation with the generation prompt;
    ``answer_text(tokens)``: the text of an answer for the next turn's conversation;
    ``progress``: a bar over requests × (settings + 1) on stderr.
    """
    start = time.perf_counter()
    run = BenchmarkRun(name or prompt_set.name, prompt_set.source,
                       [SettingFigures(s, AcceptanceStats(s.steps)) for s in settings])
    passes = 1 + len(settings)
    bar = _progress_bar(run.name, sum(len(p.turns) for p in prompt_set.prompts) * passes, progress)
    common = dict(batch_size=batch_size, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    chats = {p.id: [{"role": "system", "content": p.meta["system"]}] if "system" in p.meta else []
             for p in prompt_set.prompts}
    asking = list(prompt_set.prompts)
    try:
        for turn in range(max(len(p.turns) for p in prompt_set.prompts)):
            asked, prompts = [], []
            for p in (p for p in asking if turn < len(p.turns)):
                chats[p.id].append({"role": "user", "content": p.turns[turn]})
                ids = encode(chats[p.id])
                if context_length is not None and len(ids) + max_new_tokens > context_length:
                    run.skipped_too_long += 1
                    bar.total -= (len(p.turns) - turn) * passes
                    bar.refresh()
                    continue
                asked.append(p)
                prompts.append(ids)
            asking = asked
            if not prompts:
                continue
            greedy, seconds = decode_in_batches(target, prompts, on_batch=bar.update, **common)
            run.greedy_seconds += seconds
            for p, ids, gen in zip(asked, prompts, greedy):
                run.greedy_tokens += len(gen.tokens)
                run.requests.append(Request(p.id, turn, ids, gen.tokens))
                chats[p.id].append({"role": "assistant", "content": answer_text(gen.tokens)})
            for figures in run.settings:
                gens, seconds = decode_in_batches(target, prompts, drafter=drafter, on_batch=bar.update,
                                                  **figures.setting.decode_kwargs(), **common)
                figures.seconds += seconds
                for p, gen, ref in zip(asked, gens, greedy):
                    figures.add(p.id, gen, ref.tokens)
    finally:
        bar.close()
    run.seconds = time.perf_counter() - start
    return run
