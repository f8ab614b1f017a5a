"""The operator → pod environment contract (``docs/ENV_CONTRACT.md``), parsed and checked.

Invariants:
  * The names come from ``dwdp_runtime.contract``: ``ENV_VARS`` is ``contract.POD_ENV``, and
    ``PodEnv`` has one field per name (a test checks the aliases against the contract and the doc
    table). In pod mode the worker reads no other ``DWDP_*`` variable than those and
    ``contract.TuningEnv`` (never set by the operator: rank log level, the sm_gather grid, and the
    fault-injection test hook that delays every copy batch).
  * Every variable is required except that exactly one of ``DWDP_MODEL`` / ``DWDP_MODEL_SYNTHETIC``
    is non-empty. The optional ones a spec feature adds (``contract.LayoutEnv``, ``contract.ElasticEnv``) are
    read only when present, each checked on its own: ``DWDP_POD_ADDR_TEMPLATE`` must hold ``POD_PLACEHOLDER``
    exactly once. ``DWDP_TOKEN`` must be non-empty (an empty token lets any client join the group).
  * Any problem raises ``EnvContractError`` whose message names every missing or bad variable and
    what it should be — never a pydantic traceback.
  * Cross-field rules checked here: ``DWDP_SIZE % DWDP_GPUS_PER_POD == 0``,
    ``DWDP_RANK_BASE == DWDP_POD_INDEX * DWDP_GPUS_PER_POD``, the pod's ranks inside the group, and
    the sharding rules of ``DwdpConfig`` (same messages as the CRD/operator).
"""

from __future__ import annotations

from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from dwdp_runtime.config import MIN_PREFETCH_SLOTS, DwdpConfig
from dwdp_runtime.contract import POD_ENV, POD_ENV_ONE_OF, BackendName, ModelDtypeName, TransferMode
from dwdp_runtime.contract import DEFAULT_ON_UNCOVERED, ON_UNCOVERED_POLICIES, POD_PLACEHOLDER, ElasticEnv, LayoutEnv
from dwdp_runtime.contract import PodEnvVar as E

ENV_VARS: tuple[str, ...] = tuple(v.value for v in POD_ENV)
OPTIONAL_EMPTY: tuple[str, ...] = tuple(v.value for v in POD_ENV_ONE_OF)  # exactly one of the two is set


class EnvContractError(ValueError):
    """The pod environment does not satisfy docs/ENV_CONTRACT.md (message names the variables)."""


class PodEnv(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=False, frozen=True)

    job: str = Field(alias=E.JOB, min_length=1)
    namespace: str = Field(alias=E.NAMESPACE, min_length=1)
    group: int = Field(alias=E.GROUP, ge=0)
    pod_index: int = Field(alias=E.POD_INDEX, ge=0)
    rank_base: int = Field(alias=E.RANK_BASE, ge=0)
    gpus_per_pod: int = Field(alias=E.GPUS_PER_POD, ge=1)
    dwdp_size: int = Field(alias=E.SIZE, ge=2)
    store_addr: str = Field(alias=E.STORE_ADDR, min_length=1)
    store_port: int = Field(alias=E.STORE_PORT, ge=1, le=65535)
    attempt: int = Field(alias=E.ATTEMPT, ge=0)
    token: str = Field(alias=E.TOKEN, min_length=1)
    num_experts: int = Field(alias=E.NUM_EXPERTS, ge=1)
    experts_per_worker: int = Field(alias=E.EXPERTS_PER_WORKER, ge=1)
    prefetch_stride: int = Field(alias=E.PREFETCH_STRIDE, ge=1)
    prefetch_slots: int = Field(alias=E.PREFETCH_SLOTS, ge=MIN_PREFETCH_SLOTS)
    contention_opt: bool = Field(alias=E.CONTENTION_OPT)
    transfer: TransferMode = Field(alias=E.TRANSFER)
    model: str = Field(alias=E.MODEL, default="")
    model_synthetic: str = Field(alias=E.MODEL_SYNTHETIC, default="")
    dtype: ModelDtypeName = Field(alias=E.DTYPE)
    backend: BackendName = Field(alias=E.BACKEND)
    http_port: int = Field(alias=E.HTTP_PORT, ge=1, le=65535)
    # contract.LayoutEnv (optional, absent = 1): not a field, so the fields stay exactly POD_ENV
    _expert_replicas: int = PrivateAttr(default=1)
    _on_uncovered: str = PrivateAttr(default=DEFAULT_ON_UNCOVERED)  # contract.LayoutEnv.ON_UNCOVERED
    _pod_addr_template: str | None = PrivateAttr(default=None)  # contract.ElasticEnv.POD_ADDR_TEMPLATE (elastic only)

    @model_validator(mode="after")
    def _cross_field(self) -> "PodEnv":
        errs = []
        if bool(self.model) == bool(self.model_synthetic):
            errs.append("exactly one of DWDP_MODEL (a checkpoint directory) and DWDP_MODEL_SYNTHETIC "
                        f"(an architecture name) must be set; got DWDP_MODEL={self.model!r}, "
                        f"DWDP_MODEL_SYNTHETIC={self.model_synthetic!r}")
        if self.dwdp_size % self.gpus_per_pod:
            errs.append(f"DWDP_SIZE={self.dwdp_size} is not a multiple of DWDP_GPUS_PER_POD={self.gpus_per_pod}")
        if self.rank_base != self.pod_index * self.gpus_per_pod:
            errs.append(f"DWDP_RANK_BASE={self.rank_base} must equal DWDP_POD_INDEX×DWDP_GPUS_PER_POD = "
                        f"{self.pod_index}×{self.gpus_per_pod} = {self.pod_index * self.gpus_per_pod}")
        if self.rank_base + self.gpus_per_pod > self.dwdp_size:
            errs.append(f"ranks [{self.rank_base}, {self.rank_base + self.gpus_per_pod}) of this pod fall outside "
                        f"the group of DWDP_SIZE={self.dwdp_size} ranks (check DWDP_POD_INDEX)")
        if errs:
            raise ValueError("; ".join(errs))
        return self

    def dwdp_config(self) -> DwdpConfig:
        return DwdpConfig(dwdp_size=self.dwdp_size, num_experts=self.num_experts,
                          num_experts_per_worker=self.experts_per_worker,
                          num_prefetch_experts=self.prefetch_stride, num_prefetch_slots=self.prefetch_slots,
                          contention_opt=self.contention_opt, transfer=self.transfer,
                          expert_replicas=self._expert_replicas, on_uncovered=self._on_uncovered)

    @property
    def expert_replicas(self) -> int:
        return self._expert_replicas

    @property
    def pod_addr_template(self) -> str | None:
        """Where every pod of the group answers, ``{pod}`` standing for the pod index (an elastic group's survivors
        find any rank's standby store there); None when the operator did not set it (a group that is not elastic)."""
        return self._pod_addr_template

    @property
    def ranks(self) -> list[int]:
        return list(range(self.rank_base, self.rank_base + self.gpus_per_pod))


def parse_env(environ: Mapping[str, str]) -> PodEnv:
    """Read exactly ``ENV_VARS`` from ``environ``; raise ``EnvContractError`` naming every problem."""
    missing = [v for v in ENV_VARS if v not in environ and v not in OPTIONAL_EMPTY]
    if missing:
        raise EnvContractError(f"missing environment variable(s) {', '.join(missing)} "
                               f"(the operator sets them; see docs/ENV_CONTRACT.md)")
    data = {v: environ[v] for v in ENV_VARS if v in environ}
    try:
        env = PodEnv.model_validate(data)
    except ValidationError as exc:
        raise EnvContractError("bad pod environment: " + "; ".join(_describe(e, data) for e in exc.errors())) from None
    raw = environ.get(LayoutEnv.EXPERT_REPLICAS, "1")
    try:
        env._expert_replicas = int(raw)
    except ValueError:
        raise EnvContractError(f"{LayoutEnv.EXPERT_REPLICAS}={raw!r}: must be an integer >= 1 "
                               f"(experts.replicas; absent means 1)") from None
    policy = environ.get(LayoutEnv.ON_UNCOVERED, DEFAULT_ON_UNCOVERED)
    if policy not in ON_UNCOVERED_POLICIES:
        raise EnvContractError(f"{LayoutEnv.ON_UNCOVERED}={policy!r}: must be one of {', '.join(ON_UNCOVERED_POLICIES)} "
                               f"(experts.onUncovered; absent means {DEFAULT_ON_UNCOVERED})")
    env._on_uncovered = policy
    template = environ.get(ElasticEnv.POD_ADDR_TEMPLATE)
    if template is not None:
        env._pod_addr_template = checked_pod_addr_template(template)
    try:
        env.dwdp_config()
    except ValueError as exc:
        raise EnvContractError(f"DWDP_SIZE/DWDP_NUM_EXPERTS/DWDP_EXPERTS_PER_WORKER/DWDP_PREFETCH_STRIDE/"
                               f"DWDP_PREFETCH_SLOTS/DWDP_TRANSFER/DWDP_EXPERT_REPLICAS: {exc}") from None
    return env


def checked_pod_addr_template(value: str) -> str:
    """``value`` if it names the pod index with exactly one ``POD_PLACEHOLDER`` and has no other brace (the worker
    substitutes the index into it), else ``EnvContractError``."""
    rest = value.replace(POD_PLACEHOLDER, "", 1)
    if value.count(POD_PLACEHOLDER) != 1 or "{" in rest or "}" in rest:
        raise EnvContractError(f"{ElasticEnv.POD_ADDR_TEMPLATE}={value!r}: must hold the pod index placeholder "
                               f"{POD_PLACEHOLDER} exactly once and no other brace, e.g. "
                               f"'r1-g0-p{POD_PLACEHOLDER}.r1-ranks.default.svc' (the operator sets it for an elastic "
                               f"group; docs/ENV_CONTRACT.md)")
    return value


def serving_overrides(environ: Mapping[str, str]) -> dict[str, int | str]:
    """The front settings the operator set from ``spec.serving`` (``contract.ServingEnv``), by
    ``ServingOptions`` field (= the flag's dest); only the variables present. Raises ``EnvContractError``
    naming a bad one."""
    from dwdp_runtime.serving_options import ServingOptions

    try:
        return ServingOptions.from_env(environ)
    except ValueError as exc:
        raise EnvContractError(str(exc)) from None


def _describe(err: dict, data: Mapping[str, str]) -> str:
    loc = err.get("loc") or ()
    msg = str(err.get("msg", "invalid"))
    if loc:
        var = str(loc[0])
        return f"{var}={data.get(var, '')!r}: {msg}"
    return msg.removeprefix("Value error, ")

