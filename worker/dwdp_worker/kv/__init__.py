"""KV handoff of a DWDP context server (docs/KV_TRANSFER.md).

Modules, one job each: ``params`` (typed wire models), ``blocks`` (pure block allocator and quarantine),
``layout`` (a sequence's KV stream), ``region`` (the registered buffer), ``store`` (budget, TTL, claims,
verdicts), ``nixl_api`` (the one NIXL import), ``server`` (the rank's NIXL service thread), ``service`` (all
of it for one rank), ``address`` (the advertised ``remote_host``), ``options`` (flags, env), ``metrics``,
``prefill`` (packed prefill with the model's cache; greedy continuation). The decode side is
``dwdp_worker.kv.client``. Importing this package needs neither torch nor NIXL.
"""
