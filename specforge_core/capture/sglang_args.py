"""SGLang engine arguments, resolved once from the run config, with two views of one object.

    args = SGLangEngineArgs.resolve(cfg, topology)   # the run's Topology (run/topology.py)
    args.kwargs()   # {"model_path": ..., "tp_size": 2, ...}   → ServerArgs(**kwargs) in-process
    args.argv()     # ["--model-path", ..., "--tp-size", "2"]  → python -m sglang.launch_server ...

Both views come from the same ordered field list, so they cannot disagree: a ``True`` flag is a
bare ``--flag``, a ``False`` flag is left out (SGLang's default for every boolean set here), lists
become repeated values and ``None`` is left out of both. This module imports no SGLang.

What is resolved for the in-process capture engine (one engine per island, extend-only):
``tp_size = capture.tp_size`` (one engine per target island), ``pp_size = 1``,
``max_running_requests = tp_size × batch_size`` and ``max_total_tokens = that × max_length``
(one TP-wide batch at a time) unless ``capture.sglang`` sets them, ``context_length =
data.max_length`` unless set, ``chunked_prefill_size = -1`` (the whole batch in one extend),
``disable_cuda_graph`` (extend only, varying shapes), ``enable_return_hidden_states``,
``skip_tokenizer_init`` (we pass token ids). ``capture.sglang.extra`` adds further ``ServerArgs``
fields verbatim; it may not set a field resolved here (``config.SGLANG_RESOLVED_FIELDS``; config
validation names the clash).
"""

import json
from dataclasses import dataclass
from typing import Any

from specforge_core.run.topology import Topology


@dataclass(frozen=True)
class SGLangEngineArgs:
    """Ordered ``(ServerArgs field, value)`` pairs; build with :meth:`resolve`."""

    items: tuple[tuple[str, Any], ...]

    @classmethod
    def resolve(cls, cfg, topology: Topology) -> "SGLangEngineArgs":
        """The engine arguments of a validated :class:`~specforge_core.config.RunConfig` for one
        island of the run's ``topology``."""
        s, t = cfg.capture.sglang, cfg.training
        island_batch = topology.island_batch_size
        resolved: dict[str, Any] = {
            "model_path": cfg.model.target,
            # SGLang runs on GPUs only, where the run's "auto" means bfloat16.
            "dtype": "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype,
            "trust_remote_code": cfg.model.trust_remote_code,
            "skip_tokenizer_init": True,
            "tp_size": topology.tp_size,
            "pp_size": 1,
            "dp_size": s.dp_size,
            "ep_size": s.ep_size,
            "mem_fraction_static": s.mem_fraction_static,
            "attention_backend": s.attention_backend,
            "context_length": s.context_length or cfg.data.max_length,
            "max_running_requests": s.max_running_requests or island_batch,
            "max_total_tokens": s.max_total_tokens or island_batch * cfg.data.max_length,
            "chunked_prefill_size": -1,
            "disable_cuda_graph": True,
            "page_size": 1,  # one KV slot per token: what the capture's allocation assumes
            "sampling_backend": "pytorch",  # nothing is sampled; avoids loading flashinfer's sampler
            "disable_radix_cache": s.disable_radix_cache,
            "enable_return_hidden_states": True,
            "random_seed": t.seed,
        }
        resolved.update(s.extra)
        return cls(tuple(resolved.items()))

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.items).get(name, default)

    def kwargs(self) -> dict[str, Any]:
        """In-process view: keyword arguments of ``sglang.srt.server_args.ServerArgs``."""
        return {k: v for k, v in self.items if v is not None}

    def argv(self) -> list[str]:
        """CLI view: arguments of ``python -m sglang.launch_server`` (same values as kwargs)."""
        out: list[str] = []
        for name, value in self.items:
            flag = "--" + name.replace("_", "-")
            if value is None or value is False:
                continue
            if value is True:
                out.append(flag)
            elif isinstance(value, (list, tuple)):
                out += [flag, *map(str, value)]
            elif isinstance(value, dict):
                out += [flag, json.dumps(value)]
            else:
                out += [flag, str(value)]
        return out
