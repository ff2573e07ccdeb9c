"""What the front end needs to know about the model: context length, vocabulary, EOS ids."""

from __future__ import annotations

import dataclasses

from ember_scheduler.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from ember_server.engine.engine_args import EngineArgs
from ember_worker.hf_config import (
    HFConfig,
    as_token_ids,
    generation_eos_token_ids,
    load_hf_config,
    resolve_model_path,
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The resolved model settings of an engine (from ``EngineArgs`` and the model's config)."""

    model: str
    tokenizer: str
    served_model_name: str
    max_model_len: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_id: int | None  # the one the scheduler checks
    extra_eos_token_ids: tuple[int, ...]  # further EOS ids from generation_config.json
    bos_token_id: int | None
    scheduling_policy: str = "fcfs"
    runner: str = "generate"  # "generate" or "pooling" (resolved from EngineArgs.runner)
    pooling_type: str = "last"
    hidden_size: int = 0  # the longest embedding (``dimensions`` may truncate it)
    num_labels: int | None = None  # a sequence classifier's; None: no score head
    labels: tuple[str, ...] = ()  # a classifier's label names, by class index (id2label)

    @property
    def can_generate(self) -> bool:
        return self.runner == "generate"

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> ModelConfig:
        try:
            folder = resolve_model_path(args.model, config_only=True)
            hf_config = load_hf_config(folder)
        except OSError as exc:
            raise ValueError(
                f"EngineArgs.model {args.model!r} is not a model folder: {exc}"
            ) from exc
        except ValueError as exc:
            raise ValueError(f"EngineArgs.model {args.model!r}: {exc}") from exc
        model_max = hf_config.max_position_embeddings
        max_model_len = args.max_model_len or model_max
        if max_model_len is None:
            raise ValueError("EngineArgs.max_model_len must be given: the model's config has none")
        if model_max is not None and max_model_len > model_max:
            raise ValueError(
                f"EngineArgs.max_model_len ({max_model_len}) exceeds the model's "
                f"max_position_embeddings ({model_max})"
            )
        eos_ids = as_token_ids(hf_config.eos_token_id)
        eos_ids += [i for i in generation_eos_token_ids(folder) if i not in eos_ids]
        num_labels = _classifier_num_labels(hf_config)
        runner = args.runner
        if runner == "auto":
            runner = "generate" if num_labels is None else "pooling"
        elif runner == "generate" and num_labels is not None:
            raise ValueError(
                f"EngineArgs.runner 'generate' does not fit {args.model!r}: a sequence "
                "classification model has no LM head (use runner='pooling')"
            )
        return cls(
            model=args.model,
            tokenizer=args.tokenizer or args.model,
            served_model_name=args.model_name,
            max_model_len=max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens
            or max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS),
            vocab_size=hf_config.vocab_size,
            eos_token_id=eos_ids[0] if eos_ids else None,
            extra_eos_token_ids=tuple(eos_ids[1:]),
            bos_token_id=hf_config.bos_token_id,
            scheduling_policy=args.scheduling_policy,
            runner=runner,
            pooling_type=args.pooling_type,
            hidden_size=hf_config.hidden_size,
            num_labels=num_labels,
            labels=_labels(hf_config) if num_labels is not None else (),
        )


def _labels(hf_config: HFConfig) -> tuple[str, ...]:
    return tuple(str(hf_config.id2label.get(i, f"LABEL_{i}")) for i in range(hf_config.num_labels))


def _classifier_num_labels(hf_config: HFConfig) -> int | None:
    archs = getattr(hf_config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return hf_config.num_labels
    return None
