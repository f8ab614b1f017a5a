"""DWDP hooks on a `transformers` MoE model: the only place the model meets the prefetch schedule.

  model forward  ── pre-hook:  manager.start_forward()          (once per top-level forward)
  experts(L)     ── pre-hook:  manager.wait_and_bind(L)          (stream-wait for layer L's copies; the hook
                                                                  binds gate_up_proj/down_proj.data = composite)
                 ── kernels of layer L enqueued ──
                 ── hook:      manager.finish_layer(L)           (records the WAR event AFTER the kernels)

The bind hook rebinds every sharded tensor of the experts layout (weights, per-expert biases, scales) to the
composites ``wait_and_bind`` returns: the only place a parameter's ``.data`` changes at run time.

Invariants:
  * the DWDP layer key is the decoder-layer index, registered in forward order by the loader;
  * dense layers have no experts module, hence no hook — they run unchanged;
  * hooks are removed by ``DwdpHooks.remove()`` (idempotent); the model then runs without DWDP calls;
  * only ``attach.attach`` installs them (it also saves and restores the parameters the hook rebinds).
"""

from __future__ import annotations

from typing import Any

from .registry import experts_sites


class DwdpHooks:
    def __init__(self, model: Any, manager: Any):
        self.manager = manager
        self._handles = []
        self.layers: list[int] = []
        self._handles.append(model.register_forward_pre_hook(self._start_forward))
        for site in experts_sites(model, getattr(model, "dwdp_layout", None)):
            self.layers.append(site.layer)
            self._handles.append(site.module.register_forward_pre_hook(self._bind(site.layer)))
            self._handles.append(site.module.register_forward_hook(self._finish(site.layer)))

    def _start_forward(self, module, args):
        self.manager.start_forward()

    def _bind(self, layer: int):
        def hook(module, args):
            for name, tensor in self.manager.wait_and_bind(layer).items():
                getattr(module, name).data = tensor

        return hook

    def _finish(self, layer: int):
        def hook(module, args, output):
            self.manager.finish_layer(layer)

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
