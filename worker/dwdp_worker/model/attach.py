"""``attach(model, …) -> Attachment``: every change DWDP makes to a built `transformers` model, and its undo.

What ``attach`` does, in this order (``Attachment.close()`` undoes each, in reverse):
  1. **Quantized experts forwards** (``overrides``: FP8 block-scaled or FP4 experts, named by the loader): the experts
     module's instance ``forward`` and one state attribute (``ForwardOverride``). The module keeps its class.
  2. **Experts implementation** (``experts``: ``auto`` | ``dwdp`` | ``grouped_mm`` | ``eager``; the choice is
     ``experts_impl.choose``, pure): for ``dwdp``, each experts module's kernel layout (``_dwdp_kernels``) and
     ``model.set_experts_implementation``. Undo: the attribute deleted, the previous implementation set back.
     The name ``"dwdp"`` in `transformers`' class-wide ``ExpertsInterface`` stays registered: registering is
     idempotent and changes no model that does not select it (`transformers` has no unregister).
  3. **Fused layers** on CUDA with ``dwdp`` (``layers_impl``): the canonical RMSNorm modules' instance
     ``forward``; the modeling modules' ``apply_rotary_pos_emb`` global, which is process-wide: every
     attached model is an owner of it and the last owner's close puts `transformers`' function back.
  4. **Batch invariance** with ``batch_invariant``: the dispatcher's mm/addmm/bmm kernels of the model's device
     type (``dwdp_runtime.kernels.batch_invariant``, process-wide and reference counted) and the model's attention
     run per packed sequence as that sequence alone (``attention``: the registry entry of its attention
     implementation, reference counted, and a forward pre-hook on the model); both closed on undo.
  5. **Fused router** with ``fused_router`` (opt-in; ``router_impl``): router modules' instance ``forward``, where
     a probe shows it reproduces the module's (``router_impl.install``). Undo: the instance forwards popped.
  6. **DWDP hooks** with a ``manager`` (``hooks.DwdpHooks``): ``start_forward`` before the model, before each
     experts module the stream wait and the binding of its sharded parameters to the layer's composites
     (``param.data = composite``: the one place a parameter is rebound), ``finish_layer`` after it. The
     ``.data`` every sharded parameter held at attach is saved and put back on close.

Not here, and why:
  * the loader's construction of a model (meta device → parameters; local experts as parameters over their
    transport handles; ``model.dwdp_layout``): building a model is not mutating one, and ``unbind_experts``
    points those parameters back to meta after the manager's memory is gone (``Engine.close``);
  * the CUDA-graph mask answer (``attention.one_sequence``): a context manager around one capture,
    scoped so it needs no undo.

Invariants: ``close()`` is idempotent; after it the model is bitwise its old self (the same parameter objects
holding the same bytes, the same module ``__dict__`` keys, the same experts implementation, `transformers`'
own module globals); two attachments in one process are independent (tests/worker/test_attach.py).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from . import attention, experts_impl, layers_impl, router_impl
from .hooks import DwdpHooks
from .registry import experts_sites

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardOverride:
    """One experts module computed by another forward (``forward(self, hidden_states, top_k_index,
    top_k_weights)``) that reads ``state`` from the module's attribute ``state_attr``."""
    path: str
    forward: Callable
    state_attr: str
    state: Any


@dataclass
class Attachment:
    """What ``attach`` changed in one model; ``close()`` undoes it."""
    model: Any
    experts: str                                   # the experts implementation in use
    hooks: DwdpHooks | None = None
    fused: layers_impl.Installed | None = None
    batch_invariant: Any = None                    # kernels.batch_invariant.BatchInvariantMode, or None
    attention: attention.PerSequence | None = None  # per-sequence attention with batch_invariant
    routers: list = field(default_factory=list)    # router modules given the fused forward (router_impl)
    _overridden: list = field(default_factory=list)          # experts modules with an instance forward
    _kernel_layouts: list = field(default_factory=list)      # modules given ``_dwdp_kernels``
    _previous_experts: str | None = None                     # the implementation before attach
    _saved_data: list = field(default_factory=list)          # (parameter, its .data at attach)
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.hooks is not None:
            self.hooks.remove()
        if self.batch_invariant is not None:
            self.batch_invariant.close()
        if self.attention is not None:
            self.attention.close()
        router_impl.uninstall(self.routers)
        for param, data in self._saved_data:
            param.data = data
        if self.fused is not None:
            layers_impl.uninstall(self.model)
        if self._previous_experts is not None:
            self.model.set_experts_implementation(self._previous_experts)
        for module in self._kernel_layouts:
            module.__dict__.pop(experts_impl.KERNELS_ATTR, None)
        for module, attr in self._overridden:
            module.__dict__.pop("forward", None)
            module.__dict__.pop(attr, None)

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def attach(model: Any, *, device: Any, experts: str | None = "auto", manager: Any = None,
           overrides: tuple[ForwardOverride, ...] = (), fused_layers: bool | None = None,
           batch_invariant: bool = False, fused_router: bool = False) -> Attachment:
    """Make ``model`` a DWDP model (module docstring). ``experts=None`` keeps the model's implementation;
    ``fused_layers=None`` installs them exactly where ``dwdp`` runs on CUDA."""
    att = Attachment(model=model, experts=str(model.config._experts_implementation))
    try:
        for o in overrides:
            module = model.get_submodule(o.path)
            setattr(module, o.state_attr, o.state)
            module.forward = types.MethodType(o.forward, module)
            att._overridden.append((module, o.state_attr))
        if experts is not None:
            name = experts_impl.choose(model, device, experts)
            if name != att.experts:
                if name == experts_impl.IMPL_NAME:
                    experts_impl.register()
                    att._kernel_layouts = experts_impl.attach_layouts(model)
                att._previous_experts = att.experts
                model.set_experts_implementation(name)
                att.experts = name
                log.info("experts implementation: %s", name)
        if fused_layers is None:
            fused_layers = att.experts == experts_impl.IMPL_NAME and experts_impl.device_type(device) == "cuda"
        if fused_layers:
            att.fused = layers_impl.install(model)
        if batch_invariant:
            from dwdp_runtime.kernels import batch_invariant as bi

            att.attention = attention.install_per_sequence(model)
            att.batch_invariant = bi.enable(experts_impl.device_type(device))
            log.info("batch-invariant dense GEMMs on %s, %s attention per packed sequence",
                     experts_impl.device_type(device), att.attention.implementation)
        if fused_router:
            att.routers = router_impl.install(model, device)
            log.info("fused router on %d router modules", len(att.routers))
        if manager is not None:
            layout = getattr(model, "dwdp_layout", None)
            att._saved_data = [(getattr(site.module, p.name), getattr(site.module, p.name).data)
                               for site in experts_sites(model, layout) for p in site.layout.params]
            att.hooks = DwdpHooks(model, manager)
    except BaseException:
        att.close()
        raise
    return att
