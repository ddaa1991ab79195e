"""CPU engine daemon: CPU-resident decodes on host KV, run locally or with GPU Dense Assist."""
