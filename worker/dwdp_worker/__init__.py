"""dwdp_worker: the DWDP context-worker process (models, engine, HTTP API, supervisor, launcher)."""
