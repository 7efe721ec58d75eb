"""Counting what speculation bought: acceptance length and its parts, pooled over prompts.

Conventions (docs/validation.md says the same for users):

- **acceptance length** = tokens emitted by verify passes / verify passes
  = 1 + (extra tokens) / verify passes, the count SGLang's benchmarks report (bonus token
  included; exactly 1.0 without speculation). The first token of each prompt comes from the
  prefill, not from a verify pass, and is not counted (SGLang-style ``(tokens − 1) / verify``).
- **mean accepted draft tokens** = acceptance length − 1: draft tokens that reached the output
  per verify pass (the last round can be cut by ``max_new_tokens`` or the stop token).
- **per-position acceptance** i = P(draft token i accepted | tokens 0..i-1 accepted), measured
  over verify rounds from the raw verify outcome (conditional, unlike training's acc_i).
- **target forward passes saved** = passes plain greedy decoding would need for the same
  tokens (one per token) − passes used (prefill + verify passes).

Sums pool over prompts (Σ tokens / Σ passes), as SGLang's and vLLM's benchmarks do. The
**per-request acceptance length** is the other convention, SpecForge's benchmark runner's: each
request's own ratio (same counts), then the mean over requests; a request that ended at the
prefill (no verify pass) has none and is left out. Long requests weigh more in the pooled figure.
"""

from dataclasses import dataclass, field

from specforge_core.decoding.speculative import Generation


@dataclass
class AcceptanceStats:
    """Running sums over decoded prompts; ``summary()`` gives the reported figures."""

    num_steps: int
    prompts: int = 0
    generated_tokens: int = 0
    verify_passes: int = 0
    verify_tokens: int = 0  # Σ tokens emitted by verify passes
    reached: list[int] = field(default_factory=list)  # reached[i]: rounds whose drafts 0..i-1 were accepted
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: rounds whose draft i was accepted too
    stopped: int = 0  # prompts that ended on an end-of-turn token
    request_ratio_sum: float = 0.0  # Σ over requests with a verify pass of their own tokens / passes
    requests_verified: int = 0  # requests with at least one verify pass

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.num_steps
        self.accepted_at = self.accepted_at or [0] * self.num_steps

    def add(self, gen: Generation) -> None:
        if gen.num_steps != self.num_steps:
            raise ValueError(f"generation used num_steps={gen.num_steps}, stats count {self.num_steps}")
        self.prompts += 1
        self.generated_tokens += len(gen.tokens)
        self.verify_passes += gen.verify_passes
        self.verify_tokens += sum(gen.emitted)
        self.stopped += gen.stopped
        if gen.verify_passes:
            self.request_ratio_sum += sum(gen.emitted) / gen.verify_passes
            self.requests_verified += 1
        for a in gen.accepted:
            for i in range(self.num_steps):
                if a >= i:
                    self.reached[i] += 1
                if a > i:
                    self.accepted_at[i] += 1

    def summary(self) -> dict:
        """The measured numbers (None where nothing was measured, e.g. no verify pass ran)."""
        passes = self.verify_passes
        acc_len = self.verify_tokens / passes if passes else None
        forwards = self.prompts + passes
        saved = self.generated_tokens - forwards
        return {
            "prompts": self.prompts,
            "num_steps": self.num_steps,
            "generated_tokens": self.generated_tokens,
            "verify_passes": passes,
            "acceptance_length": acc_len,
            "per_request_acceptance_length": (self.request_ratio_sum / self.requests_verified
                                              if self.requests_verified else None),
            "mean_accepted_draft_tokens": acc_len - 1 if acc_len is not None else None,
            "per_position_acceptance": [
                self.accepted_at[i] / self.reached[i] if self.reached[i] else None
                for i in range(self.num_steps)
            ],
            "target_forwards": forwards,
            "greedy_target_forwards": self.generated_tokens,
            "target_forwards_saved": saved,
            "target_forwards_saved_fraction": saved / self.generated_tokens if self.generated_tokens else None,
            "tokens_per_target_forward": self.generated_tokens / forwards if forwards else None,
            "stopped_on_end_of_turn": self.stopped,
        }
