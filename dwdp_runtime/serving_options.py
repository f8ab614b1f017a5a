"""``ServingOptions``: the HTTP front's serving settings, each default, bound and meaning written once.

Who reads it (and nothing else spells these defaults):
  * the worker's CLI: ``dwdp_worker.launch.group.add_serving_arguments`` makes one flag per field
    (``--max-num-tokens`` for ``max_num_tokens``), its default and help from here;
  * the pod environment: ``from_env`` reads ``contract.ServingEnv`` (``DWDP_MAX_NUM_TOKENS`` for
    ``max_num_tokens``: the member named like the field), which the operator sets from ``spec.serving``;
  * the operator's ``spec.serving`` (``dwdp_operator.spec.Serving``): the same fields camelCased, their
    bounds, defaults and descriptions copied from here (``camel_field``), so the CRD schema follows;
  * the planner's memory figure (``planner.memory``: activations for ``max_num_tokens`` in flight);
  * the front (``Supervisor(options=…)``): admission, packing, the queue bound.

Pure Python and pydantic only: the operator image imports it without torch.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .contract import DEFAULT_CUDA_GRAPHS, DEFAULT_MAX_NEW_TOKENS, MAX_CUDA_GRAPHS, ServingEnv

#: ``max_num_tokens`` default: one packed forward of 8K tokens keeps a H200's GEMMs at full efficiency
#: (docs/PLANNER.md) while one long prompt's first token is not delayed by many others
DEFAULT_MAX_NUM_TOKENS = 8192
#: ``max_num_seqs`` / ``max_queue`` default: a context server's prompts are long, so 256 short ones per forward
#: or waiting is already far past a forward's worth; more waiting only adds latency (a 429 is retried elsewhere)
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_QUEUE = 256

#: why an elastic group replays no CUDA graphs (every refusal of a graph count in one says it: the rank, the local
#: launcher, the pod entrypoint, the operator's spec rule and its CEL twin)
ELASTIC_GRAPHS_REASON = "a captured forward keeps the copy plan it was captured with and cannot follow a re-plan"
#: why batch-invariant serving replays no CUDA graphs (likewise)
BATCH_INVARIANT_GRAPHS_REASON = ("batch-invariant attention reads each forward's packed sequences on the host, which "
                                 "a graph replay cannot")


class ServingOptions(BaseModel):
    """The front's settings (module docstring). ``ServingOptions()`` is the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_queue: int = Field(default=DEFAULT_MAX_QUEUE, ge=1, le=1_000_000,
                           description="waiting requests per pod before the front answers 429")
    max_num_tokens: int = Field(default=DEFAULT_MAX_NUM_TOKENS, ge=1, le=10_000_000,
                                description="tokens packed into one forward (a longer prompt is refused with 400)")
    max_num_seqs: int = Field(default=DEFAULT_MAX_NUM_SEQS, ge=1, le=65536,
                              description="sequences packed into one forward")
    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=1_000_000,
                                description="largest max_tokens a request may ask: a context server decodes a few "
                                            "tokens with the KV cache; long outputs belong to a decode engine "
                                            "(kv_transfer_params); more is a 400")
    served_model_name: str | None = Field(default=None, min_length=1,
                                          description="model id in the API (default: model.synthetic or the model "
                                                      "directory's name)")
    cuda_graphs: int | None = Field(default=None, ge=0, le=MAX_CUDA_GRAPHS,
                                    description=f"prefill batch shapes per rank replayed from CUDA graphs (batches "
                                                f"padded to a ladder of shapes, at most 12.5 % more tokens; a "
                                                f"shape's second forward is captured; the graphs share one memory "
                                                f"pool, the largest shape's activations); 0: off; unset: "
                                                f"{DEFAULT_CUDA_GRAPHS} on GPU ranks that are neither elastic nor "
                                                f"batch-invariant, off on the others; a number > 0 with either, or "
                                                f"without a GPU, is refused")
    batch_invariant: bool = Field(default=False,
                                  description="dense GEMMs through a fixed-tiling Triton matmul and attention "
                                              "run per packed sequence, so a sequence's logits are bitwise the "
                                              "same alone and packed (costs prefill speed: "
                                              "bench/batch_invariant.py); GPU pods only; excludes cuda_graphs")

    @classmethod
    def env_var(cls, field: str) -> ServingEnv:
        """The pod variable of ``field`` (``contract.ServingEnv`` member of the same name)."""
        return ServingEnv[field.upper()]

    @classmethod
    def flag(cls, field: str) -> str:
        return "--" + field.replace("_", "-")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> dict[str, Any]:
        """The fields the operator set in the pod environment, validated by their bounds; only those present
        (an empty ``DWDP_SERVED_MODEL_NAME`` is absent). Raises ``ValueError`` naming the variable, the
        value and the bound."""
        raw = {f: environ[cls.env_var(f).value] for f in cls.model_fields if cls.env_var(f).value in environ}
        for f in [f for f, v in raw.items() if v == "" and cls.model_fields[f].default is None]:
            del raw[f]  # an unset optional field (``env`` renders it empty)
        try:
            checked = cls.model_validate(raw)
        except ValidationError as exc:
            bad = sorted({str(e["loc"][0]) for e in exc.errors()})
            raise ValueError("; ".join(f"{cls.env_var(f).value}={raw[f]!r}: must be {cls.expected(f)} (spec.serving)"
                                       for f in bad)) from None
        return {f: getattr(checked, f) for f in raw}

    @classmethod
    def expected(cls, field: str) -> str:
        """What ``field`` accepts, in words (``an integer >= 1 and <= 256``)."""
        info = cls.model_fields[field]
        if info.annotation is bool:
            return "true or false"
        if not cls.is_int(field):
            return "a non-empty string"
        bounds = [f">= {m.ge}" for m in info.metadata if getattr(m, "ge", None) is not None]
        bounds += [f"<= {m.le}" for m in info.metadata if getattr(m, "le", None) is not None]
        return "an integer " + " and ".join(bounds)

    @classmethod
    def is_int(cls, field: str) -> bool:
        """Whether ``field`` holds an integer (``int``, or ``int | None`` where unset means "decide for me")."""
        return cls.model_fields[field].annotation in (int, int | None)

    def env(self) -> list[tuple[ServingEnv, str]]:
        """This object as pod environment (the operator's rendering): every field, in declaration order."""
        return [(self.env_var(f), _env_text(getattr(self, f))) for f in type(self).model_fields]


def _env_text(value: Any) -> str:
    """A field's pod-env text: booleans as ``true`` / ``false`` (what ``from_env`` and the CRD agree on)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def camel(field: str) -> str:
    head, *rest = field.split("_")
    return head + "".join(w.title() for w in rest)


def camel_field(field: str):
    """A copy of ``ServingOptions``' field ``field`` (default, bounds, description) for a camelCase model."""
    return copy.deepcopy(ServingOptions.model_fields[field])


#: the defaults, for readers that need one number (the planner's activation estimate)
DEFAULTS = ServingOptions()
