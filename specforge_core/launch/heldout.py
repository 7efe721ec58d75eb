"""A small held-out decode while the draft trains: the serving figure next to the training one.

    decode = HeldOutDecoder(cfg, family, draft_config, heldout_prompt_ids(rows_eval, 8))   # the builder
    figures = decode(full_state)   # rank 0, every training.heldout.interval steps (loop/trainer.py)

It measures what ``python -m specforge_core.evaluate`` measures (``decoding.measure.measure_acceptance``:
chain drafting of k = ``validation.num_steps`` tokens per round, greedy verification by the HF
target), on the first ``training.heldout.num_prompts`` prompts of the prompt cache's eval split
(``data.eval_files`` or ``data.eval_holdout``: never trained on), ``training.heldout.max_new_tokens``
tokens each. Figures, added to that step's metrics record:

- ``heldout_acceptance_length``: tokens emitted by verify passes / verify passes (1.0 untrained);
- ``heldout_accept_rate_i`` (i < k): P(draft token i accepted | the ones before it accepted),
  conditional, beside the training window's unconditional ``acc_i``;
- ``heldout_prompts``, ``heldout_tokens``, ``heldout_seconds`` (the decode's wall time, target
  load included the first time).

The target is loaded once, at the first decode, with ``decoding.verifier.load_target``: a second
copy beside the capture backend's, so rank 0 holds the target's weights twice. The decode
works on a copy of the weights under a forked RNG, so it changes nothing the ranks train.
"""

import random
import time

import torch

from specforge_core.errors import ConfigError, ModelError


def heldout_prompt_ids(eval_rows, n: int) -> list[list[int]]:
    """The first ``n`` non-empty ``prompt_ids`` of the prompt cache's eval split (pyarrow rows).

    ConfigError naming ``training.heldout.interval`` when the split has none.
    """
    prompts = [row["prompt_ids"] for row in (eval_rows[i] for i in range(min(n, len(eval_rows))))]
    prompts = [list(map(int, p)) for p in prompts if p]
    if not prompts:
        raise ConfigError(
            "training.heldout.interval asks for held-out decodes, but the prompt cache has no held-out prompts",
            where="training.heldout.interval",
            fix="give held-out prompts (data.eval_files, or data.eval_holdout: N), or set training.heldout.interval=0",
        )
    return prompts


class HeldOutDecoder:
    """Rank 0's decode of fixed held-out prompts with the draft's current weights."""

    def __init__(self, cfg, family, draft_config, prompts: list[list[int]]):
        from specforge_core.drafts import validation_num_steps

        self.cfg, self.family, self.draft_config, self.prompts = cfg, family, draft_config, prompts
        self.num_steps = validation_num_steps(cfg)
        self.max_new_tokens = cfg.training.heldout.max_new_tokens
        self._target = None  # (model, stop ids, capture layer ids), loaded at the first decode
        self._draft = None

    def __call__(self, state: dict[str, torch.Tensor]) -> dict[str, float | None]:
        """Decode the prompts with the draft weights ``state`` (full, frozen parameters left out)."""
        from specforge_core.decoding.measure import measure_acceptance

        start = time.perf_counter()
        py_rng = random.getstate()
        with torch.random.fork_rng(devices=[]):  # a new draft's init and the target load draw from it
            model, stops, layer_ids = self._target or self._load_target()
            draft = self._load_weights(state, model)
            with torch.no_grad():
                measured = measure_acceptance(
                    model, self.family.drafter(draft, model, self.cfg), self.prompts, stop_ids=stops,
                    capture_layer_ids=layer_ids, num_steps=self.num_steps, max_new_tokens=self.max_new_tokens,
                )
        random.setstate(py_rng)
        figures = {"heldout_acceptance_length": measured["acceptance_length"]}
        for i, rate in enumerate(measured["per_position_acceptance"]):
            figures[f"heldout_accept_rate_{i}"] = rate
        figures.update(heldout_prompts=measured["prompts"], heldout_tokens=measured["generated_tokens"],
                       heldout_seconds=time.perf_counter() - start)
        return figures

    def _load_target(self):
        from specforge_core.data.tokenize import ChatRenderer
        from specforge_core.decoding.verifier import load_target, stop_token_ids

        model, tok = load_target(self.cfg)
        stops = stop_token_ids(model, tok, ChatRenderer(tok).end_of_turn)
        layer_ids = list(self.family.capture_layer_ids(self.cfg, model.config, self.draft_config))
        self._target = (model, stops, layer_ids)
        return self._target

    def _load_weights(self, state: dict[str, torch.Tensor], model):
        if self._draft is None:
            self._draft = self.family.new_draft(self.draft_config)
        frozen = {name for name, p in self._draft.named_parameters() if not p.requires_grad}
        result = self._draft.load_state_dict(state, strict=False)
        missing = sorted(set(result.missing_keys) - frozen)
        if missing or result.unexpected_keys:
            raise ModelError(
                f"the trained weights do not fit a fresh draft: missing {missing}, unexpected "
                f"{sorted(result.unexpected_keys)}",
                where="training.heldout", fix="report this: the draft family's new_draft and its training differ",
            )
        return self.family.prepare_for_decoding(self._draft, model)
